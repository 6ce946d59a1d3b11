"""Soft-capped scores (``c * tanh(s / c)`` before the mask: Gemma 2's ``attn_logit_softcapping``). A layer that caps
and declares ``Capabilities(logit_softcap=c)`` is compared with the reference capped the same way, forward, backward,
decode step and in bench; one that caps without declaring it, caps at another value, declares a cap it does not
apply or caps after the mask fails, and the failure names the cap it found rather than guessing half precision from
the error's size (an outside user's Gemma 2 layer was told to declare bfloat16)."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.bench.calls import prepared_call
from mha_harness.bench.metrics import Shape
from mha_harness.bench.verify import WrongOutput
from mha_harness.contract.api import AttentionConfig, Capabilities
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import logit_softcap_as, reference_attention, reference_vjp
from tests.softcap_layers import (
    CAP,
    CapAfterMask,
    CapDeclaredNotApplied,
    CapOtherThanDeclared,
    SoftCapped,
    SoftCappedUndeclared,
)

OUTPUT = "check_output_matches_reference"
GUESS = "half precision's size"


def _failures(backend, cases=(OUTPUT,)):
    report = mha_harness.check(backend, cases=list(cases))
    return report, report.failures()


def test_the_reference_soft_cap_bends_large_scores_and_its_backward_matches_finite_differences():
    config = AttentionConfig(16, 2, bias=True)
    params = make_params(config, seed=1, scale=2.0)
    inputs = make_inputs(config, 2, 5, 7, seed=3, causal="top-left")
    cotangent = np.random.default_rng(0).standard_normal((2, 5, 16))
    plain = reference_attention(params, inputs).output
    with logit_softcap_as(3.0):
        capped = reference_attention(params, inputs).output
        textbook, flash = reference_vjp(params, inputs, cotangent), reference_vjp(params, inputs, cotangent, flash=True)
        step = 1e-6
        for name, index in (("query", (1, 2, 3)), ("W_k", (3, 5)), ("b_q", (4,))):
            moved = (inputs.replace(query=inputs.query.copy()) if name == "query"
                     else params.replace(**{name: getattr(params, name).copy()}))
            array = moved.query if name == "query" else getattr(moved, name)
            array[index] += step
            after = reference_attention(params if name == "query" else moved,
                                        moved if name == "query" else inputs).output
            numeric = float(((after - capped) * cotangent).sum() / step)
            assert abs(numeric - textbook[name][index]) < 1e-4 * max(1.0, abs(numeric))
            assert abs(flash[name][index] - textbook[name][index]) < 1e-9 * max(1.0, abs(numeric))
    assert np.abs(plain - capped).max() > 1.0  # the cap changed the output: the checks above are not vacuous
    assert mha_harness.logit_softcap_as is logit_softcap_as  # public, for a plugin's own tests (docs/plugins.md)


def test_a_declared_soft_cap_passes_every_quick_case_and_the_report_shows_it():
    backend = SoftCapped()
    report = mha_harness.check(backend, include_slow=False)
    assert not report.failures(), [(f.variant, f.message[:200]) for f in report.failures()]
    ran = {r.case for r in report.results if r.status == "passed"}
    assert {OUTPUT, "check_gradients_match_reference", "check_decode_step_over_filled_cache_matches_reference",
            "check_lesson_worked_example_head_weights", "check_causal_mask_blocks_future_keys"} <= ran
    assert report.policies()[backend.name]["scores"].startswith(f"soft-capped at {CAP:g}")
    assert f"soft-capped at {CAP:g}" in report.to_markdown()


def test_an_undeclared_soft_cap_is_named_with_its_cap_instead_of_a_guess_of_half_precision():
    report, failures = _failures(SoftCappedUndeclared())
    assert failures and all(f"scores soft-capped at {CAP:g} (" in f.message for f in failures), \
        [f.message[-300:] for f in failures]
    assert not any(GUESS in f.message for f in failures)
    assert f"Capabilities(logit_softcap={CAP:g})" in failures[0].message
    assert report.diagnoses_line(failures[0].backend).startswith(f"diagnosed: the output matches scores soft-capped "
                                                                 f"at {CAP:g}")


#: cases that compare outputs in their own way (padded queries left out, a hint chain of their own): an outside
#: user's Gemma 2 copies were named in the output cases only, and told of half precision in these
OWN_COMPARISONS = ("check_padding_mask_output_matches_reference", "check_mask_compositions_match_reference",
                   "check_large_logits_stay_finite_and_correct", "check_scores_scaled_by_sqrt_d_head",
                   "check_output_projection_mixes_heads")


@pytest.mark.parametrize("layer", [SoftCappedUndeclared, CapDeclaredNotApplied])
def test_the_cases_that_compare_outputs_their_own_way_name_the_cap_too(layer):
    _, failures = _failures(layer(), OWN_COMPARISONS)
    assert {f.case for f in failures} == set(OWN_COMPARISONS)
    assert all("soft-capped" in f.message and GUESS not in f.message for f in failures), \
        [(f.variant, f.message[-300:]) for f in failures if "soft-capped" not in f.message or GUESS in f.message]


def test_the_gradient_case_of_an_undeclared_soft_cap_names_the_cap_of_its_forward():
    _, failures = _failures(SoftCappedUndeclared(), ["check_gradients_match_reference"])
    named = [f for f in failures if f.params.get("dtype") in ("float32", "float64")]
    assert named and all(f"soft-capped at {CAP:g}" in f.message and GUESS not in f.message for f in named), \
        [f.message[-300:] for f in named]


def test_a_cap_other_than_the_declared_one_is_named():
    _, failures = _failures(CapOtherThanDeclared())
    assert failures and any(f"soft-capped at {CAP:g}, not at the declared logit_softcap 50" in f.message
                            for f in failures)


def test_a_declared_cap_the_layer_does_not_apply_is_named():
    _, failures = _failures(CapDeclaredNotApplied())
    assert failures and all("not soft-capped: the layer does not apply its declared logit_softcap" in f.message
                            for f in failures if f.params["dtype"] != "float16")


def test_a_cap_taken_after_the_mask_gives_the_masked_keys_a_weight_and_leaks():
    """tanh(-inf) = -1: a masked score becomes -c, not -inf, so the masked keys keep a weight of about exp(-c)."""
    _, failures = _failures(CapAfterMask(), ["check_causal_mask_blocks_future_keys",
                                             "check_padding_mask_blocks_padded_keys"])
    assert {f.case for f in failures} == {"check_causal_mask_blocks_future_keys",
                                          "check_padding_mask_blocks_padded_keys"}
    assert any("causal leak" in f.message for f in failures) and any("padding leak" in f.message for f in failures)


def test_a_cap_taken_after_the_mask_is_named_wherever_an_output_shows_it():
    """The float-mask, mask-composition, leak (random poison), large-logit and fully-masked cases name the cap taken
    after the masks (an outside user's port of Gemma 2's eager attention failed them with numbers only, its size
    read as half precision's): never a precision, never an underflow."""
    cases = ["check_additive_attn_mask_matches_reference", "check_mask_compositions_match_reference",
             "check_causal_mask_blocks_future_keys", "check_padding_mask_blocks_padded_keys",
             "check_large_logits_stay_finite_and_correct", "check_fully_masked_rows_output_zeros"]
    _, failures = _failures(CapAfterMask(), cases)
    named = "scores soft-capped after the masks, 20 * tanh((s + mask) / 20)"
    assert {f.case for f in failures if named in f.message} == set(cases)
    for f in failures:
        if f.case in cases[:2] + cases[4:5]:
            assert named in f.message and GUESS not in f.message and "underflow" not in f.message, f.message
        if f.params.get("poison") == "random":
            assert named in f.message, f.message


def test_bench_checks_a_declared_soft_cap_against_the_capped_reference_and_names_an_undeclared_one():
    for backward in (False, True):
        shape = Shape(1, 48, 48, 64, 4, "float32", True, backward)
        assert prepared_call(SoftCapped(), shape)() is not None
    with pytest.raises(WrongOutput, match=f"soft-capped at {CAP:g}"):
        prepared_call(SoftCappedUndeclared(), Shape(1, 48, 48, 64, 4, "float32", True, False))


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), True, "50"])
def test_capabilities_refuse_a_malformed_logit_softcap_naming_the_accepted_values(cap):
    with pytest.raises(ValueError, match=r"Capabilities.logit_softcap: got .*; accepted: None .* a finite number > 0"):
        Capabilities(logit_softcap=cap)
    assert Capabilities(logit_softcap=50).logit_softcap == 50.0


def test_list_shows_the_declared_cap(capsys):
    from mha_harness.cli import main
    assert main(["list", "--backend-spec", "tests.softcap_layers:SoftCapped"]) == 0
    assert f"scores soft-capped at {CAP:g}" in capsys.readouterr().out
