"""torch-flex-cpu and torch-compile-cpu: availability reasons, agreement with torch-eager, the FlexAttention
block-mask workaround, and one compiled function per process (new parameters reuse it)."""
from __future__ import annotations

import os
import stat

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


@pytest.mark.parametrize("batch, tq, tk, masks", [
    # lengths off FlexAttention's 128 blocks, batch > 1: torch 2.13.0 CPU gave wrong outputs here (error ~1 at
    # batch 3, T = 8; 0.07 at Tq = 129, Tk = 1000 with block_mask=None); the backend pads to whole blocks
    (3, 129, 1000, {}),
    (2, 7, 7, {"causal": "top-left"}),
    (2, 5, 9, {"causal": "bottom-right"}),  # same bucketed shape and kind: reuses the graph of the line above
])
def test_flex_matches_torch_eager(batch, tq, tk, masks):
    if torch_flex.flex_reason("cpu"):
        pytest.skip(torch_flex.flex_reason("cpu"))
    config = AttentionConfig(64, 8, bias=True)
    params = make_params(config, seed=0)
    inputs = make_inputs(config, batch, tq, tk, seed=3, self_attention=False, **masks)
    got = torch_flex.TorchFlex("cpu").load(params).forward(inputs).output
    want = TorchEager().load(params).forward(inputs).output
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_flex_per_head_bool_and_additive_masks_with_padding_match_torch_eager():
    """The lookup mask_mod and the score_mod on a (B, H, Tq, Tk) table: per-head masks gave NaN rows before."""
    if torch_flex.flex_reason("cpu"):
        pytest.skip(torch_flex.flex_reason("cpu"))
    config = AttentionConfig(32, 4)
    params = make_params(config, seed=0)
    rng = np.random.default_rng(5)
    allowed = rng.random((2, 4, 7, 9)) > 0.3
    allowed[..., 0] = True
    padding = np.zeros((2, 9), bool)
    padding[1, 6:] = True
    bias = rng.standard_normal((2, 4, 7, 9))
    base = make_inputs(config, 2, 7, 9, seed=4, self_attention=False)
    flex = torch_flex.TorchFlex("cpu").load(params)
    for inputs in (base.replace(attn_mask=allowed, key_padding_mask=padding),
                   base.replace(attn_mask=bias, key_padding_mask=padding)):
        got = flex.forward(inputs).output
        want = TorchEager().load(params).forward(inputs).output
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_flex_buckets_lengths_to_whole_blocks():
    assert [torch_flex.bucket(n) for n in (1, 127, 128, 129, 1000, 2048)] == [128, 128, 128, 256, 1024, 2048]


def test_flex_cpu_declares_no_gradients_while_torch_refuses_its_backward():
    """When a torch release adds CPU backward to FlexAttention this fails: then declare gradients on CPU."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    assert torch_flex.TorchFlex("cpu").capabilities.gradients is False
    assert torch_flex.TorchFlex("cuda").capabilities.gradients is True
    q = torch.zeros(1, 1, 128, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)


def test_inductor_cache_goes_to_a_private_folder(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from mha_harness.implementations import _torch_common
    monkeypatch.setattr(_torch_common, "_INDUCTOR_CACHE", [])
    monkeypatch.setenv("MHA_HARNESS_TORCH_CACHE", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch._dynamo writes
    folder = _torch_common.use_private_inductor_cache()
    assert folder == str(tmp_path / "inductor") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    monkeypatch.setattr(_torch_common, "_INDUCTOR_CACHE", [])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own choice is kept
    assert _torch_common.use_private_inductor_cache() == str(tmp_path / "mine")


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


def test_registered_like_the_other_builtins_so_bench_and_asv_pick_them_up():
    """benchmarks/_common.py, the bench sweep and conformance all take every registered backend."""
    from mha_harness.registry import builtin_entry_points
    assert {"torch-flex", "torch-compile"} <= {ep.name for ep in builtin_entry_points()}
    registry = mha_harness.load_registry()
    assert {"torch-flex-cpu", "torch-flex-cuda", "torch-compile-cpu"} <= set(registry.names())
    assert registry.get("torch-flex-cpu").reason_unavailable == torch_flex.flex_reason("cpu")
    assert registry.get("torch-compile-cpu").reason_unavailable == torch_compile.compile_reason("cpu")
