"""Deliberately hostile plugins for the fault-injection tests. Each breaks in one way."""
from __future__ import annotations

import os
import time

import numpy as np

from mha_harness.contract.api import AttentionOutput
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded


class _Raises(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        raise RuntimeError("plugin bug: forward exploded")


class _WrongShape(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        out = super().compute(inputs, need_weights=need_weights)
        return AttentionOutput(out.output[..., :-1], out.weights)


class _NaN(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        out = super().compute(inputs, need_weights=need_weights)
        return AttentionOutput(np.full_like(out.output, np.nan), out.weights)


class _Hangs(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        time.sleep(3600)


class _Exits(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        os._exit(17)


class _Segfaults(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        import ctypes
        ctypes.string_at(0)


class _RefusesCrossShapes(NumpyNaiveLoaded):
    """A layer written for self-attention: a call with Tq != Tk fails on a broadcast, as such layers do."""

    def compute(self, inputs, *, need_weights=False):
        if inputs.tq != inputs.tk:
            raise ValueError(f"operands could not be broadcast together with shapes ({inputs.tq},) ({inputs.tk},)")
        return super().compute(inputs, need_weights=need_weights)


def _hostile(name, loaded):
    return type(name, (NumpyNaive,), {"name": name, "loaded_class": loaded})


RaisesInForward = _hostile("hostile-raises", _Raises)
WrongShape = _hostile("hostile-wrong-shape", _WrongShape)
ReturnsNaN = _hostile("hostile-nan", _NaN)
Hangs = _hostile("hostile-hangs", _Hangs)
KillsProcess = _hostile("hostile-exits", _Exits)
Segfaults = _hostile("hostile-segfault", _Segfaults)
RefusesCrossShapes = _hostile("hostile-refuses-cross-shapes", _RefusesCrossShapes)


# --- plugins that try to reach the verdict, or the harness's exit code ----------------------------------------

class _PatchesTheVerdict(NumpyNaiveLoaded):
    """Wrong by 50 %, and patches everything a verdict computed in its own process would use."""

    def compute(self, inputs, *, need_weights=False):
        out = super().compute(inputs, need_weights=need_weights)
        import sys

        import mha_harness.conformance.casekit as casekit
        import mha_harness.conformance.runner as runner
        import mha_harness.contract.tolerance as tolerance
        from mha_harness.conformance.results import Status
        runner._execute = lambda *args, **kwargs: (Status.PASSED, "", 0.0, None)
        casekit.assert_close = lambda *args, **kwargs: 0.0
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("mha_harness.cases") and hasattr(module, "assert_close"):
                module.assert_close = casekit.assert_close
        tolerance.tolerance_from = lambda expected, *a, **k: tolerance.Tolerance(float("inf"), 0.0, "float32")
        np.testing.assert_allclose = lambda *args, **kwargs: None
        np.exp = lambda x, *args, **kwargs: np.ones_like(x)
        return AttentionOutput(out.output * 1.5, out.weights)


class _Complex(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        out = super().compute(inputs, need_weights=need_weights)
        return AttentionOutput(out.output + 1e-3j, out.weights)


class _ObjectArray(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        out = super().compute(inputs, need_weights=need_weights)
        return AttentionOutput(out.output.astype(object), out.weights)


class _SystemExit(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        raise SystemExit(0)


class _KeyboardInterrupt(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        raise KeyboardInterrupt


class _GeneratorExit(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        raise GeneratorExit


class _SpawnsChild(NumpyNaiveLoaded):
    """Starts a long-lived child that inherits stdout and writes its pid where the test can find it."""

    def compute(self, inputs, *, need_weights=False):
        import subprocess
        child = subprocess.Popen(["sleep", "600"])
        path = os.environ.get("MHA_HOSTILE_PID_FILE")
        if path:
            with open(path, "a") as f:
                f.write(f"{child.pid}\n")
        return super().compute(inputs, need_weights=need_weights)


class _KilledBySignal9(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


class _WritesJunkToItsPipes(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        from tests.bench_plugins import _write_junk_to_every_inherited_descriptor
        _write_junk_to_every_inherited_descriptor()
        return super().compute(inputs, need_weights=need_weights)


class _PythonList(NumpyNaiveLoaded):
    """Returns its right output as nested Python lists inside an AttentionOutput (a stranger's: it passed)."""

    def compute(self, inputs, *, need_weights=False):
        return AttentionOutput(super().compute(inputs).output.tolist())


class _ForgetsToReturn(NumpyNaiveLoaded):
    """Computes its right output and forgets the ``return``: ``compute`` gives None."""

    def compute(self, inputs, *, need_weights=False):
        super().compute(inputs, need_weights=need_weights)


class _OutputNone(NumpyNaiveLoaded):
    """Returns an AttentionOutput whose output is None."""

    def compute(self, inputs, *, need_weights=False):
        return AttentionOutput(None)


class _ExitsZeroAtLoad(NumpyNaive):
    name = "hostile-exit0-at-load"

    def load_native(self, params, dtype):
        import sys
        sys.exit(0)


WritesJunkToItsPipes = _hostile("hostile-writes-junk-to-its-pipes", _WritesJunkToItsPipes)
PatchesTheVerdict = _hostile("hostile-patches-verdict", _PatchesTheVerdict)
ReturnsComplex = _hostile("hostile-complex", _Complex)
ReturnsObjects = _hostile("hostile-object", _ObjectArray)
ReturnsPythonList = _hostile("hostile-python-list", _PythonList)
RaisesSystemExit = _hostile("hostile-systemexit", _SystemExit)
RaisesKeyboardInterrupt = _hostile("hostile-keyboardinterrupt", _KeyboardInterrupt)
RaisesGeneratorExit = _hostile("hostile-generatorexit", _GeneratorExit)
SpawnsChild = _hostile("hostile-spawns-child", _SpawnsChild)
KilledBySignal9 = _hostile("hostile-sigkill", _KilledBySignal9)
ExitsZeroAtLoad = _ExitsZeroAtLoad
ForgetsToReturn = _hostile("hostile-forgets-return", _ForgetsToReturn)
ReturnsNoneOutput = _hostile("hostile-none-output", _OutputNone)
