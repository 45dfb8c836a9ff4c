import sys

from llamaswap.cli import main

sys.exit(main())
