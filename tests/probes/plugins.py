"""Sources of the hostile plugins issue 13's probes write into a temporary folder (never imported from tests/).

The probes give them to ``mha-harness`` from outside, as a user would: ``--backend-spec module:object`` with the
folder on ``PYTHONPATH``, or as entry points (a ``*.dist-info`` folder beside them). Every process a plugin
starts carries the probe's marker (``$H13_MARK``) in its command line, so the probe finds orphans with ``ps``.
"""
from __future__ import annotations

COMMON = '''
import os
import subprocess
import sys
import time

import numpy as np

from mha_harness import AttentionOutput
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

MARK = os.environ.get("H13_MARK", "h13-probe-unmarked")


def spawn_child():
    """A child that inherits stdout/stderr and sleeps 10 minutes, the marker in its command line."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", MARK])


def hostile(attribute, name, compute=None, **attrs):
    """A NumpyNaive subclass stored as ``attribute`` of its module (so a bench worker can unpickle it)."""
    loaded = type(attribute + "Loaded", (NumpyNaiveLoaded,), {"compute": compute} if compute else {})
    globals()[attribute + "Loaded"] = loaded
    return type(attribute, (NumpyNaive,), {"name": name, "loaded_class": loaded, **attrs})
'''

PLUGINS = {
    "h13plug.py": COMMON + '''

def _exit0(self, inputs, *, need_weights=False):
    sys.exit(0)


def _interrupt(self, inputs, *, need_weights=False):
    raise KeyboardInterrupt


def _hang(self, inputs, *, need_weights=False):
    time.sleep(3600)


def _crash(self, inputs, *, need_weights=False):
    os._exit(3)


def _child_then_correct(self, inputs, *, need_weights=False):
    if not getattr(type(self), "spawned", False):
        type(self).spawned = True
        spawn_child()
    return NumpyNaiveLoaded.compute(self, inputs, need_weights=need_weights)


def _hog(self, inputs, *, need_weights=False):
    hoard = []
    for _ in range(4096):  # up to 256 GiB, touched page by page: the kernel's OOM killer ends it first
        block = np.ones(64 * 2**20 // 8)
        hoard.append(block)
    return NumpyNaiveLoaded.compute(self, inputs, need_weights=need_weights)


def _drifts_from_third_call(self, inputs, *, need_weights=False):
    self.calls = getattr(self, "calls", 0) + 1
    out = NumpyNaiveLoaded.compute(self, inputs, need_weights=need_weights)
    if self.calls >= 3:
        return AttentionOutput(out.output + 1e-3 * self.calls, out.weights)
    return out


def _forged_error(self, inputs, *, need_weights=False):
    raise RuntimeError("boom\\n\\n## Mutation score\\n\\n36 of 36 mutants caught <script>alert(1)</script>")


def _availability_child(self):
    spawn_child()
    return None


ExitInWorker = hostile("ExitInWorker", "h13-exit0-in-worker", _exit0)
InterruptInWorker = hostile("InterruptInWorker", "h13-interrupt-in-worker", _interrupt)
HangsInWorker = hostile("HangsInWorker", "h13-hangs-in-worker", _hang)
CrashesInWorker = hostile("CrashesInWorker", "h13-crashes-in-worker", _crash)
ChildInWorker = hostile("ChildInWorker", "h13-child-in-worker", _child_then_correct)
HogInWorker = hostile("HogInWorker", "h13-hog-in-worker", _hog)
DriftsFromThirdCall = hostile("DriftsFromThirdCall", "h13-drifts-from-third-call", _drifts_from_third_call)
ForgedMarkdown = hostile("ForgedMarkdown", "h13 forged |\\n\\n## Mutation score\\n\\n<img src=x onerror=alert(1)>",
                         _forged_error)
ChildInAvailability = hostile("ChildInAvailability", "h13-child-in-availability", availability=_availability_child)
Correct = hostile("Correct", "h13-correct")
''',
    "h13slow_import.py": COMMON + '''
time.sleep(float(os.environ.get("H13_IMPORT_SECONDS", "6")))
Backend = hostile("Backend", "h13-slow-import")
''',
    "h13import_exit.py": "import sys\nsys.exit(0)\n",
    "h13import_interrupt.py": "raise KeyboardInterrupt\n",
    "h13import_hang.py": "import time\ntime.sleep(3600)\n",
    "h13import_child.py": COMMON + '''
spawn_child()
Backend = hostile("Backend", "h13-import-child")
''',
}

#: entry points (group mha_harness.backends) of a distribution 'h13probe' whose imports attack the harness
ENTRY_POINTS = {
    "h13probe-0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: h13probe\nVersion: 0.0\n",
    "h13probe-0.0.dist-info/entry_points.txt": ("[mha_harness.backends]\n"
                                                "h13-exit = h13import_exit:Backend\n"
                                                "h13-interrupt = h13import_interrupt:Backend\n"
                                                "h13-hang = h13import_hang:Backend\n"
                                                "h13-sysexit = sys:exit\n"),
}
