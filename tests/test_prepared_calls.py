"""The prepared callables that ``mha-harness bench`` and asv time run for every call they are given: each built-in
CPU backend, prefill (Tq = Tk, causal top-left) and decode (Tq < Tk, causal bottom-right) shapes with and without
the causal mask, forward and (where it declares gradients) forward + backward. A JAX forward + backward once
differentiated its bool causal mask and raised in prepare(). ``prepared_call`` checks each forward call's output
against the float64 reference (mha_harness.bench.verify): every built-in's benchmarked call computes the layer."""
from __future__ import annotations

import pytest

from mha_harness.bench.calls import prepared_call, unsupported
from mha_harness.bench.metrics import Shape
from mha_harness.registry import load_registry
from tests.test_conformance_all import COMPILED

#: the built-in CPU backends that bench times (the compiled ones are covered by tests/test_torch_compiled.py)
BACKENDS = ("numpy-naive", "numpy-tiled", "torch-eager", "torch-sdpa-math-cpu", "torch-sdpa-flash-cpu",
            "torch-nn-mha", "onnxruntime-cpu", "jax-explicit", "jax-dpa", "flax-mha")


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name", BACKENDS)
def test_prepared_call_runs_for_prefill_and_decode_with_and_without_causal_mask(registry, name, backward):
    assert name not in COMPILED
    entry = registry.get(name)
    if not entry.available:
        pytest.skip(f"{name} is not available here")
    if backward and not entry.backend.capabilities.gradients:
        pytest.skip(f"{name} declares no gradients: bench times its forward only")
    ran = []
    for tq, tk in ((16, 16), (4, 16)):
        for causal in (False, True):
            shape = Shape(1, tq, tk, 32, 4, causal=causal, backward=backward)
            if unsupported(entry.backend, shape) is None:
                run = prepared_call(entry.backend, shape)
                run()
                run()
                ran.append(shape)
    assert any(s.causal for s in ran), f"{name}: no causal call was prepared"
