"""``python -m lowlevel_fd``: the command line of ``lowlevel_fd.cli``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
