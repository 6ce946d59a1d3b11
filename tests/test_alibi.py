"""ALiBi (``AttentionConfig.alibi``, declared by ``Capabilities.alibi``): each head's scores biased by the distance
between query and key positions, with the paper's slopes. The slopes and the reference against independent
transcriptions (the paper's code, BLOOM's and flash-attn's bias), the declarations and refusals, the backends, the
case and its mutants, search, and the diagnoses of mistakes no zoo mutant carries."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, Capabilities
from mha_harness.contract.conventions import ALIBI_KINDS, alibi_slopes
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from tests.test_sliding_window import projected_heads

CASE = "check_alibi_output_matches_reference"


def _papers_slopes(n):
    """The ALiBi paper's ``get_slopes`` (ofirpress/attention_with_linear_biases), as BLOOM copies it."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _papers_slopes(2 * closest)[0::2][:n - closest]


@pytest.mark.parametrize("n", range(1, 33))
def test_the_slopes_are_the_papers_at_every_head_count(n):
    np.testing.assert_allclose(alibi_slopes(n), _papers_slopes(n), rtol=1e-13)  # its powers of a power round


def test_the_slopes_at_eight_and_six_heads_are_the_ones_people_quote():
    np.testing.assert_array_equal(alibi_slopes(8), [2.0 ** -h for h in range(1, 9)])
    np.testing.assert_array_equal(alibi_slopes(6), [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])


def _biased_attention(params, inputs, bias_of):
    """Attention written per query row with ``bias_of(head, query position, key positions)`` added to the scaled
    scores, the call's causal mask at the queries' positions (the last Tq of the Tk)."""
    c = params.config
    q, k, v = projected_heads(params, inputs)
    tq, tk = inputs.tq, inputs.tk
    out = np.zeros(q.shape)
    for i in range(tq):
        p = i + tk - tq
        seen = np.array([j for j in range(tk) if inputs.causal is None or j <= p])
        for h in range(c.num_heads):
            s = q[:, h, i, None, :] @ k[:, h, seen].transpose(0, 2, 1) / np.sqrt(c.d_head) + bias_of(h, p, seen)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, h, i] = ((w / w.sum(axis=-1, keepdims=True)) @ v[:, h, seen])[:, 0]
    return out.transpose(0, 2, 1, 3).reshape(inputs.batch, tq, c.d_model) @ params.W_o + params.b_o


@pytest.mark.parametrize("heads, kv_heads, tq, tk", [(8, None, 12, 12), (6, None, 5, 12), (8, 2, 3, 17)])
def test_the_linear_bias_is_blooms_slope_times_key_position_under_the_causal_mask(heads, kv_heads, tq, tk):
    """BLOOM adds ``m_h * s`` (the key's position only), which differs from ``-m_h (p - s)`` by a constant per row."""
    config = AttentionConfig(heads * 4, heads, kv_heads, bias=True, alibi="linear")
    params = make_params(config, seed=4)
    inputs = make_inputs(config, 2, tq, tk, seed=5, causal="bottom-right")
    slopes = _papers_slopes(heads)
    np.testing.assert_allclose(reference_attention(params, inputs).output,
                               _biased_attention(params, inputs, lambda h, p, s: slopes[h] * s), atol=1e-12)


@pytest.mark.parametrize("tq, tk, causal", [(9, 9, None), (4, 13, None), (4, 13, "bottom-right")])
def test_the_symmetric_bias_is_flash_attns_minus_slope_times_absolute_distance(tq, tk, causal):
    """flash-attn: ``-alibi_slope * |i + seqlen_k - seqlen_q - j|``, with or without the causal mask."""
    config = AttentionConfig(32, 4, bias=True, alibi="symmetric")
    params = make_params(config, seed=6)
    inputs = make_inputs(config, 2, tq, tk, seed=7, causal=causal)
    slopes = _papers_slopes(4)
    np.testing.assert_allclose(reference_attention(params, inputs).output,
                               _biased_attention(params, inputs, lambda h, p, s: -slopes[h] * np.abs(p - s)),
                               atol=1e-12)


def test_the_two_kinds_agree_under_the_causal_mask_and_differ_where_later_keys_are_visible():
    params = {kind: make_params(AttentionConfig(32, 4, alibi=kind), seed=2) for kind in ALIBI_KINDS}
    config = params["linear"].config
    causal = make_inputs(config, 1, 10, 10, seed=3, causal="bottom-right")
    full = make_inputs(config, 1, 10, 10, seed=3)
    out = {kind: reference_attention(p, causal).output for kind, p in params.items()}
    np.testing.assert_allclose(out["linear"], out["symmetric"], atol=1e-14)
    assert np.abs(reference_attention(params["linear"], full).output
                  - reference_attention(params["symmetric"], full).output).max() > 1e-3


def test_a_malformed_alibi_is_refused_naming_the_field_and_the_kinds():
    with pytest.raises(ValueError, match=r"alibi: got 'bloom'; accepted: None \(no ALiBi bias\), 'symmetric', "
                                         r"'linear'"):
        AttentionConfig(32, 4, alibi="bloom")
    with pytest.raises(ValueError, match=r"Capabilities.alibi"):
        Capabilities(alibi=("sinusoidal",))
    with pytest.raises(ValueError, match=r"num_heads: got 0"):
        alibi_slopes(0)


def test_a_backend_that_declares_no_alibi_refuses_an_alibi_layer_naming_it():
    class Plain(NumpyNaive):
        name = "plain"
        capabilities = Capabilities()
    params = make_params(AttentionConfig(32, 4, alibi="symmetric"))
    with pytest.raises(ValueError, match=r"alibi: got 'symmetric' but plain declares no ALiBi bias "
                                         r"\(Capabilities.alibi is empty\); accepted: None"):
        Plain().load(params)


def test_the_builtins_that_declare_alibi_pass_the_case_and_the_others_skip_naming_it():
    report = mha_harness.check(["numpy-naive", "torch-eager", "numpy-tiled"], cases=[CASE], isolate=False)
    by_backend = {}
    for r in report.results:
        by_backend.setdefault(r.backend, set()).add(r.status)
    assert by_backend["numpy-naive"] == {"passed"} and by_backend["torch-eager"] == {"passed"}
    assert by_backend["numpy-tiled"] == {"skipped"}
    skip = next(r for r in report.results if r.backend == "numpy-tiled")
    assert "does not declare alibi (Capabilities.alibi" in skip.message
    # both kinds, BLOOM's row in every declared dtype
    variants = {(r.params["alibi"], r.params["dtype"], r.params["variant"]) for r in report.results
                if r.backend == "torch-eager"}
    assert {("linear", d, "bloom_causal") for d in ("float32", "float64", "float16", "bfloat16")} <= variants
    assert ("symmetric", "float32", "new_queries_grouped_query") in variants


def test_the_gradients_flow_through_the_alibi_bias():
    report = mha_harness.check(["torch-eager"], cases=["check_gradients_match_reference"], isolate=False)
    alibi = [r for r in report.results if r.params.get("alibi")]
    assert {r.params["alibi"] for r in alibi} == set(ALIBI_KINDS)
    assert all(r.status == "passed" for r in alibi), [r.message for r in alibi]


class _SlopesOfKeyValueHeads(NumpyNaiveLoaded):
    """Grouped-query ALiBi whose slopes are the key/value heads', each repeated for its group."""

    def alibi(self, tq, tk):
        c = self.config
        bias = super().alibi(tq, tk)
        if bias is None:
            return None
        per_kv = np.repeat(alibi_slopes(c.kv_heads), c.group)
        return bias / alibi_slopes(c.num_heads)[None, :, None, None] * per_kv[None, :, None, None]


class _SignFlipped(NumpyNaiveLoaded):
    def alibi(self, tq, tk):
        bias = super().alibi(tq, tk)
        return None if bias is None else -bias


class _NotApplied(NumpyNaiveLoaded):
    def alibi(self, tq, tk):
        return None


def _layer(loaded):
    return type(f"Layer{loaded.__name__}", (NumpyNaive,), {"name": f"alibi{loaded.__name__.lower()}",
                                                          "loaded_class": loaded})()


@pytest.mark.parametrize("loaded, words", [
    (_SlopesOfKeyValueHeads, "ALiBi slopes of the 2 key/value heads, each repeated for its group of 4"),
    (_SignFlipped, "the ALiBi bias with its sign flipped"),
    (_NotApplied, "attention without its ALiBi bias: config.alibi = 'symmetric' is not applied"),
])
def test_mistakes_without_a_zoo_mutant_are_named_too(loaded, words):
    report = mha_harness.check([_layer(loaded)], cases=[CASE], isolate=False)
    mine = [r for r in report.results if r.params.get("variant") == "new_queries_grouped_query"
            and r.params.get("alibi") == "symmetric" and r.params.get("dtype") == "float32"]
    assert mine and mine[0].status == "failed", mine
    assert words in mine[0].message, mine[0].message
    assert "half precision" not in mine[0].message


def test_search_draws_alibi_for_a_backend_that_declares_it_and_names_it_in_the_example():
    from hypothesis import given, settings

    from mha_harness.conformance.search import describe
    from mha_harness.conformance.strategies import SearchSpace, examples
    from mha_harness.implementations.numpy_tiled import NumpyTiled
    space = SearchSpace.for_backend(NumpyNaive(), quick=True)
    assert space.alibi == ALIBI_KINDS
    assert SearchSpace.for_backend(NumpyTiled(), quick=True).alibi == ()
    drawn = set()

    @settings(max_examples=60, database=None, deadline=None)
    @given(examples(space))
    def draw(example):
        drawn.add(example.get("alibi"))
        if example.get("alibi"):
            assert f"alibi {example['alibi']}" in describe(example)
    draw()
    assert {None, "symmetric", "linear"} <= drawn


def test_the_policy_table_says_which_backends_bias_by_distance():
    report = mha_harness.check(["numpy-naive"], cases=[CASE], isolate=False)
    assert "biased by distance (ALiBi) in the layers whose config asks (symmetric, linear declared)" in \
        report.policies()["numpy-naive"]["scores"]


@pytest.mark.parametrize("behaviour, capability", [("score_scale:1.0", "Capabilities(score_scale=1.0)"),
                                                   ("alibi:linear", "Capabilities(alibi=(\"linear\",))")])
def test_a_divergence_naming_a_layer_feature_points_to_its_capability(behaviour, capability):
    """An outside user's T5 wrapper declared its unscaled scores as a divergence: the refusal names the capability."""
    with pytest.raises(ValueError, match=r"Divergence behaviour: got .*declares it as a capability, "
                                         + re.escape(capability)):
        mha_harness.Divergence("check_scores_scaled_by_sqrt_d_head", behaviour, "by design")


class _AlwaysAlibi(NumpyNaiveLoaded):
    """BLOOM's bias whatever the config says (the layer always builds it)."""

    def alibi(self, tq, tk):
        from mha_harness.contract.conventions import alibi_bias
        return alibi_bias("linear", self.config.num_heads, tq, tk)[None]


def test_a_bias_always_on_in_a_layer_built_without_alibi_is_named_not_fitted_as_a_soft_cap():
    """An outside user's BLOOM wrapper applied ALiBi whatever the config said: named as such (it was told of a soft
    cap at 1000 and of the scores' normalisation)."""
    report = mha_harness.check([_layer(_AlwaysAlibi)], cases=["check_output_matches_reference"], isolate=False,
                               include_slow=False)
    failed = [r for r in report.results if r.status == "failed"]
    assert failed
    named = [r for r in failed if "an ALiBi bias ('linear': -m (p - s), the paper's slopes) in a layer built without "
                                  "one (config.alibi is None)" in r.message]
    assert len(named) >= len(failed) // 2, [r.message[-300:] for r in failed]
    assert not any("soft-capped" in r.message for r in named)


def test_a_layer_without_a_causal_alignment_runs_every_alibi_row_unmasked():
    """An encoder's ALiBi layer (MPT's bidirectional one) runs the causal rows without the mask, so the 6-head row
    catches wrong slopes there too; BLOOM's row runs in each of its dtypes."""
    class Encoder(NumpyNaive):
        name = "alibi-encoder"
        capabilities = Capabilities(causal_alignments=(), dtypes=("float32", "float64"), alibi=("symmetric",))

    class EncoderNaiveSlopes(Encoder):
        name = "alibi-encoder-naive-slopes"

        def load_native(self, params, dtype):
            from mha_harness.implementations.mutants.zoo import AlibiSlopesPowerOfTwoFormula
            return AlibiSlopesPowerOfTwoFormula(params, dtype)
    report = mha_harness.check([Encoder(), EncoderNaiveSlopes()], cases=[CASE], isolate=False)
    mine = [r for r in report.results if r.backend == "alibi-encoder"]
    assert {r.status for r in mine} == {"passed"} and len(mine) == 7, [(r.status, r.message) for r in mine]
    naive = {r.params["variant"]: r for r in report.results if r.backend == "alibi-encoder-naive-slopes"}
    assert naive["six_heads"].status == "failed" and "2 ** (-8 h / n)" in naive["six_heads"].message
