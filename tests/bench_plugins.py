"""Plugins that break the benchmark sweep in one way each: hang in prepare(), crash in the call, hog memory, time
nothing; and a layer shaped like an outside user's Llama attention (one x, always causal, grouped-query heads)."""
from __future__ import annotations

import signal
import time

import numpy as np

from mha_harness.contract.api import Capabilities
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded


class _HangsInPrepare(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a native deadlock: only SIGKILL ends it
        while True:
            time.sleep(1)


class _SegfaultsInCall(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        def call():
            import ctypes
            ctypes.string_at(0)
        return call


class _HogsMemory(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        hoard = []

        def call():  # grows by 64 MiB of touched pages per step until something stops it
            while True:
                hoard.append(np.ones(8 * 2 ** 20))
                time.sleep(0.01)
        return call


class HangsInPrepare(NumpyNaive):
    name, loaded_class = "bench-hangs-in-prepare", _HangsInPrepare


class SegfaultsInCall(NumpyNaive):
    name, loaded_class = "bench-segfaults", _SegfaultsInCall


class HogsMemory(NumpyNaive):
    name, loaded_class = "bench-hogs-memory", _HogsMemory


class _HangsAboveT32(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        if inputs.key.shape[1] > 32:
            return _HangsInPrepare.prepare(self, inputs, backward=backward)
        return super().prepare(inputs, backward=backward)


class HangsAboveT32(NumpyNaive):
    name, loaded_class = "bench-hangs-above-t32", _HangsAboveT32


class _DoesNothingWhenTimed(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):  # all the work done here, untimed: the timed call returns it
        out = self.compute(inputs).output
        return lambda: out


class DoesNothingWhenTimed(NumpyNaive):
    name, loaded_class = "does-nothing-when-timed", _DoesNothingWhenTimed


class _LlamaLikeLoaded(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        if not inputs.is_self_attention:
            raise AssertionError(f"a module(x) layer got the {inputs.form} form")
        return super().prepare(inputs, backward=backward)

    def compute(self, inputs, *, need_weights=False):
        if inputs.causal != "top-left":
            raise AssertionError(f"an always-causal top-left layer got causal={inputs.causal!r}")
        return super().compute(inputs, need_weights=need_weights)


class LlamaLikeGQA(NumpyNaive):
    """An outside user's Llama-style grouped-query self-attention, as declared: called as module(x) (inputs="self"),
    always causal top-left, grouped-query heads, no biases; it raises on any call that is not one x, top-left causal
    (the dense NumPy layer underneath, which repeats each key/value head for its group of query heads)."""

    name, loaded_class = "llama-like-gqa", _LlamaLikeLoaded
    capabilities = Capabilities(inputs="self", always_causal=True, causal_alignments=("top-left",),
                                grouped_query=True, bias=False, key_padding_mask=False, bool_attn_mask=False,
                                additive_attn_mask=False)


def _write_junk_to_every_inherited_descriptor():
    """Bytes that look like a frame header promising ~2 GB, written to every descriptor from 3 up: the harness's pipe
    to this worker, the process sentinel, multiprocessing's resource tracker."""
    import os
    for fd in range(3, 256):
        try:
            os.write(fd, b"\x80\x04garbage\xff" * 64)
        except OSError:
            pass


class _WritesJunkToItsPipes(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        def call():
            _write_junk_to_every_inherited_descriptor()
        return call


class WritesJunkToItsPipes(NumpyNaive):
    """A stranger's plugin that hung `bench` for good (> 900 s, past --bench-timeout): the parent waited for a frame
    that never came, then blocked in waitpid on a worker whose sentinel it had written to."""
    name, loaded_class = "bench-writes-junk-to-its-pipes", _WritesJunkToItsPipes


class _FastPathForgetsTheCausalMask(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):  # compute() is right; the benchmarked fast path drops the mask
        unmasked = inputs.replace(causal=None)
        return lambda: self.compute(unmasked).output


class FastPathForgetsTheCausalMask(NumpyNaive):
    """Passes every conformance case (which never runs prepare()), but its benchmarked call attends to future keys."""
    name, loaded_class = "bench-fast-path-forgets-causal-mask", _FastPathForgetsTheCausalMask


class _ReturnsNothingWhenTimed(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        def call():
            self.compute(inputs)
        return call


class ReturnsNothingWhenTimed(NumpyNaive):
    """Does the layer's work in its timed call but returns None: nothing says what it computed."""
    name, loaded_class = "bench-returns-nothing", _ReturnsNothingWhenTimed


class _ComputesFloat64InFloat32(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        low = inputs.replace(**{n: np.asarray(getattr(inputs, n), np.float32) for n in ("query", "key", "value")})
        return lambda: self.compute(low).output.astype(np.float32)


class _AccumulatesIntoItsOutputBuffer(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):  # the accumulator is never zeroed: right on the first call only
        buffer = np.zeros((inputs.batch, inputs.tq, self.config.d_model))

        def call():
            buffer[...] += self.compute(inputs).output
            return buffer
        return call


class AccumulatesIntoItsOutputBuffer(NumpyNaive):
    """Its first call returns the layer's output; every later one adds it again into the same buffer."""
    name, loaded_class = "bench-accumulates-into-its-buffer", _AccumulatesIntoItsOutputBuffer


class _ReportsAQuarterOfItsTime(NumpyNaiveLoaded):
    def prepare(self, inputs, *, backward=False):
        if not getattr(time.perf_counter, "slowed", False):
            real = time.perf_counter
            started = real()
            time.perf_counter = lambda: started + (real() - started) / 4  # every duration measured here shrinks 4x
            time.perf_counter.slowed = True
        return super().prepare(inputs, backward=backward)


class ReportsAQuarterOfItsTime(NumpyNaive):
    """A correct layer whose worker's clock runs at a quarter of its speed: its figures would be 4x faster than its
    calls."""
    name, loaded_class = "bench-reports-a-quarter-of-its-time", _ReportsAQuarterOfItsTime
