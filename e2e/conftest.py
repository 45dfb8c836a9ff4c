import sys
import pathlib

# e2e modules import each other as a package-less folder.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
