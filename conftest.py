"""Test helpers are plain modules in tests/ and e2e/, imported one way: by their own names
(`from harness import running_stack`, `from policies import serial`)."""

import pathlib
import sys

for folder in ("tests", "e2e"):
    path = str(pathlib.Path(__file__).parent / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
