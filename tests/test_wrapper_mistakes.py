"""Mistakes a wrapper makes loading a library's layer (an outside user's Equinox copies): the diagnoses that name
them, and the precision guesses that must not appear where no precision can explain a failure."""
from __future__ import annotations

import numpy as np

import mha_harness
from mha_harness.conformance.casekit import CaseFailure, assert_close
from mha_harness.contract.tolerance import Tolerance
from mha_harness.implementations.mutants.zoo import PaddingOnQueryAxis, ScaleByDHead, WeightsUntransposed
from mha_harness.implementations.numpy_naive import NumpyNaive


def _backend(loaded, **capabilities):
    caps = NumpyNaive.capabilities if not capabilities else mha_harness.Capabilities(**capabilities)
    return type(f"With{loaded.__name__}", (NumpyNaive,), {"name": f"with-{loaded.__name__}", "loaded_class": loaded,
                                                          "capabilities": caps})()


def test_a_padding_mask_along_the_query_axis_is_named_beside_not_applied_where_real_rows_cannot_tell_them_apart():
    """Real query rows only: padding along the query axis leaves every real row seeing every key, as no padding
    does; both are named (it was "the mask is not applied" alone: an unpadded batch item, the same call either
    way, could not 'explain better' than the correct output)."""
    report = mha_harness.check(_backend(PaddingOnQueryAxis), cases=["check_padding_mask_output_matches_reference"],
                               isolate=False)
    (failure,) = report.failures()
    assert "cannot tell 2 mistakes apart" in failure.message
    assert "key_padding_mask applied along the query axis" in failure.message
    assert "without key_padding_mask: the mask is not applied" in failure.message


def test_scores_scaled_by_one_over_d_head_are_also_named_as_the_standard_scale_applied_twice():
    report = mha_harness.check(_backend(ScaleByDHead), cases=["check_scores_scaled_by_sqrt_d_head"], isolate=False)
    (failure,) = report.failures()
    assert "scaled by 1/d_head instead of 1/sqrt(d_head) (= 1/sqrt(d_head) applied twice" in failure.message


def test_weights_loaded_untransposed_are_named_in_the_head_separation_case_too():
    report = mha_harness.check(_backend(WeightsUntransposed, grouped_query=False),
                               cases=["check_output_matches_reference", "check_heads_are_separated"], isolate=False)
    assert report.failures()
    assert all("loaded untransposed: W where W.T belongs" in f.message for f in report.failures()), \
        [f.message[-200:] for f in report.failures() if "untransposed" not in f.message]


def test_a_comparison_with_the_backends_own_output_guesses_no_precision():
    """The leak and invariance cases compare a backend with itself in one dtype: an error of half precision's size
    there is a leak, never a precision (a stranger's off-by-one causal mask was told to declare one)."""
    tol = Tolerance(bound=1e-6, naive_error=3e-7, dtype="float32")
    got, expected = np.full((1, 1, 1), 1e-3), np.zeros((1, 1, 1))
    for own, guessed in ((False, True), (True, False)):
        try:
            assert_close(got, expected, tol, "output", own_output=own)
            raise AssertionError("not failed")
        except CaseFailure as failure:
            assert ("half precision's size" in str(failure)) is guessed, str(failure)


def test_a_fitted_scale_that_is_a_common_one_is_named_by_it_where_padded_rows_leave_only_the_fit():
    """The padding case compares real rows only, where the common-scale diagnosis does not run: the fitted 0.125 is
    named as 1/d_head (it was "0.3536/sqrt(d_head)", an outside user's third name for one bug), in the very sentence
    the common-scale diagnosis says elsewhere (another outside user's summary listed one bug twice, worded two ways)."""
    report = mha_harness.check(_backend(ScaleByDHead), cases=["check_padding_mask_output_matches_reference",
                                                              "check_output_matches_reference"], isolate=False)
    padded = [f for f in report.failures() if f.case == "check_padding_mask_output_matches_reference"
              and f.params.get("variant") is None]  # Tq = Tk: the padded queries are not compared
    assert len(padded) == 1
    cross = [f for f in report.failures() if f.params.get("variant") == "cross_attention"]  # no query padded
    assert [f.extra["diagnosis"] for f in cross] == [padded[0].extra["diagnosis"]]
    assert ("scaled by 1/d_head instead of 1/sqrt(d_head) (= 1/sqrt(d_head) applied twice" in padded[0].message
            and "not a rounding error" not in padded[0].message), padded[0].message
    grid = {f.extra.get("diagnosis") for f in report.failures() if f.case == "check_output_matches_reference"}
    assert padded[0].extra["diagnosis"] in grid  # (where 1/d_head = 1/sqrt(d_model) the grid names both)


def test_a_fused_qkv_weight_in_the_other_layout_is_neox_per_head_packing_read_as_blocks_or_the_other_way():
    """An outside user's GPT-NeoX copy loaded [W_q | W_k | W_v] in blocks into query_key_value, which GPT-NeoX reads
    per head (qkv.view(B, T, heads, 3 * d_head).chunk(3)): numbers only before. Both directions, against that split
    written out here, and the correct packing reads back as the layer itself."""
    from mha_harness.contract.mistakes import with_fused_qkv_misread
    config = mha_harness.AttentionConfig(12, 3, bias=True)
    params = mha_harness.make_params(config, seed=1)
    d, h, dh = 12, 3, 4
    blocks_w = np.concatenate([params.W_q, params.W_k, params.W_v], axis=1)
    blocks_b = np.concatenate([params.b_q, params.b_k, params.b_v])

    def neox_split(w):  # (…, 3d) -> q, k, v as GPT-NeoX reads them: heads of [q | k | v]
        per_head = w.reshape(*w.shape[:-1], h, 3, dh)
        return [per_head[..., j, :].reshape(*w.shape[:-1], d) for j in range(3)]

    misread = with_fused_qkv_misread(params, "per_head")
    for got, want in zip((misread.W_q, misread.W_k, misread.W_v, misread.b_q, misread.b_k, misread.b_v),
                         neox_split(blocks_w) + neox_split(blocks_b)):
        np.testing.assert_array_equal(got, want)
    packed = np.stack([w.reshape(d, h, dh) for w in (params.W_q, params.W_k, params.W_v)], 2).reshape(d, 3 * d)
    for got, want in zip(neox_split(packed), (params.W_q, params.W_k, params.W_v)):  # the documented packing
        np.testing.assert_array_equal(got, want)
    back = with_fused_qkv_misread(params, "blocks")  # per-head packing read as blocks
    np.testing.assert_array_equal(np.concatenate([back.W_q, back.W_k, back.W_v], axis=1), packed)
    assert with_fused_qkv_misread(mha_harness.make_params(mha_harness.AttentionConfig(12, 3, 1)), "blocks") is None
