"""A score scale of the layer's own design (``Capabilities(score_scale=...)``: T5's unscaled scores, muP's 1/d_head,
Gemma's ``query_pre_attn_scalar ** -0.5``). A layer that declares the scale it applies is compared with the reference
scaled so, forward, backward, decode step, search and bench, and the report shows the declaration; one that declares
a scale it does not apply fails naming the scale its output matches; one that applies 1/d_head or no scale without
declaring it is told how to declare a layer built so. Before, the only way was to fold the scale into W_q in the
wrapper, which hid a wrong scale in the layer from the scale case."""
from __future__ import annotations

import re

import numpy as np
import pytest

import mha_harness
from mha_harness.bench.calls import prepared_call
from mha_harness.bench.metrics import Shape
from mha_harness.bench.verify import WrongOutput
from mha_harness.contract.api import AttentionConfig, Capabilities
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention, reference_vjp, score_scale_as
from tests.score_scale_layers import (
    DeclaredNotApplied,
    FixedScale,
    FixedScaleOtherThanDeclared,
    ScaledByDHead,
    ScaledByDHeadUndeclared,
    ScaledByDHeadWithoutMaxSubtraction,
    Unscaled,
    UnscaledUndeclared,
)

SCALE_CASE = "check_scores_scaled_by_sqrt_d_head"


def test_the_reference_scales_scores_as_declared_forward_and_backward():
    """A declared scale s is the standard layer with W_q and b_q times s * sqrt(d_head): the output, and the
    gradients of every input and of W_k, W_v, W_o (W_q's and b_q's carry the chain rule's factor)."""
    config = AttentionConfig(16, 2, bias=True)  # d_head 8
    params = make_params(config, seed=1, scale=0.8)
    inputs = make_inputs(config, 2, 5, 7, seed=3, causal="top-left")
    cotangent = np.random.default_rng(0).standard_normal((2, 5, 16))
    for declared, scale in (("1/d_head", 1 / 8), (1.0, 1.0), (0.1, 0.1)):
        factor = scale * np.sqrt(8)
        folded = params.replace(W_q=params.W_q * factor, b_q=params.b_q * factor)
        with score_scale_as(declared):
            got = reference_attention(params, inputs).output
            grads = reference_vjp(params, inputs, cotangent)
            flash = reference_vjp(params, inputs, cotangent, flash=True)
        np.testing.assert_allclose(got, reference_attention(folded, inputs).output, rtol=1e-12, atol=1e-12)
        want = reference_vjp(folded, inputs, cotangent)
        for name in ("query", "key", "value", "W_k", "W_v", "W_o"):
            np.testing.assert_allclose(grads[name], want[name], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(flash[name], want[name], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(grads["W_q"], want["W_q"] * factor, rtol=1e-10, atol=1e-12)
        assert np.abs(got - reference_attention(params, inputs).output).max() > 1e-2  # not vacuous
    with score_scale_as("1/sqrt(d_head)"):  # the standard rule by name: the default reference
        np.testing.assert_array_equal(reference_attention(params, inputs).output,
                                      reference_attention(params, inputs).output)
    assert mha_harness.score_scale_as is score_scale_as  # public, for a plugin's own tests


@pytest.mark.parametrize(("layer", "words"), [(ScaledByDHead, "scaled by 1/d_head"),
                                              (Unscaled, "scaled by 1 (no scaling)"), (FixedScale, "scaled by 0.1")])
def test_a_declared_score_scale_passes_every_quick_case_and_the_report_shows_it(layer, words):
    backend = layer()
    report = mha_harness.check(backend, include_slow=False)
    assert not report.failures(), [(f.case, f.variant, f.message[-200:]) for f in report.failures()]
    ran = {r.case for r in report.results if r.status == "passed"}
    assert {SCALE_CASE, "check_output_matches_reference", "check_gradients_match_reference",
            "check_decode_step_over_filled_cache_matches_reference", "check_large_logits_stay_finite_and_correct",
            "check_lesson_worked_example_head_weights"} <= ran
    assert report.policies()[backend.name]["scores"].startswith(f"{words} (declared")
    assert f"{words} (declared" in report.to_markdown()


def test_the_large_logits_case_reaches_its_logits_at_a_declared_scale():
    """The case sizes its logits with the layer's scale: at 1/d_head (d_head 8), sizing them for 1/sqrt(d_head)
    gave long rows of logits ~35 instead of ~100, whose exp a softmax without the row maximum survives."""
    _, failures = _failures(ScaledByDHeadWithoutMaxSubtraction(), ["check_large_logits_stay_finite_and_correct"])
    assert {f.params["variant"] for f in failures} >= {"long_rows", "negative_rows"}, [f.variant for f in failures]
    assert all("numerical stability" in f.message for f in failures)


def test_a_declared_scale_the_layer_does_not_apply_is_named_with_the_scale_it_applies():
    _, failures = _failures(DeclaredNotApplied(), [SCALE_CASE, "check_output_matches_reference",
                                                   "check_large_logits_stay_finite_and_correct"])
    named = re.compile(r"the output matches scores scaled by 1/sqrt\(d_head\) \(= [0-9.]+ at d_head \d+\), not by the "
                       r"declared score_scale 1/d_head")
    assert {f.case for f in failures} == {SCALE_CASE, "check_output_matches_reference",
                                          "check_large_logits_stay_finite_and_correct"}
    assert all(named.search(f.message) for f in failures if f.params.get("dtype") in ("float32", "float64")), \
        [f.message[-300:] for f in failures if not named.search(f.message)]


def test_an_undeclared_1_over_d_head_scale_is_told_how_to_declare_it_also_through_the_gradient_case():
    _, failures = _failures(ScaledByDHeadUndeclared(), [SCALE_CASE, "check_gradients_match_reference"])
    advice = ("scores scaled by 1/d_head instead of 1/sqrt(d_head) (= 1/sqrt(d_head) applied twice: a wrapper that "
              "scales q, or folds the scale into W_q, around a layer that scales its scores again) (a layer built "
              "with this scale by design")
    assert {f.case for f in failures} == {SCALE_CASE, "check_gradients_match_reference"}
    assert all(advice in f.message and "Capabilities(score_scale='1/d_head')" in f.message for f in failures), \
        [f.message[-300:] for f in failures if advice not in f.message]
    assert not any("soft-capped" in f.message for f in failures)  # a cap fitted the bfloat16 forward before


def test_a_backward_that_leaves_out_a_declared_scale_is_named_with_that_scale():
    from mha_harness.conformance.gradient_diagnoses import _multiple_named
    params = make_params(AttentionConfig(16, 2), seed=0)  # d_head 8
    with score_scale_as("1/d_head"):
        assert _multiple_named(8.0, params).startswith("d_head = 8 x the reference's: the backward leaves out the "
                                                       "1/d_head score scale")
        assert _multiple_named(1 / 8, params).startswith("1/d_head = 0.125 x the reference's: the backward applies")
        # a muP backward copied from a standard layer (an outside user's: "2.828 x ... a constant multiple")
        assert _multiple_named(np.sqrt(8), params).startswith(
            "2.828 x the reference's: the backward applies 1/sqrt(d_head) where the declared score_scale 1/d_head "
            "belongs")
    with score_scale_as(0.1):
        assert _multiple_named(10.0, params).startswith("1/0.1 = 10 x the reference's: the backward leaves out the "
                                                        "0.1 score scale")
    assert _multiple_named(np.sqrt(8), params).startswith("sqrt(d_head) = 2.828 x")  # the standard rule


def test_search_and_bench_hold_a_declared_scale_and_bench_names_an_undeclared_one():
    from mha_harness.conformance.search_examples import check_example
    example = {"batch": 2, "tq": 5, "tk": 7, "heads": 2, "kv_heads": 2, "d_head": 8, "bias": True, "seed": 4,
               "causal": "top-left", "dtype": "float32"}
    check_example(ScaledByDHead(), example)
    with pytest.raises(AssertionError):
        check_example(ScaledByDHeadUndeclared(), example)
    for backward in (False, True):
        assert prepared_call(Unscaled(), Shape(1, 48, 48, 64, 4, "float32", True, backward))() is not None
    with pytest.raises(WrongOutput, match=r"scores scaled by 1/d_head instead of 1/sqrt\(d_head\)"):
        prepared_call(ScaledByDHeadUndeclared(), Shape(1, 48, 48, 64, 4, "float32", True, False))
    with pytest.raises(WrongOutput, match=r"scaled by 1/sqrt\(d_head\), not by the declared score_scale 1/d_head"):
        prepared_call(DeclaredNotApplied(), Shape(1, 48, 48, 64, 4, "float32", True, False))


@pytest.mark.parametrize("scale", [0, -1.0, float("inf"), float("nan"), True, "1/d_model", "sqrt"])
def test_capabilities_refuse_a_malformed_score_scale_naming_the_accepted_values(scale):
    with pytest.raises(ValueError, match=r"Capabilities.score_scale: got .*; accepted: None \(the standard "
                                         r"1/sqrt\(d_head\)\), '1/sqrt\(d_head\)' or '1/d_head'"):
        Capabilities(score_scale=scale)
    assert Capabilities(score_scale=1).score_scale == 1.0
    assert Capabilities(score_scale="1/sqrt(d_head)").score_scale is None  # the standard rule by name


def test_list_shows_the_declared_scale(capsys):
    from mha_harness.cli import main
    assert main(["list", "--backend-spec", "tests.score_scale_layers:ScaledByDHead"]) == 0
    assert "scores scaled by 1/d_head" in capsys.readouterr().out


def _failures(backend, cases):
    report = mha_harness.check(backend, cases=list(cases))
    return report, report.failures()


def test_the_attention_weights_case_names_the_scale_or_cap_its_call_s_output_matches():
    """The weights case compares weights, which no scale or cap fit reads: the same call's output names it."""
    from tests.softcap_layers import CapOtherThanDeclared
    weights = ["check_attention_weights_match_reference"]
    _, failures = _failures(DeclaredNotApplied(), weights)
    assert failures and all("the output matches scores scaled by 1/sqrt(d_head) (= 0.3536 at d_head 8), not by the "
                            "declared score_scale 1/d_head" in f.message for f in failures), \
        [f.message[-200:] for f in failures]
    _, failures = _failures(CapOtherThanDeclared(), weights)
    assert failures and all("soft-capped at 20, not at the declared logit_softcap 50" in f.message
                            for f in failures), [f.message[-200:] for f in failures]


def test_the_lesson_example_s_printed_weights_name_an_undeclared_scale():
    """An undeclared unscaled layer's lesson weights ("printed 0.68, got 0.9305", an outside user's T5) say which
    scale the call's output has, and how to declare it."""
    _, failures = _failures(UnscaledUndeclared(), ["check_lesson_worked_example_head_weights"])
    assert failures and all("scaled by 1 (no scaling) instead of 1/sqrt(d_head)" in f.message
                            and "Capabilities(score_scale=1.0)" in f.message for f in failures), \
        [f.message[-300:] for f in failures]


def test_a_scale_none_of_the_common_ones_is_fitted_and_named():
    """A layer declaring 0.1 that applies 0.125 (a Gemma query_pre_attn_scalar set to another value) matches no
    common scale at d_head 80 (nor at the bench's d_head 80): the fitted scale names it, in check and in bench."""
    _, failures = _failures(FixedScaleOtherThanDeclared(), ["check_output_matches_reference"])
    exact = [f for f in failures if f.params["dtype"] in ("float32", "float64")]
    assert exact and all("not by the declared score_scale 0.1" in f.message for f in exact), \
        [f.message[-200:] for f in exact if "not by the declared" not in f.message]
    # at every head width the value 0.125 is named (a common rule equal to it there, or the fit): one fixed scale,
    # not a rule per width (an outside user read "1/d_head", "1/sqrt(d_head)" and "1/sqrt(d_model)" at three widths)
    assert all("= 0.125 at d_head" in f.message or "scaled by 0.125," in f.message for f in exact), \
        [f.message[-200:] for f in exact]
    fitted = [f for f in exact if f.params["d_head"] == 80]  # at d_head 16 the q/k norm rows' d_model is 64
    assert fitted and all("the output matches scores scaled by 0.125, not by the declared score_scale 0.1" in f.message
                          for f in fitted), [f.message[-200:] for f in fitted]
    with pytest.raises(WrongOutput, match="scaled by 0.125, not by the declared score_scale 0.1"):
        prepared_call(FixedScaleOtherThanDeclared(), Shape(1, 48, 48, 80, 4, "float32", True, False))

