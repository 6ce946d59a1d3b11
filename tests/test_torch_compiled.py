"""torch-flex-cpu and torch-compile-cpu: availability reasons, agreement with torch-eager, the FlexAttention
block-mask workaround, and one compiled function per process (new parameters reuse it)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import mha_harness  # noqa: E402
from mha_harness.contract.api import AttentionConfig  # noqa: E402
from mha_harness.contract.params import make_inputs, make_params  # noqa: E402
from mha_harness.implementations import torch_compile, torch_flex  # noqa: E402
from mha_harness.implementations.torch_eager import TorchEager  # noqa: E402


def test_without_a_cxx_compiler_the_cpu_backends_say_so(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(torch_flex.shutil, "which", lambda name: None)
    assert "no C++ compiler" in torch_flex.TorchFlex("cpu").availability()
    assert "no C++ compiler" in torch_compile.TorchCompile("cpu").availability()


def test_cuda_variant_names_the_missing_device():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert "no CUDA device" in torch_flex.TorchFlex("cuda").availability()


def test_loadable_as_module_object_specs():
    registry = mha_harness.load_registry(["mha_harness.implementations.torch_flex:backends",
                                          "mha_harness.implementations.torch_compile:backends"])
    for name in ("torch-flex-cpu", "torch-flex-cuda", "torch-compile-cpu"):
        assert name in registry.names()


@pytest.mark.parametrize("tq, tk, masks", [
    (129, 1000, {}),  # Tk not a multiple of FlexAttention's 128-key block, no mask: the block_mask=None bug
    (7, 7, {"causal": "top-left"}),
    (5, 9, {"causal": "bottom-right"}),
])
def test_flex_matches_torch_eager(tq, tk, masks):
    if torch_flex.flex_reason("cpu"):
        pytest.skip(torch_flex.flex_reason("cpu"))
    config = AttentionConfig(64, 8, bias=True)
    params = make_params(config, seed=0)
    inputs = make_inputs(config, 1, tq, tk, seed=3, self_attention=False, **masks)
    got = torch_flex.TorchFlex("cpu").load(params).forward(inputs).output
    want = TorchEager().load(params).forward(inputs).output
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_compile_backend_reuses_one_compiled_layer_and_matches_eager():
    if torch_compile.compile_reason("cpu"):
        pytest.skip(torch_compile.compile_reason("cpu"))
    config = AttentionConfig(32, 4)
    backend = torch_compile.TorchCompile("cpu")
    inputs = make_inputs(config, 2, 6, seed=1, causal="top-left")
    first = backend.load(make_params(config, seed=0))
    second = backend.load(make_params(config, seed=1))
    assert first.layer is second.layer is torch_compile.compiled_layer()
    for seed, loaded in ((0, first), (1, second)):
        want = TorchEager().load(make_params(config, seed=seed)).forward(inputs).output
        np.testing.assert_allclose(loaded.forward(inputs).output, want, atol=1e-5, rtol=0)
