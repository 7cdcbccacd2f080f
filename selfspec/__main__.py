"""``python -m selfspec ...``: the same command line as ``selfspec ...`` (selfspec.cli)."""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main())
