"""A plugin module that, while it is imported, starts a child holding stdout/stderr for 10 minutes (the marker
``$MHA_HOSTILE_MARK`` in its command line, so a test can look for it)."""
import os
import subprocess
import sys

from mha_harness.implementations.numpy_naive import NumpyNaive

subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", os.environ.get("MHA_HOSTILE_MARK", "x")])


class Backend(NumpyNaive):
    name = "hostile-child-at-import"
