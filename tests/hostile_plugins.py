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


def _hostile(name, loaded):
    return type(name, (NumpyNaive,), {"name": name, "loaded_class": loaded})


RaisesInForward = _hostile("hostile-raises", _Raises)
WrongShape = _hostile("hostile-wrong-shape", _WrongShape)
ReturnsNaN = _hostile("hostile-nan", _NaN)
Hangs = _hostile("hostile-hangs", _Hangs)
KillsProcess = _hostile("hostile-exits", _Exits)
Segfaults = _hostile("hostile-segfault", _Segfaults)
