"""numpy-naive and numpy-tiled against the reference, every mask, odd lengths and block sizes; memory shape."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.bench.memory import peak_extra_bytes
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.implementations.numpy_tiled import NumpyTiled

MASKS = {
    "none": {},
    "causal-top-left": {"causal": "top-left"},
    "causal-bottom-right": {"causal": "bottom-right"},
    "padding": {"key_padding_mask": np.arange(13)[None, :] >= np.array([13, 6])[:, None]},
    "bool": {"attn_mask": np.random.default_rng(0).random((9, 13)) < 0.5},
    "additive": {"attn_mask": np.where(np.random.default_rng(1).random((9, 13)) < 0.7, 0.3, -np.inf)},
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("blocks", [(1, 1), (4, 5), (8, 13), (64, 64)])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_tiled_matches_reference_for_every_mask_and_block_size(mask, blocks, kv_heads):
    config = AttentionConfig(16, 4, kv_heads, bias=True)
    params = make_params(config)
    inputs = make_inputs(config, 2, 9, 13, **MASKS[mask])
    expected = reference_attention(params, inputs).output
    got = NumpyTiled(*blocks).load(params, dtype="float64").forward(inputs).output
    np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("backend", [NumpyNaive(), NumpyTiled()], ids=lambda b: b.name)
def test_numpy_backends_pass_every_applicable_case(backend):
    report = mha_harness.check(backend, include_slow=False)
    assert report.ok, [f"{r.case}[{r.variant}]: {r.message}" for r in report.failures()]
    assert report.counts()["passed"] > 60


def test_tiled_never_holds_a_full_score_matrix():
    config = AttentionConfig(64, 4)
    params, inputs = make_params(config), make_inputs(config, 1, 1024)
    naive = NumpyNaive().load(params, dtype="float32").prepare(inputs)
    tiled = NumpyTiled(block_q=64, block_k=128).load(params, dtype="float32").prepare(inputs)
    one_score_matrix = 4 * 1024 * 1024 * 4
    assert peak_extra_bytes(naive, "tracemalloc") >= 3 * one_score_matrix
    assert peak_extra_bytes(tiled, "tracemalloc") < one_score_matrix / 4


def test_tiled_rejects_bad_block_sizes():
    with pytest.raises(ValueError, match="block_q: got 0; accepted: a positive integer"):
        NumpyTiled(block_q=0)
