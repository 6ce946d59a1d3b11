import sys

from mha_harness.cli import main

sys.exit(main())
