"""Rows that see no key. The gradient case has one (its ``empty_row`` variant: a query row whose attn_mask masks
every key), so a backward that is NaN there while the forward gives zeros (the double-where trap) fails for every
layer with an attn_mask, not only for those with bottom-right causal rows; a uniform-average declaration covers the
variant, whether the layer replaces the row's scores (nothing flows back to them) or adds a finite minimum to them
(its backward still differentiates them), and a NaN backward is never named after a finite known mistake. The
fully-masked case reads the uniform average as the reference defines it (every key, also for an always-causal
layer), and the attn_mask cases leave an always-causal layer a visible key in every row."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.cases._fixtures import form_inputs
from mha_harness.cases.gradients import EMPTY_ROW, _mask
from mha_harness.conformance.casekit import all_cases
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_params
from mha_harness.contract.reference import empty_rows_as, reference_vjp, uniform_row_scores_as
from mha_harness.implementations.mutants import MUTANTS
from mha_harness.implementations.mutants.zoo import MutantBackend
from tests.empty_row_layers import DoubleWhere, Held, HeldAlwaysCausal, HeldUndeclared, HeldUnscaled, NaNRows, Shifted

CASE = "check_gradients_match_reference"


def _empty_row_result(backend):
    report = mha_harness.check(backend, cases=[CASE])
    rows = [r for r in report.results if r.params.get("empty_row")]
    assert len(rows) == 1, [r.variant for r in report.results]
    others = [r for r in report.results if not r.params.get("empty_row") and r.status not in ("passed", "skipped")]
    return rows[0], others


def test_the_empty_row_variant_has_the_masked_variants_shapes_and_masks():
    """It adds no compiled program to a backend that compiles per shape and mask kind: only the mask's values
    differ from the masked variant's."""
    backend = MutantBackend(MUTANTS[0], weights=False)
    variants = [v for v in all_cases()[CASE].variants_for(backend) if v.get("mask")]
    plain, empty = [v for v in variants if not v.get("empty_row")], [v for v in variants if v.get("empty_row")]
    assert len(plain) == 1 and len(empty) == 1
    assert {k: v for k, v in empty[0].items() if k != "empty_row"} == plain[0]
    fields = _mask(plain[0]["mask"], 2, 65, 65, empty_row=True)
    masked = fields["attn_mask"][EMPTY_ROW]
    assert np.all(~masked if masked.dtype == bool else masked == -np.inf)


def test_a_backward_nan_in_a_row_without_keys_fails_and_is_named_the_double_where_trap():
    result, others = _empty_row_result(DoubleWhere())
    assert result.status == "failed"
    assert "the NaN is the backward's own" in result.message and "double-where trap" in result.message
    assert "no row term" not in result.message  # a NaN backward is not named after a finite mistake
    assert not others, [(r.variant, r.message[:100]) for r in others]  # the rest of its backward is right


def test_the_zoo_mutant_with_nan_in_rows_without_keys_fails_the_empty_row_variant():
    mutant = next(m for m in MUTANTS if m.name == "mutant-gradient-nan-in-rows-without-keys")
    result, _ = _empty_row_result(MutantBackend(mutant, weights=False))
    assert result.status == "failed" and "the NaN is the backward's own" in result.message


@pytest.mark.parametrize("layer", [Held, Shifted], ids=["scores-replaced", "finite-minimum-added"])
def test_a_declared_uniform_average_covers_the_empty_row_whether_the_scores_are_replaced_or_shifted(layer):
    result, others = _empty_row_result(layer())
    assert result.status == "expected-divergence", result.message
    assert not others, [(r.variant, r.message[:100]) for r in others]


def test_a_declared_nan_convention_covers_the_empty_row_whose_nan_reaches_every_gradient():
    result, others = _empty_row_result(NaNRows())
    assert result.status == "expected-divergence", result.message
    assert not others, [(r.variant, r.message[:100]) for r in others]


def test_a_uniform_average_without_its_declaration_fails_naming_the_declaration():
    result, _ = _empty_row_result(HeldUndeclared())
    assert result.status == "failed"
    assert f"query row {EMPTY_ROW} sees no key" in result.message
    assert "uniform_fully_masked_divergences" in result.message


def test_the_uniform_reference_holds_or_differentiates_the_empty_rows_scores():
    """Under the uniform-average convention the empty row's query gets no gradient when its scores are held
    (replaced) and the softmax's backward at uniform weights when they are shifted; the values' gradients agree."""
    config = AttentionConfig(16, 2, bias=False)
    params = make_params(config, seed=3)
    inputs = form_inputs("separate", config, 1, 6, 6, seed=3, **_mask("bool_attn_mask", 1, 6, 6, empty_row=True))
    cotangent = np.random.default_rng(4).standard_normal((1, 6, 16))
    with empty_rows_as("uniform_average"):
        held = reference_vjp(params, inputs, cotangent)
        with uniform_row_scores_as("shifted"):
            shifted = reference_vjp(params, inputs, cotangent)
    zeros = reference_vjp(params, inputs, cotangent)
    query_part = held["query"][0, EMPTY_ROW]
    assert np.allclose(query_part, 0.0) and np.allclose(zeros["query"][0, EMPTY_ROW], 0.0)
    assert np.abs(shifted["query"][0, EMPTY_ROW]).max() > 1e-3
    assert np.allclose(held["value"], shifted["value"]) and not np.allclose(held["value"], zeros["value"])
    with pytest.raises(ValueError, match="mode: got 'kept'; accepted: held, shifted"):
        with uniform_row_scores_as("kept"):
            pass


def test_a_layer_wrong_on_every_row_gets_no_word_about_the_empty_row():
    """The row without a key is not the point when the forward is wrong elsewhere too (an outside user's rotary
    bug got the empty row's sentence as its summary's diagnosis)."""
    result, _ = _empty_row_result(HeldUnscaled())
    assert result.status == "failed"
    assert "sees no key" not in result.message and "sees no key" not in (result.extra.get("diagnosis") or "")


def test_an_always_causal_layer_averaging_every_key_of_a_fully_masked_row_is_the_uniform_convention():
    """The fully-masked case classifies rows by the reference's convention, the average of every key: an
    always-causal layer whose finite minimum masks future and padded keys alike is verified under its declaration
    (an outside user's Hugging Face eager Llama read "observed other" when the case averaged the causal keys only)."""
    report = mha_harness.check(HeldAlwaysCausal(), cases=["check_fully_masked_rows_output_zeros"])
    assert report.results and all(r.status == "expected-divergence" for r in report.results), \
        [(r.variant, r.status, r.message[:200]) for r in report.results]


def test_the_attn_mask_cases_leave_an_always_causal_layer_a_visible_key_in_every_row():
    """A random attn_mask keeps one key per row, which the causal mask may hide: the cases keep key 0 too for an
    always-causal layer, so rows without a key (the fully-masked case's subject) do not fail them."""
    report = mha_harness.check(HeldAlwaysCausal(), cases=["check_bool_attn_mask_matches_reference",
                                                          "check_additive_attn_mask_matches_reference"])
    assert report.results and all(r.status == "passed" for r in report.results), \
        [(r.variant, r.status, r.message[:200]) for r in report.results]


def test_a_uniform_row_held_by_shifted_scores_says_so_in_the_result():
    """Which of the two uniform-average backwards held is recorded as the variant's observed behaviour."""
    from mha_harness.cases.gradients import SHIFTED_SCORES
    assert _empty_row_result(Shifted())[0].observed == SHIFTED_SCORES
    assert _empty_row_result(Held())[0].observed != SHIFTED_SCORES


def test_a_variant_two_declarations_match_is_verified_under_both_at_once():
    """A layer computing float32 calls in bfloat16 that also masks with a finite minimum declares both; its float32
    rows without a key match both declarations. Verified under the first alone (the empty-row output at the
    float32 bound) they failed "even under the declared divergence"; under both at once they hold, and the report
    names both."""
    from tests.empty_row_layers import HeldInBfloat16

    report = mha_harness.check(HeldInBfloat16(), cases=[CASE, "check_fully_masked_rows_output_zeros"])
    both = [r for r in report.results if r.params["dtype"] == "float32"
            and (r.case == "check_fully_masked_rows_output_zeros" or r.params.get("empty_row"))]
    assert len(both) == 4 and not report.failures(), [(r.variant, r.message[:200]) for r in report.failures()]
    assert all(r.status == "expected-divergence" and "uniform average of V; compared against the bound of dtype "
               "bfloat16" in r.message for r in both), [(r.variant, r.message[:200]) for r in both]


def test_the_fully_masked_case_runs_in_every_dtype_and_catches_rows_nan_in_one_of_them():
    """Hugging Face's eager layers add their dtype's most negative value and take the softmax in float32: a float64
    call's minimum is -inf there, so its rows without a key are NaN while its float32 rows average. The case ran in
    the primary dtype alone and passed such a layer (an outside user's Gemma layer); it runs in every declared dtype."""
    from tests.empty_row_layers import ShiftedFloat32Softmax

    report = mha_harness.check(ShiftedFloat32Softmax(), cases=["check_fully_masked_rows_output_zeros"])
    by_dtype = {}
    for r in report.results:
        by_dtype.setdefault(r.params["dtype"], set()).add(r.status)
    assert set(by_dtype) == set(ShiftedFloat32Softmax.capabilities.dtypes)
    assert by_dtype["float32"] == {"expected-divergence"} and by_dtype["float64"] == {"failed"}, by_dtype
    assert all("observed NaN" in r.message for r in report.failures())
    # declared per dtype (the helpers' dtypes=), it holds in each
    from tests.empty_row_layers import ShiftedFloat32SoftmaxDeclared
    report = mha_harness.check(ShiftedFloat32SoftmaxDeclared(), cases=["check_fully_masked_rows_output_zeros"])
    assert not report.failures() and {r.status for r in report.results} == {"expected-divergence"}, \
        [(r.variant, r.message[:150]) for r in report.failures()]


@pytest.mark.parametrize("mask", [{"padding": {"valid": [0], "side": "end"}},
                                  {"batch": 2, "padding": {"valid": [1, 0], "side": "end"}},
                                  {"attn_mask": {"kind": "bool", "per": "shared", "density": 1.0, "empty_rows": [0],
                                                 "seed": 0}}])
def test_search_leaves_a_declared_nan_row_out_of_its_comparison(mask):
    """An outside user's Meta-style layer declared NaN rows and failed search's one-key example with every key
    masked: "expected finite values, got nan (in the output compared against)", named a soft cap. The reference's
    row is NaN under that convention too: neither side is compared, nor in the leak check of another item's rows."""
    from mha_harness.conformance.search_examples import check_example
    example = {"dtype": "float32", "form": "separate", "batch": 1, "tq": 2, "tk": 1, "heads": 1, "kv_heads": 1,
               "d_head": 2, "bias": False, "causal": None, "padding": None, "attn_mask": None, "logit_scale": 1,
               "cut": 0, "poison": "random", "gradients": False, "malformed": None, "seed": 0, **mask}
    check_example(NaNRows(), example)


@pytest.mark.parametrize("row_from", ["weights", "output"])
@pytest.mark.parametrize("recompute", ["softmax", "lse"])
def test_a_diagnosis_backward_over_rows_without_keys_prints_no_numpy_warnings(recompute, row_from):
    """A known mistake's backward (the causal mask dropped when recomputing, exp(s - lse) with lse = -inf in the
    rows that padding and the causal mask leave without a key) gives inf and NaN by design; numpy's warnings about
    it, printed from the harness's reference, read as a harness fault (an outside user's search printed six)."""
    import warnings

    from mha_harness.contract.reference import mistaken_vjp
    config = AttentionConfig(10, 2, bias=False)
    params = make_params(config, seed=5)
    # large logits (the search's draw: W_q and W_k entries of 30) overflow exp(s - lse) into inf, and inf * 0 is NaN
    params = params.replace(W_q=params.W_q * 300, W_k=params.W_k * 300)
    padded = np.arange(9)[None, :] < 2  # the first two keys padded: causal rows 0 and 1 see no key
    inputs = form_inputs("self", config, 1, 9, 9, seed=5, causal="top-left", key_padding_mask=padded)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        grads = mistaken_vjp(params, inputs, np.random.default_rng(6).standard_normal((1, 9, 10)),
                             recomputed_without=("causal",), recompute=recompute, row_from=row_from)
    assert grads
