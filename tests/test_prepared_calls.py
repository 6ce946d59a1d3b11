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


@pytest.mark.parametrize("name", ("torch-eager", "torch-sdpa-flash-cpu", "torch-nn-mha"))
def test_a_torch_forward_backward_call_leaves_no_gradient_resident_for_the_next(registry, name):
    """A built-in torch forward + backward call returns its gradients and keeps none on its leaves: the next call
    starts without the previous call's gradients resident, so its peak memory (RSS over what was in use before)
    counts the gradients it makes. Kept on the leaves until the next call cleared them, they sat in the baseline and
    SDPA flash's forward + backward read 3.4 MiB at T = 512 against its forward's 4.1 (two strangers saw it)."""
    import mha_harness
    from mha_harness.contract.params import make_inputs, make_params
    entry = registry.get(name)
    if not entry.available:
        pytest.skip(f"{name} is not available here")
    params = make_params(mha_harness.AttentionConfig(32, 4), seed=0)
    loaded = entry.backend.load(params, dtype="float32")
    run = loaded.prepare(make_inputs(params.config, 1, 16, seed=0, self_attention=True), backward=True)
    before = _holding_a_gradient()
    grads = run()
    assert grads["query"] is not None
    left = _holding_a_gradient() - before
    assert not left, f"{len(left)} tensors still hold a .grad after the call"


def _holding_a_gradient() -> set[int]:
    """The ids of the live torch tensors that hold a .grad."""
    import gc

    import torch
    return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad is not None}
