import sys

from mha_harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
