"""``python -m deepinfer.router [flags]`` is ``deepinfer router [flags]``."""

import sys

from deepinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["router", *sys.argv[1:]]))
