"""``python -m deepinfer.server [flags]`` is ``deepinfer serve [flags]``."""

import sys

from deepinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
