import sys

from llamaswap.commands.main import main

sys.exit(main())
