"""``python -m flashdsa`` = the ``flashdsa`` command (see :mod:`flashdsa.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
