"""``python -m largebatch`` (and ``torchrun -m largebatch``) == the ``largebatch`` command."""

from largebatch.cli import console

if __name__ == "__main__":
    console()
