"""A failed gradient comparison names what the backward got wrong: the wrong and right gradients, where the wrong
parameter gradients place the error, and the known mistake (a backward without the softmax's row term, one that
ignores a mask, a gradient zeroed, transposed or times a constant) only when it explains the gradients; an error no
known mistake explains is not given a name."""
from __future__ import annotations

import numpy as np
import pytest

from mha_harness.cases._fixtures import form_inputs
from mha_harness.conformance.gradient_diagnoses import gradient_mistake
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.expected import gradient_tolerances, input_gradients
from mha_harness.contract.params import make_params
from mha_harness.contract.reference import mistaken_vjp, reference_vjp

CONFIG = AttentionConfig(16, 2, bias=True)  # d_head 8: sqrt(d_head) = 2.83
PARAMS = make_params(CONFIG, seed=3)


def _call(form="separate", tq=6, tk=9, **masks):
    inputs = form_inputs(form, CONFIG, 2, tq, tk, seed=4, **masks)
    cotangent = np.random.default_rng(5).standard_normal((2, tq, CONFIG.d_model))
    return inputs, cotangent


def _diagnose(got, inputs, cotangent, form="separate"):
    bounds = gradient_tolerances(PARAMS, inputs, cotangent, "float32", form)
    return gradient_mistake(got, PARAMS, inputs, cotangent, form, bounds)


def _true(inputs, cotangent, form="separate"):
    return input_gradients(reference_vjp(PARAMS, inputs, cotangent), form)


def test_right_gradients_get_no_diagnosis():
    inputs, cotangent = _call()
    assert _diagnose(_true(inputs, cotangent), inputs, cotangent) == ""


@pytest.mark.parametrize("form", ["separate", "self"])
def test_a_backward_without_the_softmax_row_term_is_named_and_placed_in_the_softmax_backward(form):
    inputs, cotangent = _call(form, tq=7, tk=7)
    got = input_gradients(mistaken_vjp(PARAMS, inputs, cotangent, row_term=False), form)
    text = _diagnose(got, inputs, cotangent, form)
    assert "the softmax's backward has no row term: dS = P * dP" in text
    assert "place the error in the softmax's backward" in text
    assert "right in the value path (dV = P^T dO) and the output projection" in text


@pytest.mark.parametrize(("field", "masks", "words"), [
    ("causal", {"causal": "bottom-right"}, "ignores the causal mask the forward applies"),
    ("key_padding_mask", {"key_padding_mask": np.arange(9)[None, :] >= np.array([[9], [4]])},
     "ignores the key padding mask the forward applies: gradient flows to and from padded keys"),
    ("attn_mask", {"attn_mask": np.random.default_rng(6).random((6, 9)) < 0.6},
     "ignores the attn_mask the forward applies"),
])
def test_a_backward_that_ignores_a_mask_the_forward_applies_is_named(field, masks, words):
    if field == "attn_mask":
        masks["attn_mask"][:, 0] = True
    inputs, cotangent = _call(**masks)
    got = reference_vjp(PARAMS, inputs.replace(**{field: None}), cotangent)
    assert words in _diagnose(got, inputs, cotangent)


@pytest.mark.parametrize("row_from", ["weights", "output"])
@pytest.mark.parametrize(("recompute", "words"), [
    ("softmax", "the backward recomputes the weights without {what} (a softmax over every key"),
    ("lse", "the backward recomputes the weights as exp(s - lse) without re-applying {what} (FlashAttention-2"),
])
@pytest.mark.parametrize(("masks", "what"), [
    ({"causal": "bottom-right"}, "the causal mask"),
    ({"causal": "bottom-right", "key_padding_mask": np.arange(9)[None, :] >= np.array([[9], [4]])},
     "the causal mask and the key padding mask"),
])
def test_a_backward_that_recomputes_the_weights_without_the_masks_is_named(recompute, words, masks, what, row_from):
    """A stranger's FlashAttention-2-style backward that recomputed exp(s - lse) without re-applying its masks was
    not named: only a backward ignoring a mask throughout (W_o's gradient wrong too) was a candidate."""
    inputs, cotangent = _call(**masks)
    got = mistaken_vjp(PARAMS, inputs, cotangent, recomputed_without=tuple(masks), recompute=recompute,
                       row_from=row_from)
    text = _diagnose(got, inputs, cotangent)
    assert words.format(what=what) in text, text
    assert "right: W_o" in text or ", W_o," in text.split("; right: ")[1]


def test_a_bug_that_only_resembles_a_known_mistake_is_not_named_after_it():
    """A stranger's backward summed the row term over the wrong axis and was told it had no row term: a known
    mistake is named only where its gradients are at most 1/20 as far from the backend's as the true ones."""
    inputs, cotangent = _call()
    truth, no_row = _true(inputs, cotangent), mistaken_vjp(PARAMS, inputs, cotangent, row_term=False)
    resembling = {n: no_row[n] + 0.2 * (truth[n] - no_row[n]) for n in truth}  # 4x nearer to no_row than to truth
    text = _diagnose(resembling, inputs, cotangent)
    assert "wrong gradients: query, key, W_q, W_k, b_q" in text and "place the error in the softmax's backward" in text
    assert "row term" not in text.split("place the error")[1].split(")", 1)[1], text
    exact = _diagnose(no_row, inputs, cotangent)
    assert "the softmax's backward has no row term" in exact


def test_the_summary_keeps_the_named_mistake_alone():
    """The summary's "diagnosed:" line clipped the lists and formulas mid-way; it now gets the named mistake only."""
    from mha_harness.conformance.gradient_diagnoses import gradient_hint
    inputs, cotangent = _call()
    got = mistaken_vjp(PARAMS, inputs, cotangent, row_term=False)
    bounds = gradient_tolerances(PARAMS, inputs, cotangent, "float32", "separate")
    message, summary = gradient_hint(got, PARAMS, inputs, cotangent, "separate", bounds)
    assert message.startswith("; wrong gradients: ") and "no row term" in message
    assert summary.startswith("the softmax's backward has no row term"), summary


@pytest.mark.parametrize(("factor", "words"), [
    (np.sqrt(8.0), "are sqrt(d_head) = 2.828 x the reference's: the backward leaves out the 1/sqrt(d_head) score"),
    (1 / np.sqrt(8.0), "are 1/sqrt(d_head) = 0.3536 x the reference's: the backward applies the score scale twice"),
    (-1.0, "are -1 x the reference's: the sign flipped"),
    (3.7, "are 3.7 x the reference's: a constant multiple"),
])
def test_query_and_key_gradients_off_by_a_factor_name_it_and_group_the_gradients(factor, words):
    inputs, cotangent = _call()
    got = _true(inputs, cotangent)
    for name in ("query", "key", "W_q", "W_k", "b_q"):
        got[name] = got[name] * factor
    text = _diagnose(got, inputs, cotangent)
    assert "wrong gradients: query, key, W_q, W_k, b_q; right: value, W_v, W_o, b_k, b_v, b_o" in text
    assert f"the gradients of query, key, W_q, W_k, b_q {words}" in text


def test_a_zero_and_a_transposed_gradient_are_named_each():
    inputs, cotangent = _call()
    got = _true(inputs, cotangent)
    got["W_v"] = np.zeros_like(got["W_v"])
    got["W_o"] = got["W_o"].T.copy()
    text = _diagnose(got, inputs, cotangent)
    assert "the gradient of W_v is zero everywhere (to float noise): nothing flows there" in text
    assert "the gradient of W_o is the reference's transposed" in text
    assert "place the error in the value path (dV = P^T dO) and the output projection (dW_o); right in the " \
           "softmax's backward" in text


def test_an_error_no_known_mistake_explains_is_listed_but_not_named():
    inputs, cotangent = _call()
    got = _true(inputs, cotangent)
    got["W_v"] = got["W_v"] + np.random.default_rng(7).standard_normal(got["W_v"].shape)
    text = _diagnose(got, inputs, cotangent)
    assert text == ("; wrong gradients: W_v; right: query, key, value, W_q, W_k, W_o, b_q, b_k, b_v, b_o; the "
                    "parameters' gradients place the error in the value path (dV = P^T dO); right in the softmax's "
                    "backward (dS = P * (dP - rowsum(dP * P)), and dQ, dK from it, back through a rotary or q/k norm "
                    "if any) and the output projection (dW_o)")


def test_the_gradient_case_appends_the_diagnosis_to_its_failure():
    """The case's own failure message carries it (a mutant of the zoo: a hand-written backward without the row
    term)."""
    import mha_harness
    from mha_harness.implementations.mutants import MUTANTS
    from mha_harness.implementations.mutants.zoo import MutantBackend
    mutant = next(m for m in MUTANTS if m.name == "mutant-gradient-no-softmax-row-term")
    report = mha_harness.check(MutantBackend(mutant, weights=False), cases=["check_gradients_match_reference"])
    messages = [f.message for f in report.failures()]
    assert messages and all("the softmax's backward has no row term" in m for m in messages), messages


def test_every_gradient_comparison_carries_the_diagnosis_the_search_replays_too():
    """casekit's assert_gradients_match_reference, which the gradient case and the search's examples both call,
    raises the failure with the diagnosis appended and kept as its diagnosis."""
    from mha_harness.conformance.casekit import CaseFailure, assert_gradients_match_reference
    inputs, cotangent = _call(key_padding_mask=np.arange(9)[None, :] >= np.array([[9], [4]]))
    got = reference_vjp(PARAMS, inputs.replace(key_padding_mask=None), cotangent)
    with pytest.raises(CaseFailure) as caught:
        assert_gradients_match_reference(got, PARAMS, inputs, cotangent, "float32", "separate")
    assert str(caught.value).startswith("gradient of ")
    assert "the backward ignores the key padding mask" in caught.value.diagnosis


def test_a_case_that_found_a_backward_wrong_otherwise_gets_the_diagnosis_only_when_a_gradient_is_wrong():
    """gradient_mistake_hint (for cases that test a backward by another property, as the causal Jacobian case does):
    right gradients, or gradients it cannot compare (one missing), give no hint and never raise; a backward that
    ignores the causal mask is named, with its short diagnosis for the summary."""
    from mha_harness.conformance.casekit import gradient_mistake_hint
    inputs, cotangent = _call(tq=7, tk=7, causal="top-left")
    right = _true(inputs, cotangent)
    assert gradient_mistake_hint(right, PARAMS, inputs, cotangent, "float32", "separate") == ("", "")
    missing = {k: v for k, v in right.items() if k != "value"}
    assert gradient_mistake_hint(missing, PARAMS, inputs, cotangent, "float32", "separate") == ("", "")
    unmasked = _true(inputs.replace(causal=None), cotangent)
    hint, diagnosis = gradient_mistake_hint(unmasked, PARAMS, inputs, cotangent, "float32", "separate")
    assert hint.startswith("; wrong gradients: ") and "ignores the causal mask the forward applies" in diagnosis


def test_a_wrong_forward_is_blamed_before_any_backward_mistake():
    """A forward that reads its causal mask inverted gives gradients that resemble a backward ignoring the mask
    (a stranger's BERT copy was told "the backward ignores the causal mask" of a correct autograd backward): with
    the call's forward output wrong, the hint keeps the lists and says to fix the forward first, and leaves the
    summary to the forward's own cases."""
    from mha_harness.conformance.casekit import gradient_mistake_hint
    inputs, cotangent = _call(tq=7, tk=7, causal="top-left")
    unmasked = _true(inputs.replace(causal=None), cotangent)
    hint, diagnosis = gradient_mistake_hint(unmasked, PARAMS, inputs, cotangent, "float32", "separate",
                                            forward=lambda: _forward(inputs.replace(causal=None)))  # mask ignored
    assert hint.startswith("; wrong gradients: ") and "ignores the causal mask" not in hint, hint
    assert "; the forward's output for this call is wrong too" in hint and "fix the forward first" in hint, hint
    assert diagnosis == ""  # the summary's diagnosed: line keeps the forward cases' own diagnosis
    right_forward = gradient_mistake_hint(unmasked, PARAMS, inputs, cotangent, "float32", "separate",
                                          forward=lambda: _forward(inputs))[1]
    assert "ignores the causal mask the forward applies" in right_forward


def test_a_list_of_wrong_gradients_alone_is_no_summary_diagnosis():
    """The summary's diagnosed: line shows named mistakes; a gradient failure that names none (a random error: only
    the lists) leaves the failure's diagnosis empty, so it does not push a named one off the line."""
    from mha_harness.conformance.casekit import CaseFailure
    from mha_harness.conformance.gradient_diagnoses import gradient_hint
    inputs, cotangent = _call()
    got = _true(inputs, cotangent)
    got["value"] = got["value"] + np.random.default_rng(9).standard_normal(got["value"].shape)
    bounds = gradient_tolerances(PARAMS, inputs, cotangent, "float32", "separate")
    hint, diagnosis = gradient_hint(got, PARAMS, inputs, cotangent, "separate", bounds)
    assert hint.startswith("; wrong gradients: value") and diagnosis == ""
    assert CaseFailure("gradient of value: ...").with_hint(hint, diagnosis).diagnosis in (None, "")


def _forward(inputs):
    from mha_harness.contract.reference import reference_attention
    return reference_attention(PARAMS, inputs).output


def test_a_forward_row_the_cotangent_leaves_out_does_not_count_as_a_wrong_forward():
    """The gradient case leaves padded queries' outputs unspecified (their cotangent is zero): a layer that zeroes
    them has a right forward for the gradients, and a backward mistake is still named."""
    from mha_harness.conformance.casekit import gradient_mistake_hint
    inputs, cotangent = _call(tq=7, tk=7, causal="top-left")
    cotangent[:, 3] = 0.0

    def forward_with_row_3_zeroed():
        out = _forward(inputs).copy()
        out[:, 3] = 0.0
        return out
    hint, diagnosis = gradient_mistake_hint(_true(inputs.replace(causal=None), cotangent), PARAMS, inputs, cotangent,
                                            "float32", "separate", forward=forward_with_row_3_zeroed)
    assert "wrong too" not in hint and "ignores the causal mask the forward applies" in diagnosis, hint


def test_every_gradient_but_w_o_times_one_constant_is_named_as_weights_that_constant_times_the_forward():
    """A flash backward recomputing exp(s - lse) from a log-sum-exp off by log 2 doubles every gradient upstream of
    the weights and leaves W_o's right: named as weights 2 x the forward's, not as a gradient summed twice (which
    would double W_o's too)."""
    inputs, cotangent = _call()
    true = _true(inputs, cotangent)
    got = {name: g if name in ("W_o", "b_o") else 2 * g for name, g in true.items()}
    text = _diagnose(got, inputs, cotangent)
    assert "are all 2 x the reference's while W_o's is right: the backward's weights are 2 x the forward's" in text
    assert "log-sum-exp off by -0.693" in text and "summed twice" not in text, text
    everything = {name: 2 * g for name, g in true.items()}  # W_o doubled too: no weights to blame
    assert "while W_o's is right" not in _diagnose(everything, inputs, cotangent)


def test_a_gradient_of_float_noise_where_the_reference_is_not_zero_is_named_zero_not_a_tiny_multiple():
    """b_v holding an always-zero gradient's float noise (b_k's, returned in its place) read "-7.568e-09 x the
    reference's: a constant multiple" to a stranger; within its tolerance of zero it is named zero."""
    inputs, cotangent = _call()
    got = _true(inputs, cotangent)
    got["b_v"] = 1e-9 * np.abs(got["b_v"]).max() * np.random.default_rng(7).standard_normal(got["b_v"].shape)
    text = _diagnose(got, inputs, cotangent)
    assert "the gradient of b_v is zero everywhere (to float noise)" in text and "x the reference's" not in text, text



def test_a_gradient_the_backward_never_reached_is_named_as_such_not_as_a_dtype():
    """A layer whose backward leaves a parameter's gradient None (autograd's value for a tensor it never reached: an
    outside user's layer with its output projection dropped) fails the gradient case saying so; it said "gradient of
    W_o dtype: got object"."""
    pytest.importorskip("torch")
    import mha_harness
    from mha_harness.implementations.torch_eager import TorchEager, TorchEagerLoaded

    class LeavesWoUnreached(TorchEagerLoaded):
        def compute_vjp(self, inputs, cotangent):
            return {**super().compute_vjp(inputs, cotangent), "W_o": None}

    class Unreached(TorchEager):
        name = "test-w-o-unreached"

        def load_native(self, params, dtype):
            return LeavesWoUnreached(self, params, dtype)

    report = mha_harness.check(Unreached(), cases=["check_gradients_match_reference"], isolate=False)
    messages = [r.message for r in report.failures()]
    assert messages and all("gradient of W_o: got None: the backward did not reach W_o" in m for m in messages), \
        messages
    assert not any("dtype: got object" in m for m in messages)


def test_a_wrong_forward_under_a_gradient_failure_is_named_or_placed_at_this_call():
    """The gradient cases' "fix the forward first" names the mask mistake the forward matches, or, where none is
    known, the call it is wrong at (an outside user's gradient failure pointed at output and mask cases that had all
    passed: the layer was wrong at Tq < Tk with padding only)."""
    from mha_harness.conformance.casekit import forward_also_wrong
    from mha_harness.contract.api import AttentionConfig, AttentionInputs
    from mha_harness.contract.params import make_params
    from mha_harness.contract.reference import reference_attention
    params = make_params(AttentionConfig(8, 2), seed=0)
    rng = np.random.default_rng(1)
    q, kv = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 9, 8))
    inputs = AttentionInputs(q, kv, kv, key_padding_mask=np.arange(9)[None, :] >= np.array([[9], [5]]))
    cotangent = np.ones((2, 3, 8))
    ignored = reference_attention(params, inputs.replace(key_padding_mask=None)).output
    named = forward_also_wrong(lambda: ignored, params, inputs, "float64", cotangent)
    assert "the same call without key_padding_mask: the mask is not applied" in named and "(this call:" not in named
    noisy = reference_attention(params, inputs).output + 0.01 * rng.standard_normal((2, 3, 8))
    placed = forward_also_wrong(lambda: noisy, params, inputs, "float64", cotangent)
    assert placed.endswith("fix the forward first (this call: forward of batch 2, Tq = 3 queries against Tk = 9 keys "
                           "(one x_q and one x_kv), with key_padding_mask (2, 9); where the output and mask cases "
                           "pass, the forward is wrong at this shape or with these masks only)"), placed
