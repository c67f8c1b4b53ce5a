"""``python -m largebatch`` (and ``torchrun -m largebatch``) == the ``largebatch`` command."""

import sys

from largebatch.cli import main

if __name__ == "__main__":
    sys.exit(main())
