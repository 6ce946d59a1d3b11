"""A failed whole-output comparison names the known wrong layer its output matches (harness/conformance/diagnoses.py):
each diagnosis is proved on a backend that makes exactly that mistake."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import mha_harness
from mha_harness.conformance.diagnoses import layer_mistake, polarity_hint, wrong_layer_output
from mha_harness.conformance.results import Status
from mha_harness.contract.api import AttentionConfig, AttentionInputs
from mha_harness.contract.params import make_params
from mha_harness.contract.reference import reference_attention
from mha_harness.implementations.mutants import MUTANTS
from mha_harness.implementations.mutants.zoo import FullyMaskedRowsNaN, Mutant, MutantBackend, _GradientMutant
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from mha_harness.toolkit.divergences import (
    FULLY_MASKED_CASE,
    nan_fully_masked_divergences,
    uniform_fully_masked_divergences,
)


class _SoftmaxOverQueries(NumpyNaiveLoaded):
    def softmax(self, scores):  # normalises each key's column over the queries
        top = scores.max(axis=-2, keepdims=True)
        e = np.exp(scores - np.where(np.isfinite(top), top, 0))
        return e / np.maximum(e.sum(axis=-2, keepdims=True), np.finfo(e.dtype).tiny)


class _PaddingReadInverted(NumpyNaiveLoaded):
    def masks(self, inputs):
        flipped = None if inputs.key_padding_mask is None else ~inputs.key_padding_mask
        return super().masks(inputs.replace(key_padding_mask=flipped))


class _FiniteMaskValue(NumpyNaiveLoaded):
    """Masks with the dtype's most negative finite value, as flax and jax.nn.dot_product_attention do: a row with
    every key masked softmaxes to uniform weights (the uniform average of V)."""

    def masked_softmax(self, scores, allowed, additive):
        if additive is not None:
            scores += additive.astype(self.dtype)
        if allowed is not None:
            np.copyto(scores, np.finfo(self.dtype).min, where=~allowed)
        return self.softmax(scores)


class _SplitTokensOnTheWayIn(NumpyNaiveLoaded):
    def split_heads(self, x, n_heads):  # x.reshape(B, h, T, d_head); the merge stays right
        b, t, w = x.shape
        return x.reshape(b, n_heads, t, w // n_heads)


class _MergedWithoutTransposeBack(NumpyNaiveLoaded):
    def merge_heads(self, heads):  # (B, h, T, d_head).reshape(B, T, h * d_head); the split stays right
        b, h, t, dh = heads.shape
        return heads.reshape(b, t, h * dh)


class _ScaledByDModel(NumpyNaiveLoaded):
    def scale(self):
        return 1.0 / self.config.d_model


def _backend(name, loaded, divergences=()):
    return type(name, (NumpyNaive,), {"name": name, "loaded_class": loaded, "divergences": divergences})()


def _messages(backend, case):
    return [f.message for f in mha_harness.check(backend, cases=[case]).failures()]


@pytest.mark.parametrize("backend, case, named", [
    (_backend("softmax-over-queries", _SoftmaxOverQueries), "check_output_matches_reference",
     "a softmax over the queries (axis -2"),
    (MutantBackend(next(m for m in MUTANTS if m.name == "mutant-no-output-projection"), weights=False),
     "check_output_matches_reference", "without the output projection W_o"),
    (MutantBackend(next(m for m in MUTANTS if m.name == "mutant-split-tokens"), weights=False),
     "check_output_matches_reference", "'split tokens instead of features'"),
    (_backend("padding-inverted", _PaddingReadInverted), "check_padding_mask_output_matches_reference",
     "key_padding_mask read with the opposite polarity"),
    (MutantBackend(next(m for m in MUTANTS if m.name == "mutant-heads-merged-feature-major"), weights=False),
     "check_output_matches_reference", "heads concatenated in the wrong order: feature j of head h at j * heads + h"),
    (_backend("split-tokens-in", _SplitTokensOnTheWayIn), "check_head_split_keeps_features_together",
     "'split tokens instead of features' mistake on the way in only"),
    (_backend("split-tokens-in", _SplitTokensOnTheWayIn), "check_output_matches_reference",
     "'split tokens instead of features' mistake on the way in only"),
    (_backend("merged-without-transpose", _MergedWithoutTransposeBack), "check_output_matches_reference",
     "the heads merged without the transpose back"),
    (_backend("scaled-by-d-model", _ScaledByDModel), "check_scores_scaled_by_sqrt_d_head",
     "scores scaled by 1/d_model instead of 1/sqrt(d_head)"),
    # W_o mixes the heads right, the heads are wrong: the W_o case says why, not numbers only (a stranger's ViT
    # block with 1/sqrt(d_model) read its failure as a W_o bug)
    (_backend("scaled-by-d-model", _ScaledByDModel), "check_output_projection_mixes_heads",
     "scores scaled by 1/d_model instead of 1/sqrt(d_head)"),
    (_backend("split-tokens-in", _SplitTokensOnTheWayIn), "check_output_projection_mixes_heads",
     "'split tokens instead of features' mistake on the way in only"),
], ids=["softmax-axis", "no-w-o", "split-tokens", "padding-polarity", "heads-feature-major",
        "split-tokens-in-head-split", "split-tokens-in-grid", "merged-without-transpose", "scale-1-over-d-model",
        "scale-in-w-o-case", "split-tokens-in-w-o-case"])
def test_the_failure_names_the_wrong_layer_it_matches(backend, case, named):
    messages = _messages(backend, case)
    assert messages and all(named in m for m in messages), [m for m in messages if named not in m][:2]


#: a layer whose rows with every key masked give the declared convention, and the same layer reading the harness's
#: key_padding_mask (True = padding) as True = attend
_CONVENTIONS = {
    "uniform_average": (_FiniteMaskValue, uniform_fully_masked_divergences("masks with the most negative finite "
                                                                            "value, as flax does")),
    "nan": (FullyMaskedRowsNaN, nan_fully_masked_divergences("softmax of a row of -inf: 0 / 0")),
}


@pytest.mark.parametrize("convention", list(_CONVENTIONS))
def test_an_inverted_padding_mask_is_named_under_the_empty_row_convention_the_backend_declares(convention):
    """A Flax NNX plugin (declaring fully_masked_rows:uniform_average) passed the key_padding_mask to flax (True =
    attend) without inverting it: in batch item 0, which has no padding, the inverted mask hides every key and the
    backend outputs its declared convention there, so the opposite-polarity hypothesis must give those rows the same
    (with zeros there it never matched: 2 of 13 failures named the bug). Every failing padded comparison names it."""
    rows, divergences = _CONVENTIONS[convention]
    honest = _backend(f"{convention}-rows", rows, divergences)
    verified = mha_harness.check(honest, cases=[FULLY_MASKED_CASE]).results
    assert verified and all(r.status == Status.EXPECTED_DIVERGENCE for r in verified), [r.message for r in verified]
    inverted = _backend(f"{convention}-rows-padding-inverted", type("Inverted", (_PaddingReadInverted, rows), {}),
                        divergences)
    report = mha_harness.check(inverted, cases=["check_padding_mask_output_matches_reference",
                                                "check_mask_compositions_match_reference"], include_slow=False)
    failures = report.failures()
    named = "the key_padding_mask read with the opposite polarity"
    assert "check_padding_mask_output_matches_reference" in {f.case for f in failures}
    assert all(named in f.message for f in failures), [f.message for f in failures if named not in f.message][:2]


@pytest.mark.parametrize("convention", ["zeros", *_CONVENTIONS])
def test_weights_under_an_inverted_padding_mask_are_named_with_weights_true(convention):
    """The same plugin's first failure was check_attention_weights_match_reference's "masked entry ... is 0.111;
    expected exactly 0": the uniform 1/9 of a row the inverted mask empties. polarity_hint(..., weights=True) names
    the inverted mask from those weights, under each empty-row convention, for that case to append."""
    rows = () if convention == "zeros" else (_CONVENTIONS[convention][0],)
    backend = _backend("weights", type("Inverted", (_PaddingReadInverted, *rows), {}))
    params = make_params(AttentionConfig(32, 4), seed=6)
    q, k, v = np.random.default_rng(6).standard_normal((3, 2, 9, 32))
    inputs = AttentionInputs(q, k, v, key_padding_mask=np.arange(9)[None, :] >= np.array([9, 5])[:, None],
                             causal="top-left")
    got = backend.load(params, dtype="float64").forward(inputs, need_weights=True).weights
    assert not np.allclose(np.nan_to_num(got), reference_attention(params, inputs, need_weights=True).weights)
    assert polarity_hint(got, params, inputs, weights=True).startswith(
        "; the weights match the key_padding_mask read with the opposite polarity (the harness's True = padding, "
        "ignore) -- where a wrapper converts the harness's mask")
    # and the weights case appends it to its failure
    weights_case = "check_attention_weights_match_reference"
    failures = mha_harness.check(backend, cases=[weights_case], include_slow=False).failures()
    padded = [f for f in failures if f.params.get("masked")]
    assert padded and all("the weights match the key_padding_mask read with the opposite polarity" in f.message
                          for f in padded), [f.message for f in failures]


@pytest.mark.parametrize("d_model, heads", [(6, 1), (4, 4)], ids=["one-head", "one-feature-per-head"])
def test_a_right_output_is_never_named_heads_concatenated_in_the_wrong_order(d_model, heads):
    """With one head, or one feature per head, the feature-major merge is the right layer: not a candidate there."""
    params = make_params(AttentionConfig(d_model, heads), seed=3)
    x = np.random.default_rng(3).standard_normal((2, 5, d_model))
    inputs = AttentionInputs(x, x, x)
    right = reference_attention(params, inputs).output
    assert np.allclose(wrong_layer_output(params, inputs, heads_feature_major=True), right)
    assert layer_mistake(right, params, inputs, bound=1e-6) == ""


def test_one_query_against_two_keys_names_both_mistakes_it_cannot_tell_apart():
    """At Tq = 1, Tk = 2 (bottom-right) a mask without the diagonal and top-left alignment give the same output
    (the query sees key 0 alone): both are named, not the first that fits; at Tq = 1, Tk = 5 only the missing
    diagonal fits, named with the offset."""
    from mha_harness.conformance.diagnoses import causal_hint
    config = AttentionConfig(16, 2)
    params = make_params(config, seed=3)
    for tk, expected in ((2, ["this input cannot tell 2 mistakes apart", "excludes the diagonal", "top-left"]),
                         (5, ["excludes the diagonal (query i cannot see its own key, key i + 4)"])):
        inputs = mha_harness.make_inputs(config, 1, 1, tk, seed=4).replace(causal="bottom-right")
        wrong = reference_attention(params, inputs.replace(causal=None, attn_mask=np.eye(1, tk, k=tk - 1) == 0))
        hint = causal_hint(wrong.output, params, inputs)
        assert all(part in hint for part in expected), hint
        assert ("top-left" in hint) == (tk == 2), hint


def test_two_positions_name_a_mask_one_key_too_wide_beside_no_mask_they_cannot_tell_apart():
    """At Tq = Tk = 2 a causal mask one key too wide lets every query see every key, as no mask does: an outside
    user's GPT-2 tril(diagonal=1), shrunk by search to two positions, was named "without a causal mask" and
    "masked scores set to 0" only, its own mistake left out of a list that read as whole. At three positions the
    two differ, and only the wide mask is named."""
    from mha_harness.conformance.diagnoses import causal_hint
    config = AttentionConfig(16, 2)
    params = make_params(config, seed=3)
    for t, both in ((2, True), (3, False)):
        inputs = mha_harness.make_inputs(config, 1, t, seed=4).replace(causal="top-left")
        wrong = reference_attention(params, inputs.replace(causal=None, attn_mask=np.tri(t, t, k=1, dtype=bool)))
        hint = causal_hint(wrong.output, params, inputs)
        assert "a causal mask one key too wide" in hint, hint
        assert ("without a causal mask" in hint) == both and ("cannot tell" in hint) == both, hint


def test_a_list_of_mistakes_joined_to_another_counts_every_mistake_once():
    """The causal mask's own list (no mask, or one key too wide) joined to another diagnosis that fits (masked scores
    set to 0) reads as one list of three, not a list nested in a list of two."""
    from mha_harness.conformance.diagnoses import _together
    joined = _together(["; this input cannot tell 2 mistakes apart, the output matches each: no mask; or too wide",
                        "; the output matches masked scores set to 0"])
    assert joined == ("; this input cannot tell 3 mistakes apart, the output matches each: no mask; or too wide; or "
                      "masked scores set to 0"), joined


@pytest.mark.parametrize("loaded, case, named", [
    (_ScaledByDModel, "check_scores_scaled_by_sqrt_d_head", "scores scaled by 1/d_model"),
    (_ScaledByDModel, "check_output_projection_mixes_heads", "scores scaled by 1/d_model"),
    (_ScaledByDModel, "check_large_logits_stay_finite_and_correct", "scores scaled by 1/d_model"),
    (_SplitTokensOnTheWayIn, "check_head_split_keeps_features_together", "on the way in only"),
    (_SplitTokensOnTheWayIn, "check_heads_are_separated", "on the way in only"),
    (_PaddingReadInverted, "check_padding_mask_output_matches_reference", "opposite polarity"),
    (_PaddingReadInverted, "check_mask_compositions_match_reference", "opposite polarity"),
    (_PaddingReadInverted, "check_attention_weights_match_reference", "opposite polarity"),
])
def test_the_scale_head_and_mask_cases_count_their_diagnosis_in_the_summary(loaded, case, named):
    """The scale, head and mask cases' diagnoses are kept with the result (conformance.json's extra.diagnosis) and
    counted on the summary's "diagnosed:" line, as the reference comparisons' are (strangers' summaries left them
    out: a key padding mask read with the opposite polarity was named in the messages only)."""
    report = mha_harness.check(_backend("wrong", loaded), cases=[case])
    failed = report.failures()
    assert failed and all(named in f.extra.get("diagnosis", "") for f in failed), [f.extra for f in failed]
    assert any(line.strip().startswith("diagnosed:") and case in line for line in report.summary_lines())


def test_fully_masked_rows_that_are_neither_zeros_nan_nor_uniform_say_what_they_are():
    """A stranger's padding read with the opposite polarity made its fully padded rows 'observed other', which said
    nothing: the message gives how far they are from the zero rows and that they equal the unmasked rows."""
    report = mha_harness.check(_backend("wrong", _PaddingReadInverted), cases=["check_fully_masked_rows_output_zeros"])
    failed = report.failures()
    assert failed and "observed other (up to" in failed[0].message
    assert "they equal the same rows with no mask" in failed[0].message, failed[0].message


def test_a_failed_output_comparison_lists_the_few_rows_outside_the_bound():
    """A kernel wrong only at a tile's boundary (a stranger's diagonal block dropping its last key) was reported by
    its worst position alone; the message lists the rows outside the bound, or, when most are, the rows within."""
    from mha_harness.conformance.casekit import CaseFailure, assert_close
    from mha_harness.contract.tolerance import Tolerance

    expected = np.zeros((2, 96, 4))
    boundary = expected.copy()
    boundary[0, 31, 1] = boundary[1, 63, 2] = 1.0
    tol = Tolerance(bound=1e-3, dtype="float32", naive_error=1e-4)
    with pytest.raises(CaseFailure, match=r"2 of 192 \(batch, position\) rows are outside it \(batch:position "
                                          r"0:31, 1:63\)"):
        assert_close(boundary, expected, tol, "output")
    everywhere = np.ones_like(expected)
    everywhere[:, 0] = 0.0
    with pytest.raises(CaseFailure, match=r"190 of 192 .* \(within it: batch:position 0:0, 1:0\)"):
        assert_close(everywhere, expected, tol, "output")


class _ValuesAlwaysZero(NumpyNaiveLoaded):
    """Attends over values that are all zero (a stranger's layer attended over a cache it had not written yet)."""

    def project(self, x, which):
        y = super().project(x, which)
        return np.zeros_like(y) if which == "v" else y


def test_zero_heads_are_not_read_as_w_o_left_out():
    """Heads of zeros make the output zeros whatever W_o is: the projection case said "W_o was not applied" for a
    layer whose W_o was fine. It now fails on the output without blaming W_o."""
    class ZeroValues(NumpyNaive):
        name = "numpy-zero-values"
        loaded_class = _ValuesAlwaysZero

    [failure] = mha_harness.check(ZeroValues(), cases=["check_output_projection_mixes_heads"]).failures()
    assert "W_o was not applied" not in failure.message, failure.message


class _ParametersFrozen(_GradientMutant):
    def compute_vjp(self, inputs, cotangent):  # the weights do not require grad: their gradients stay zero
        grads = super().compute_vjp(inputs, cotangent)
        return {n: np.zeros_like(g) if n.startswith(("W_", "b_")) else g for n, g in grads.items()}


def test_a_backward_that_never_reaches_the_parameters_is_named():
    backend = MutantBackend(Mutant("parameters-frozen", "parameters do not require grad", _ParametersFrozen,
                                   "every parameter's gradient", gradients=True), weights=False)
    messages = _messages(backend, "check_gradients_match_reference")
    assert messages and all("every parameter's gradient is zero or missing: the backward does not reach the "
                            "parameters" in m for m in messages), messages[:2]


def _nn_mha_needing_weights(divergences=()):
    """torch-nn-mha called with need_weights=True whatever the case asks (nn.MultiheadAttention's default): its
    rows with no key output NaN."""
    from mha_harness.implementations.torch_nn_mha import TorchNnMha, TorchNnMhaLoaded

    class _NeedsWeights(TorchNnMhaLoaded):
        def forward_tensors(self, q, k, v, inputs, need_weights):
            out, weights = super().forward_tensors(q, k, v, inputs, True)
            return out, weights if need_weights else None

    class NnMhaNeedWeights(TorchNnMha):
        def load_native(self, params, dtype):
            return _NeedsWeights(self, params, dtype)

    backend = NnMhaNeedWeights()
    backend.name = "nn-mha-need-weights"
    backend.divergences = tuple(divergences)
    return backend


def test_nan_in_rows_without_a_key_is_named_as_a_convention_and_its_nan_backward_not_called_a_leak():
    """A stranger's nn.MultiheadAttention wrapper called with need_weights=True (its default): rows a bottom-right
    mask leaves without a key (Tq > Tk) output NaN, and the NaN spreads through the backward. The causal output
    case names the convention and how to declare it; the causal Jacobian case says the gradients are not finite
    and why, instead of calling the NaN a leak."""
    pytest.importorskip("torch")
    report = mha_harness.check(_nn_mha_needing_weights(), cases=["check_causal_output_matches_reference",
                                                                 "check_causal_jacobian_zero_for_future_inputs"],
                               isolate=False)
    empty = [r for r in report.results if r.params.get("variant") == "rows_without_visible_keys"]
    output = [r for r in empty if r.case == "check_causal_output_matches_reference"]
    jacobian = [r for r in empty if r.case == "check_causal_jacobian_zero_for_future_inputs"]
    assert output and jacobian
    for r in output:
        assert r.status == "failed" and "nan_fully_masked_divergences" in r.message, r.message
    for r in jacobian:
        assert r.status == "failed" and "gradients not finite" in r.message and "leak" not in r.message.split(";")[0]
        assert "need_weights=False" in r.message, r.message


def test_declared_masked_poison_and_nan_empty_rows_combine_in_the_causal_leak_case():
    """The same wrapper declaring both of its behaviours: NaN/inf held by masked keys reaches the output
    (masked_poison), and rows with no key output NaN. The causal leak case's poisoned variants with rows that see no
    key failed under the poison declaration ("NaN where no key held NaN/inf": the empty rows); they are verified
    divergences now, while a stray NaN in a row that sees keys still fails (the masked_poison tests)."""
    pytest.importorskip("torch")
    from mha_harness.toolkit.divergences import masked_poison_divergences, nan_fully_masked_divergences
    declared = (*masked_poison_divergences("0 * NaN in P @ V"),
                *nan_fully_masked_divergences("softmax of a row of -inf"))
    report = mha_harness.check(_nn_mha_needing_weights(declared), cases=["check_causal_mask_blocks_future_keys",
                                                                         "check_causal_output_matches_reference"],
                               isolate=False)
    empty = [r for r in report.results if r.params.get("variant") == "rows_without_visible_keys"]
    poisoned = [r for r in empty if r.params.get("poison") in ("nan", "inf")]
    assert poisoned and all(r.status == "expected-divergence" for r in poisoned), [r.message for r in poisoned]
    assert not [r for r in report.results if r.status == "failed"], [r.message for r in report.results
                                                                        if r.status == "failed"]


def test_causal_mask_mistakes_are_plain_calls_with_the_masks_they_name():
    """The candidate calls check's diagnoses and bench's wrong-output check both compare with: each carries the mask
    its name says and no causal mask of its own, also where every call is implicitly causal (always_causal)."""
    from mha_harness.contract.api import implicitly_causal
    from mha_harness.contract.mistakes import causal_mask_mistakes
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 5, 4))
    call = AttentionInputs(q, kv, kv, causal="bottom-right")  # offset 2: query i sees keys up to i + 2
    with implicitly_causal("bottom-right"):
        got = causal_mask_mistakes(call)
    assert list(got) == ["not_applied", "other_alignment", "one_key_too_wide", "reversed", "no_diagonal", "inverted",
                         "offset_negated"]
    assert got["other_alignment"].causal == "top-left"
    assert all(c.causal is None for name, c in got.items() if name != "other_alignment")
    assert got["not_applied"].attn_mask is None
    np.testing.assert_array_equal(got["one_key_too_wide"].attn_mask, np.tri(3, 5, k=3, dtype=bool))
    np.testing.assert_array_equal(got["reversed"].attn_mask, ~np.tri(3, 5, k=1, dtype=bool))
    np.testing.assert_array_equal(got["no_diagonal"].attn_mask, np.tri(3, 5, k=1, dtype=bool))
    np.testing.assert_array_equal(got["inverted"].attn_mask, ~np.tri(3, 5, k=2, dtype=bool))
    np.testing.assert_array_equal(got["offset_negated"].attn_mask, np.tri(3, 5, k=-2, dtype=bool))
    # no alignment to swap; the mistaken causal masks joined to the call's own attn_mask, bool or additive
    keep = np.array([[True, False, True]] * 3)
    square = AttentionInputs(q, q, q, causal="top-left", attn_mask=keep)
    got = causal_mask_mistakes(square)
    assert list(got) == ["not_applied", "one_key_too_wide", "reversed", "no_diagonal", "inverted"]
    np.testing.assert_array_equal(got["one_key_too_wide"].attn_mask, keep & np.tri(3, 3, k=1, dtype=bool))
    biases = np.where(keep, 0.5, -np.inf)
    wide = causal_mask_mistakes(square.replace(attn_mask=biases))["one_key_too_wide"].attn_mask
    np.testing.assert_array_equal(wide, np.where(np.tri(3, 3, k=1, dtype=bool), biases, -np.inf))
    assert causal_mask_mistakes(AttentionInputs(q, q, q)) == {}


def test_a_mistake_that_leaves_this_input_unchanged_is_not_named_beside_the_one_that_fits():
    """A stranger's cross-attention layer read its keep-mask inverted; the search shrank it to an input with nothing
    padded and nearly equal scores, where the failure (5e-5) is below the diagnoses' margin (1e-3): "the mask is not
    applied" and "the mask applied after the softmax", whose outputs there are the correct one, were named beside the
    inverted polarity. Only a mistake that explains the output better than the correct layer is named."""
    from mha_harness.conformance.diagnoses import mask_mistake
    from mha_harness.contract.reference import empty_rows_as
    config = AttentionConfig(1, 1)
    params = make_params(config, seed=0, scale=0.05)  # nearly equal scores: every key's weight near 1/2
    x = np.random.default_rng(1).standard_normal((1, 2, 1))
    inputs = AttentionInputs(x, x, x, key_padding_mask=np.zeros((1, 2), bool))  # nothing padded
    with empty_rows_as("uniform_average"):  # the layer masks with the most negative finite value, as declared
        got = reference_attention(params, inputs.replace(key_padding_mask=~inputs.key_padding_mask)).output
        error = float(np.max(np.abs(got - reference_attention(params, inputs).output)))
        assert 0 < error < 1e-3  # a failure smaller than the margin: the case the rule is for
        hint = mask_mistake(got, params, inputs)
    assert "opposite polarity" in hint and "cannot tell" not in hint, hint
    assert "not applied" not in hint and "after the softmax" not in hint, hint


@pytest.mark.parametrize(("mutant", "advised"), [("mutant-no-scale", "Capabilities(score_scale=1.0)"),
                                                  ("mutant-scale-inverse-d-head",
                                                   "Capabilities(score_scale='1/d_head')"),
                                                  ("mutant-scale-sqrt-d-model", None)])
def test_scores_unscaled_or_scaled_by_1_over_d_head_say_how_to_declare_a_layer_built_so(mutant, advised):
    """Unscaled scores and scores scaled by 1/d_head are named, and only they carry the advice for a layer built so
    on purpose (T5 leaves its scores unscaled: a stranger wrapping T5 found nothing in the docs; muP scales by
    1/d_head): the declaration of its score scale; another wrong scale gets the name alone."""
    by_name = {m.name: m for m in MUTANTS}
    report = mha_harness.check(MutantBackend(by_name[mutant]), cases=["check_scores_scaled_by_sqrt_d_head"],
                               include_slow=False, isolate=False)
    messages = [f.message for f in report.failures()]
    assert messages and all("instead of 1/sqrt(d_head)" in m for m in messages), messages
    assert all(("declares it: Capabilities(score_scale=" in m) == bool(advised) for m in messages), messages
    assert not advised or all(advised in m for m in messages), messages


class _KeyValueInputsSwapped(NumpyNaiveLoaded):
    def heads(self, inputs):  # W_k applied to the value input, W_v to the key input
        return super().heads(inputs.replace(key=inputs.value, value=inputs.key))


def test_keys_projected_from_the_query_input_are_named_on_every_grid_row_they_change():
    """A shared-K/V layer computing k = W_k(x_q) is named on every grid row it fails (Tq = Tk above one key: with one
    key the weight is 1 whatever the key)."""
    mutant = MutantBackend(next(m for m in MUTANTS if m.name == "mutant-keys-from-query"), weights=False)
    report = mha_harness.check(mutant, cases=["check_output_matches_reference"], isolate=False)
    failures = report.failures()
    assert len(failures) >= 5 and [r.params["variant"] for r in report.results
                                   if r.status == Status.PASSED] == ["single_token"]
    named = "the output matches keys projected from the query input (W_k applied to the query input, not x_kv)"
    assert all(named in f.message for f in failures), [f.message for f in failures][:2]


def test_a_separate_form_layer_with_its_key_and_value_inputs_swapped_is_named():
    """The grid's Tq != Tk rows give a separate-form layer three arrays: swapped key and value inputs are named there
    (its Tq = Tk rows pass one x, where the swap changes nothing)."""
    backend = _backend("key-value-swapped", _KeyValueInputsSwapped)
    failures = mha_harness.check(backend, cases=["check_output_matches_reference"], isolate=False).failures()
    assert failures and all("the key and value inputs swapped (W_k applied to value, W_v to key)" in f.message
                            for f in failures), [f.message for f in failures][:2]


def test_an_output_no_nearer_a_small_scale_than_uniform_weights_is_not_named_a_scale():
    """Keys projected from x_q over the grid's 1000-key row in float16 (a stranger's T5 copy): with the wider
    diagnosis margin the output came within it of scores scaled by 1/d_model and nearer that than the right layer,
    so it was named that scale; it is nearer still to uniform weights, which no scale explains better."""
    from mha_harness.cases._fixtures import form_inputs
    from mha_harness.conformance.casekit import wrong_scale
    from mha_harness.contract.expected import tolerance_for
    from mha_harness.contract.mistakes import distance, explains, with_score_scale
    params = make_params(AttentionConfig(128, 2), seed=2000)  # the grid's long row on a bias-free layer
    inputs = form_inputs("shared_kv", params.config, 1, 1000, 1000, seed=3)
    got = reference_attention(params, inputs.replace(key=inputs.query)).output
    _, tol = tolerance_for(params, inputs, "float16")
    small = reference_attention(with_score_scale(params, np.sqrt(64) / 128), inputs).output  # 1/d_model
    truth = reference_attention(params, inputs).output
    assert distance(got, small) <= 10 * tol.bound and explains(got, small, truth)  # what named it before
    assert wrong_scale(got, params, inputs, tol.bound) is None
    assert "keys projected from the query input" in layer_mistake(got, params, inputs, tol.bound)


def _causal_numpy_layer(*, key_rotation=None, value_scale: float = 1.0, window: int | None = None):
    """A one-x causal NumPy layer for function_backend, with the keys rotated per head (rotary applied to k alone),
    the values scaled, or a sliding window of ``window`` keys."""
    def fn(X, W_q, W_k, W_v, W_o, num_heads):
        T, d_model = X.shape

        def split_heads(M):
            return M.reshape(T, num_heads, d_model // num_heads).transpose(1, 0, 2)
        Q, K, V = split_heads(X @ W_q), split_heads(X @ W_k), split_heads(X @ W_v) * value_scale
        if key_rotation is not None:
            K = K @ key_rotation
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        visible = (j <= i) & (j > i - (window or T))
        scores = np.where(visible, Q @ K.transpose(0, 2, 1) / np.sqrt(d_model // num_heads), -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        return (weights @ V).transpose(1, 0, 2).reshape(T, d_model) @ W_o
    return fn


def test_an_output_right_only_on_rows_that_see_one_key_blames_the_weights():
    """Keys rotated in a causal layer (rotary applied to k alone, as an outside user's Llama copy did): a row with one
    key outputs that key's value whatever its score, so only those rows are right; the failure says the weights over
    several keys are wrong, not the values or W_o; a layer wrong on those rows too gets no such sentence."""
    import mha_harness

    rotation = np.linalg.qr(np.random.default_rng(0).standard_normal((8, 8)))[0]
    sentence = "every row that sees a single key is right"
    rotated = mha_harness.function_backend(_causal_numpy_layer(key_rotation=rotation), name="keys-rotated",
                                           causal="always")
    failures = mha_harness.check(rotated, cases=["check_output_matches_reference"]).failures()
    assert failures and all(sentence in f.message for f in failures if "rows are outside it (within it" in f.message)
    assert any(sentence in f.message for f in failures)
    values_wrong = mha_harness.function_backend(_causal_numpy_layer(key_rotation=rotation, value_scale=1.5),
                                                name="values-wrong-too", causal="always")
    failures = mha_harness.check(values_wrong, cases=["check_output_matches_reference"]).failures()
    assert failures and not any(sentence in f.message for f in failures)


def test_rows_wrong_from_one_position_on_are_named_so():
    """A causal layer with a sliding window of 600 keys (a Mistral-style layer built with its window, as an outside
    user's was) is right up to row 599 and wrong from row 600 on: the failure names that position, not only
    precision."""
    import mha_harness

    backend = mha_harness.function_backend(_causal_numpy_layer(window=600), name="window-600", causal="always")
    failures = mha_harness.check(backend, cases=["check_output_matches_reference"]).failures()
    assert any("every row up to position 599 is right and every row from 600 on is wrong" in f.message
               for f in failures), [f.message[-300:] for f in failures]


def test_wrong_scales_that_coincide_at_a_shape_are_named_as_either():
    """At d_head = sqrt(d_model), 1/d_head and 1/sqrt(d_model) are one scale: named as either (an outside user read
    "1/sqrt(d_model) = 1/d_head" as a claim about the formula)."""
    from mha_harness.contract.mistakes import wrong_scales

    labels = set(wrong_scales(AttentionConfig(256, 16)).values())
    assert "1/sqrt(d_model) or 1/d_head" in labels
    assert "1 (no scaling)" in labels and "1/d_model" in labels


def test_a_strict_run_a_declaration_will_verify_names_no_mistake_and_the_verifying_run_does():
    """Inside ``undiagnosed`` (the runner's strict run of a variant a declaration matches) a failing output raises
    its failure, error and bound unchanged, without looking for the mistake; the verifying run that fails too names
    it, as a plain failure does."""
    from mha_harness.conformance.casekit import CaseFailure, check_against_reference
    from mha_harness.conformance.diagnosing import undiagnosed
    from mha_harness.contract.api import Divergence

    backend = _backend("scaled-by-d-model", _ScaledByDModel)
    params = make_params(AttentionConfig(32, 4), seed=0)
    rng = np.random.default_rng(0)
    inputs = AttentionInputs(*(rng.standard_normal((2, 9, 32)) for _ in range(3)))
    failures = []
    for block in (undiagnosed, contextlib.nullcontext):
        with block(), pytest.raises(CaseFailure) as failed:
            check_against_reference(backend, params, inputs, "float32")
        failures.append(failed.value)
    quiet, named = failures
    assert quiet.diagnosis == "" and "1/d_model" not in str(quiet)
    assert "scores scaled by 1/d_model" in named.diagnosis and str(named).startswith(str(quiet))
    assert quiet.max_error == named.max_error

    declared = _backend("scaled-by-d-model-declared", _ScaledByDModel, divergences=(
        Divergence("check_output_matches_reference", "precision:bfloat16", "a scale mistake no precision covers",
                   when={"dtype": "float32"}),))
    report = mha_harness.check(declared, cases=["check_output_matches_reference"])
    results = [r for r in report.results if r.params.get("dtype") == "float32"]
    failed = [r for r in results if r.status == Status.FAILED]
    assert len(failed) >= 8  # one key, one token: right at any scale; a few rows within bfloat16's bound
    assert all(r.message.startswith("fails even under its declared divergence") for r in failed)
    assert all("scores scaled by 1/d_model" in r.extra.get("diagnosis", "") for r in failed)
    verified = [r for r in results if r.status == Status.EXPECTED_DIVERGENCE]
    assert all("1/d_model" not in r.message and "diagnosis" not in r.extra for r in verified)
    # the declarations table: verified on some, and (an outside user's report read as settled) not holding on others
    [row] = [line for line in report.to_markdown().splitlines() if "precision:bfloat16" in line]
    cell = (f"| {len(verified)} variant(s): {', '.join(r.variant for r in verified)}" if len(verified) <= 3
            else f"| {len(verified)} variant(s) (the first: {verified[0].variant})")
    assert f"{cell}; it does not hold on {len(failed)} variant(s) it covers" in row, row


class _Float64InFloat32(NumpyNaiveLoaded):
    def __init__(self, params, dtype):
        super().__init__(params, "float32" if dtype == "float64" else dtype)


def test_no_mistake_is_looked_for_in_a_strict_failure_its_declaration_then_verifies(monkeypatch):
    """Naming a mistake costs a reference computation of every wrong layer known: a float64 layer computing in float32
    that declares so (as jax-dpa and onnxruntime-cpu do) is verified without one; undeclared, a failure is
    diagnosed."""
    from mha_harness.conformance import casekit
    from mha_harness.toolkit.divergences import precision_divergences

    looked = []
    real = casekit.common_mistake
    monkeypatch.setattr(casekit, "common_mistake", lambda *a, **k: looked.append(1) or real(*a, **k))
    declared = _backend("float64-in-float32-declared", _Float64InFloat32, divergences=precision_divergences(
        "float64", "float32", "computes in float32", ("check_output_matches_reference",)))
    report = mha_harness.check(declared, cases=["check_output_matches_reference"])  # not .ok: casekit is patched
    assert not report.failures() and report.counts(declared.name).get(Status.EXPECTED_DIVERGENCE, 0) >= 8
    assert looked == []
    params = make_params(AttentionConfig(16, 2), seed=1)
    rng = np.random.default_rng(1)
    inputs = AttentionInputs(*(rng.standard_normal((1, 5, 16)) for _ in range(3)))
    with pytest.raises(casekit.CaseFailure):
        casekit.check_against_reference(_backend("float64-in-float32", _Float64InFloat32), params, inputs, "float64")
    assert looked == [1]


def test_fully_masked_rows_off_by_a_float32_rounding_say_the_call_computes_in_float32():
    """An outside user's float32 kernel, its precision declared for the output cases: the fully-masked case's float64
    rows (b_o rounded to float32) read "neither zeros, NaN nor the uniform average of V" with no way forward; they
    say now that the error is float32-sized and how to declare the case too."""
    failed = [r for r in mha_harness.check(_backend("float64-in-float32", _Float64InFloat32),
                                           cases=["check_fully_masked_rows_output_zeros"]).failures()]
    assert failed and all(r.params["dtype"] == "float64" for r in failed)
    assert all("the error is within the float32 bound" in r.message and "precision_divergences(" in r.message
               for r in failed), failed[0].message


def test_a_float32_computing_layer_gets_one_diagnosed_line_naming_its_precision():
    """An outside user's float32 kernel had the float32-size hint in each of its float64 failures and nothing in the
    summary's "diagnosed:" line: the guess is now the variants' diagnosis, one line without numbers, across cases."""
    from mha_harness.conformance.casekit import CaseFailure, precision_diagnosis

    report = mha_harness.check(_backend("float64-in-float32", _Float64InFloat32),
                               cases=["check_output_matches_reference", "check_fully_masked_rows_output_zeros"])
    failed = report.failures()
    assert {r.case for r in failed} == {"check_output_matches_reference", "check_fully_masked_rows_output_zeros"}
    line = report.diagnoses_line("float64-in-float32")
    assert line.count("\n") == 0 and line.startswith("diagnosed: float64 calls err by float32's size"), line
    assert f"[in {len(failed)} variant(s) of check_output_matches_reference, check_fully_masked_rows_output_zeros]" \
        in line, line
    assert 'precision_divergences("float64", "float32"' in line
    assert precision_diagnosis("") == "" and CaseFailure("no guess").precision == ""
    half = CaseFailure("x", guess="; the error is of half precision's size (...): the float32 call may compute in "
                                  "float16 or bfloat16 somewhere (...)")
    assert half.precision.startswith("float32 calls err by half precision's size"), half.precision


def test_a_causal_alignment_failing_for_a_wrong_scale_says_what_its_failures_match():
    """An outside user's policy table read "top-left FAILS (1 of 2 variants)" for a layer whose only bug was its
    scale: the alignment column adds the mistake its failures match."""
    backend = _backend("scaled-by-d-model", _ScaledByDModel)
    report = mha_harness.check(backend, cases=["check_causal_output_matches_reference"])
    row = report.policies()[backend.name]["causal_alignment"]
    assert "FAILS" in row and "their diagnosis: the output matches scores scaled by 1/d_model" in row, row



def test_masked_scores_set_to_zero_instead_of_minus_inf_are_named():
    """``jnp.where(mask, scores, 0.0)``: every masked key keeps a weight of exp(0 - max). An outside user's JAX layer
    with it failed the causal cases with figures and "a real leak" only; the causal and padding cases now name it."""
    import mha_harness
    from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

    class MaskedToZeroLoaded(NumpyNaiveLoaded):
        def masked_softmax(self, scores, allowed, additive):
            if additive is not None:
                scores = scores + additive.astype(self.dtype)
            if allowed is not None:
                scores = np.where(np.broadcast_to(allowed, scores.shape), scores, 0.0)
            return self.softmax(scores)

    class MaskedToZero(NumpyNaive):
        name = "test-masked-to-zero"
        loaded_class = MaskedToZeroLoaded

    report = mha_harness.check(MaskedToZero(), cases=["check_causal_output_matches_reference",
                                                      "check_padding_mask_output_matches_reference"],
                               isolate=False)
    failed = report.failures()
    assert {r.case for r in failed} == {"check_causal_output_matches_reference",
                                        "check_padding_mask_output_matches_reference"}
    named = [r for r in failed if "masked scores set to 0 instead of -inf" in r.message]
    assert {r.case for r in named} == {r.case for r in failed}, [r.message for r in failed][:3]


def test_one_query_against_one_key_names_both_an_inverted_mask_and_one_without_its_diagonal():
    """Search shrank an outside user's triu(k=0) mask (no diagonal) to one query and one key, where it and an
    inverted mask both leave no key: it named only the inverted mask; both are named now."""
    import numpy as np

    import mha_harness
    from mha_harness.conformance.diagnoses import causal_hint
    from mha_harness.contract.params import make_inputs, make_params
    config = mha_harness.AttentionConfig(2, 1)
    hint = causal_hint(np.zeros((1, 1, 2)), make_params(config), make_inputs(config, 1, 1, 1, causal="top-left"))
    assert "cannot tell 2 mistakes apart" in hint and "the causal mask inverted" in hint \
        and "a causal mask that excludes the diagonal" in hint, hint


def test_a_padding_mask_along_the_query_axis_of_an_always_causal_layer_is_named_beside_dropped():
    """An outside user's always-causal Llama layer broadcast its padding mask along the query axis, and was told only
    "the same call without key_padding_mask": under the causal mask the right-padded item's real query sees no
    padded key either way, which kept the query-axis diagnosis from fitting. On the compared rows the two are one
    output: both are named."""
    import dataclasses

    from mha_harness.implementations.mutants import mutant_backends
    mutant = next(m for m in mutant_backends() if m.name == "mutant-padding-on-query-axis")
    mutant.capabilities = dataclasses.replace(mutant.capabilities, always_causal=True, inputs="self",
                                              causal_alignments=("top-left",), cross_attention=False)
    failed = mha_harness.check([mutant], cases=["check_padding_mask_output_matches_reference"],
                               isolate=False).failures()
    assert failed and all("key_padding_mask applied along the query axis" in f.message
                          and "cannot tell 2 mistakes apart" in f.message for f in failed), failed[0].message[-600:]


@pytest.mark.parametrize("name, words", [
    ("mutant-causal-one-future-token", "a causal mask one key too wide"),
    ("mutant-causal-excludes-diagonal", "a causal mask that excludes the diagonal"),
    ("mutant-causal-mask-reversed", "a reversed causal mask"),
    ("mutant-causal-always-top-left", "top-left alignment instead of bottom-right"),
])
def test_a_causal_mask_mistake_is_named_beside_another_mask(name, words):
    """The causal mistakes are named in the compositions too: joined to the call's attn_mask (bool or additive) and
    on the real queries of a padded call (an outside user's FlexAttention layer, its causal mask one key too wide,
    failed the causal-with-additive composition with a half-precision guess only)."""
    mutant = next(m for m in MUTANTS if m.name == name)
    report = mha_harness.check(MutantBackend(mutant, weights=False), cases=["check_mask_compositions_match_reference"])
    failed = [f for f in report.failures() if f.params["variant"].startswith("causal_with")]
    assert {f.params["variant"] for f in failed} >= {"causal_with_bool_mask", "causal_with_additive_mask"}
    assert all(words in f.message for f in failed), [f.message[-160:] for f in failed if words not in f.message]


def test_a_named_mistake_drops_the_guess_of_a_precision_and_a_pattern_keeps_it():
    """A failure that matches a known mistake is that mistake, whatever its size: the guess of a lower precision
    (which suggests declaring one, hiding the bug) goes; a pattern that names no mistake leaves it."""
    from mha_harness.conformance.casekit import CaseFailure
    guess = "; the error is of half precision's size (within the float16 bound 0.0295): ..."
    failure = CaseFailure("output: max error 0.00858" + guess, 0.00858, None, "", guess)
    named = failure.with_hint("; the output matches a causal mask one key too wide (query i also sees key i + 1)")
    assert str(named) == "output: max error 0.00858; the output matches a causal mask one key too wide (query i " \
                         "also sees key i + 1)" and not named.guess
    pattern = failure.with_hint("; every row that sees a single key is right and every row that sees several keys is "
                                "wrong")
    assert guess in str(pattern) and pattern.guess == guess
