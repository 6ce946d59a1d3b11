"""The mutant zoo proves every case bites: each named mutant is caught in the --quick set by a case whose message
names its bug, even when it returns no attention weights (the catch is on outputs), and every case fails on at
least one mutant."""
from __future__ import annotations

import dataclasses
import functools
import inspect

import numpy as np
import pytest

import mha_harness
from mha_harness.conformance.casekit import all_cases
from mha_harness.implementations.mutants import MUTANTS, mutant_backends, zoo
from mha_harness.implementations.mutants.zoo import MutantBackend

BY_NAME = {m.name: m for m in MUTANTS}


@functools.cache
def quick_report(name: str, weights: bool = False, cases: tuple | None = None):
    """The --quick set (no slow cases) on one mutant; without weights unless asked."""
    return mha_harness.check(MutantBackend(BY_NAME[name], weights=weights), cases=cases, include_slow=False)


def named_catches(mutant, report):
    return [f for f in report.failures() if mutant.message_mentions.lower() in f.message.lower()]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_is_caught_in_quick_without_weights_by_a_message_naming_its_bug(mutant):
    report = quick_report(mutant.name)
    assert not [r for r in report.results if r.status == "error"], [r.message for r in report.results
                                                                      if r.status == "error"][:2]
    named = named_catches(mutant, report)
    assert named, f"{mutant.name} ({mutant.bug}): no failure message mentions {mutant.message_mentions!r}: " \
                  f"{[f.message[:120] for f in report.failures()[:3]]}"


def test_each_mutant_is_also_caught_when_it_returns_weights():
    """The mutation score (mha-harness check --mutants) runs the mutants with weights: still every one caught."""
    from mha_harness.conformance.mutation import mutation_score
    names = ["check_causal_mask_blocks_future_keys", "check_causal_output_matches_reference",
             "check_padding_mask_blocks_padded_keys", "check_mask_compositions_match_reference",
             "check_large_logits_stay_finite_and_correct", "check_attention_weights_match_reference"]
    score = mutation_score(mutant_backends(), cases=names)
    caught = {row["name"] for row in score["mutants"] if row["caught_by"]}
    new = [m.name for m in MUTANTS if m.loaded.__name__.startswith(("CausalMaskNeverApplied", "MaskAfterSoftmax",
                                                                     "FutureKeyIn", "PaddedKeysIn", "PaddingDropped",
                                                                     "AttnMaskReplaces"))]
    assert len(new) == 14 and set(new) <= caught, sorted(set(new) - caught)


@pytest.mark.parametrize("case_name", list(all_cases()))
def test_every_case_fails_on_at_least_one_mutant(case_name):
    case = all_cases()[case_name]
    if case.slow:  # not in --quick (and beyond the zoo's max_seq_len): one mutant, unlimited, on it alone
        backend = MutantBackend(BY_NAME["mutant-no-scale"])
        backend.capabilities = dataclasses.replace(backend.capabilities, max_seq_len=None)
        killers = [backend.name] if mha_harness.check(backend, cases=[case_name]).failures() else []
    elif "attention_weights" in case.requires:
        killers = [m.name for m in MUTANTS if quick_report(m.name, True, (case_name,)).failures()]
    else:
        killers = [m.name for m in MUTANTS if any(f.case == case_name for f in quick_report(m.name).failures())]
    assert killers, f"{case_name} cannot fail: no mutant is caught by it"


@pytest.mark.parametrize("form", ["separate", "self"])
def test_long_rows_with_logits_of_order_100_catch_a_softmax_without_max_subtraction(form):
    name = "mutant-softmax-no-max-subtraction" + ("" if form == "separate" else "-self")
    report = mha_harness.check(MutantBackend(BY_NAME[name]), cases=["check_large_logits_stay_finite_and_correct"])
    failed = {r.params["variant"]: r.message for r in report.failures()}
    assert "long_rows" in failed and "row maximum" in failed["long_rows"], failed


@pytest.mark.parametrize("name, case_name, mentions", [
    ("mutant-causal-mask-never-applied-self", "check_causal_mask_blocks_future_keys", "causal leak"),
    ("mutant-future-key-in-denominator-self", "check_causal_mask_blocks_future_keys", "causal leak"),
    ("mutant-padded-keys-in-denominator-self", "check_padding_mask_blocks_padded_keys", "padding leak"),
    ("mutant-mask-after-softmax-shared-kv", "check_causal_output_matches_reference", "without renormalising"),
    ("mutant-padding-dropped-when-causal", "check_mask_compositions_match_reference",
     "without key_padding_mask: that mask is dropped when combined"),
])
def test_normaliser_and_composition_bugs_are_caught_fast_at_small_t(name, case_name, mentions):
    """Each such bug is caught by one small-T case in well under a second (no T = 8192 needed)."""
    import time
    start = time.perf_counter()
    report = mha_harness.check(MutantBackend(BY_NAME[name], weights=False), cases=[case_name])
    seconds = time.perf_counter() - start
    assert any(mentions in f.message for f in report.failures()), [f.message[:120] for f in report.failures()]
    print(f"{name}: caught by {case_name} in {seconds:.2f} s")


@pytest.mark.parametrize("alignment", ["top-left", "bottom-right"])
def test_padding_dropped_under_causal_is_caught_for_a_backend_with_one_alignment(alignment):
    """With only top-left declared (the most common decoder), the composition case must still see the dropped
    padding mask: under top-left causal, right padding alone is hidden from every real query by the causal mask."""
    backend = MutantBackend(BY_NAME["mutant-padding-dropped-when-causal"], weights=False)
    backend.capabilities = dataclasses.replace(backend.capabilities, causal_alignments=(alignment,))
    report = mha_harness.check(backend, cases=["check_mask_compositions_match_reference"])
    failed = [f for f in report.failures() if f.params.get("variant") == "causal_with_padding"]
    assert {f.params["shape"] for f in failed} == {"square", "more_keys"}, [f.message[:120] for f in failed]
    assert all("without key_padding_mask: that mask is dropped" in f.message for f in failed)


def test_a_padding_only_cross_attention_layer_is_checked_with_fewer_queries_than_keys():
    """An encoder-decoder cross-attention layer declares a key padding mask and no causal mask or attn_mask, so no
    mask composition runs on it: the padding output case's ``cross_attention`` variant (7 queries, 300 keys) is what
    sees a padding mask applied over the query length only, and names it; at Tq = Tk that layer is right."""
    backend = MutantBackend(BY_NAME["mutant-padding-masked-to-query-length"], weights=False)
    backend.capabilities = dataclasses.replace(backend.capabilities, causal_alignments=(), bool_attn_mask=False,
                                               additive_attn_mask=False)
    report = mha_harness.check(backend, include_slow=False)
    assert not [r for r in report.results if r.status == "error"]
    # the replay of its saved search example (results/search, Tq = 1 against Tk = 2) catches it too
    failed = [f for f in report.failures() if f.case != "check_search_regressions_still_pass"]
    assert [(f.case, f.params.get("variant")) for f in failed] == [
        ("check_padding_mask_output_matches_reference", "cross_attention")], [f.message[:120] for f in failed]
    assert "applied to the first Tq = 7 keys only (the keys at positions 7..299" in failed[0].message
    square = [r for r in report.results if r.case == "check_padding_mask_output_matches_reference"
              and "variant" not in r.params]
    assert [r.status for r in square] == ["passed"]


def test_mutants_come_in_every_input_form_and_read_only_their_form():
    forms = {m.inputs for m in MUTANTS}
    assert forms == {"separate", "shared_kv", "self"}
    assert MutantBackend(BY_NAME["mutant-causal-mask-never-applied-self"]).capabilities.inputs == "self"


def test_mutants_subclass_backends_instead_of_patching_module_globals():
    source = inspect.getsource(zoo)
    assert "numpy_naive." not in source and "setattr(" not in source
    from mha_harness.toolkit import masks
    assert "invert" not in inspect.signature(masks.block_mask).parameters


def test_mutation_score_counts_every_mutant():
    from mha_harness.conformance.mutation import mutation_score
    score = mutation_score(mutant_backends(), cases=["check_scores_scaled_by_sqrt_d_head"])
    assert score["total"] == len(MUTANTS)
    caught = {row["name"] for row in score["mutants"] if row["caught_by"]}
    assert {"mutant-scale-sqrt-d-model", "mutant-no-scale", "mutant-scale-inverse-d-head"} <= caught


def test_a_scale_bug_is_named_as_such_by_the_large_logits_case_not_as_a_missing_max_subtraction():
    """Scores divided by d_head stay finite with large logits; the stability case names the scale it matches
    instead of blaming the softmax (a stranger's 1/d_head plugin read "must subtract the row maximum" first)."""
    report = quick_report("mutant-scale-inverse-d-head", cases=("check_large_logits_stay_finite_and_correct",))
    failures = report.failures()
    assert failures and all("1/d_head" in f.message and "row maximum" not in f.message for f in failures)


def test_mutants_are_not_registered_by_default():
    names = mha_harness.load_registry().names()
    assert not [n for n in names if n.startswith("mutant-")]


def test_every_mutant_backend_pickles_for_the_isolated_workers():
    """`mha-harness search --mutants` sends each backend to a worker pickled: the per-form classes made at import
    must be found by name (one was not, and the search stopped with a PicklingError)."""
    import pickle
    for backend in mutant_backends():
        assert type(pickle.loads(pickle.dumps(backend))) is type(backend)


class _OneBlockTiledBackward(zoo.TiledBackwardBlockSoftmax):
    """The block-softmax mutant with blocks of 128 keys: one block holds every key of the suite's shapes."""

    def __init__(self, params, dtype):
        zoo.NumpyTiledLoaded.__init__(self, params, dtype, block_q=128, block_k=128)


class _OneBlockTiledTopLeft(zoo.TiledKeyBlocksTopLeft):
    def __init__(self, params, dtype):
        zoo.NumpyTiledLoaded.__init__(self, params, dtype, block_q=128, block_k=128)


@pytest.mark.parametrize("name, one_block, catching", [
    ("mutant-tiled-backward-block-softmax", _OneBlockTiledBackward, {"check_gradients_match_reference"}),
    # the decode step runs the tiled kernel bottom-right too: 5 new queries against 65 cached keys
    ("mutant-tiled-causal-blocks-top-left", _OneBlockTiledTopLeft,
     {"check_causal_output_matches_reference", "check_decode_step_over_filled_cache_matches_reference"}),
])
def test_tiled_kernel_bugs_are_caught_only_by_variants_whose_keys_cross_a_block(name, one_block, catching):
    """The tiled mutants' bugs live in how 16-key blocks combine (the backward's per-block weights; which blocks a
    bottom-right causal mask lets the kernel skip): the same code with one 128-key block passes every case, so the
    catch is the case shapes' 65 keys (5 x 65 and 65 x 65 causal, 65 keys in every gradient variant), not another
    bug."""
    # the replay of a saved search example (results/search, Tk = 17) catches it too, across a block as well
    failures = [f for f in quick_report(name).failures() if f.case != "check_search_regressions_still_pass"]
    assert {f.case for f in failures} == catching
    assert all(f.params.get("tk", 65) == 65 for f in failures), [f.params for f in failures]
    mutant = dataclasses.replace(BY_NAME[name], loaded=one_block)
    passing = mha_harness.check(MutantBackend(mutant, weights=False), include_slow=False)
    assert not passing.failures() and not [r for r in passing.results if r.status == "error"], \
        [f.message[:120] for f in passing.failures()]


def test_every_variant_of_the_causal_jacobian_case_catches_a_backward_that_ignores_the_mask():
    """Each alignment and shape on its own, not only the case as a whole: the bottom-right 5 x 65 variant checked
    no query at all (its queries see keys 60..64, the fixed cuts were 0 and 32) and passed a stranger's Flax
    backward that dropped the causal mask."""
    report = mha_harness.check(MutantBackend(BY_NAME["mutant-gradient-flows-to-future"]),
                               cases=["check_causal_jacobian_zero_for_future_inputs"], include_slow=False)
    shapes = {(r.params["alignment"], r.params["variant"]): r for r in report.results}
    assert ("bottom-right", "more_keys") in shapes and len(shapes) >= 4, sorted(shapes)
    for (alignment, variant), result in shapes.items():
        assert result.status == "failed" and "causal leak in gradients" in result.message, (alignment, variant,
                                                                                            result.message)
    assert "d(output row 0, which may see keys <= 60)" in shapes[("bottom-right", "more_keys")].message


class _ValueGradientFromUntransposedWeights(zoo._HandWrittenBackward):
    """A hand-written backward whose dV is P @ dO where P^T @ dO belongs (defined for square calls only): its forward
    and causal mask are right, yet the value gradients of early rows reach later positions."""

    def value_gradient(self, p, d_o):
        if p.shape[-1] != p.shape[-2]:
            raise mha_harness.Unsupported("square calls only")
        return p @ d_o


def test_the_causal_jacobian_case_tells_a_backward_that_ignores_the_mask_from_a_bug_in_the_value_path():
    """Both make a gradient depend on the future; the failure says which is which. The mutant whose backward drops the
    causal mask is named so; a dV computed from P instead of P^T (a stranger took it for a mask bug from the old
    message alone) is placed in the value path, with the gradients it leaves right listed."""
    def messages(mutant):
        report = mha_harness.check(MutantBackend(mutant), cases=["check_causal_jacobian_zero_for_future_inputs"],
                                   include_slow=False, isolate=False)
        return [r.message for r in report.results if r.status == "failed"]

    masked = messages(BY_NAME["mutant-gradient-flows-to-future"])
    assert masked and all("causal leak in gradients" in m and "ignores the causal mask" in m for m in masked), masked
    transposed = messages(dataclasses.replace(BY_NAME["mutant-gradient-no-softmax-row-term"],
                                              loaded=_ValueGradientFromUntransposedWeights))
    assert transposed, "the untransposed dV passed the causal Jacobian case"
    for message in transposed:
        assert "causal leak in gradients" in message and "wrong gradients: value, W_v" in message, message
        assert "the value path" in message and "ignores the causal mask" not in message, message


def test_a_running_maximum_started_at_zero_is_caught_only_where_every_score_is_far_below_zero():
    """A tiled kernel whose running row maximum starts at 0 is right on every other case (each of their rows has a
    score above the underflow point); the large-logits case's negative rows (every score near -1000) catch it and
    say what to fix."""
    name = "mutant-tiled-running-max-from-zero"
    failures = [f for f in quick_report(name).failures() if f.case != "check_search_regressions_still_pass"]
    assert {f.case for f in failures} == {"check_large_logits_stay_finite_and_correct"}
    assert {f.params["variant"] for f in failures} == {"negative_rows", "negative_rows_after_padded_keys"}
    assert all("running maximum must start at -inf" in f.message for f in failures), failures[0].message


class _MaskAddedAfterSoftmax(zoo.NumpyNaiveLoaded):
    """Adds its masks (-inf where a key is masked) to the softmax's weights instead of its scores, as a stranger's
    copy did: every row with a masked key holds -inf, whatever the logits."""

    def masked_softmax(self, scores, allowed, additive):
        weights = self.softmax(scores)
        if additive is not None:
            weights += additive.astype(self.dtype)
        if allowed is not None:
            weights[np.broadcast_to(~allowed, weights.shape)] = -np.inf
        return weights


def test_non_finite_output_with_ordinary_logits_too_gets_no_max_subtraction_advice():
    """The large-logits case blames the softmax's max subtraction only when the same call with ordinary logits is
    right: a mask added after the softmax is NaN with any logits, and is sent to the other cases' failures."""
    mutant = dataclasses.replace(BY_NAME["mutant-padding-ignored"], loaded=_MaskAddedAfterSoftmax)
    report = mha_harness.check(MutantBackend(mutant, weights=False),
                               cases=["check_large_logits_stay_finite_and_correct"], isolate=False)
    failures = report.failures()
    assert [f.params["variant"] for f in failures] == ["negative_rows_after_padded_keys"], failures
    message = failures[0].message
    assert "non-finite entries" in message and "not a large-logit problem" in message, message
    assert "maximum" not in message, message


class _MaskAddedThenMaxTaken(zoo.NumpyNaiveLoaded):
    """Adds -inf to the masked scores, takes each row's maximum, then keeps the visible keys' exps with a where and
    zeroes a row whose sum is not positive (a stranger's JAX layer): NaN + -inf is NaN, so a NaN key makes the
    maximum NaN and the row zeros, finite and wrong; finite values leave it right."""

    def masked_softmax(self, scores, allowed, additive):
        if additive is not None:
            scores = scores + additive.astype(self.dtype)
        if allowed is not None:
            scores = scores + np.where(allowed, 0, -np.inf).astype(self.dtype)
        top = scores.max(axis=-1, keepdims=True)
        e = np.exp(scores - top) if allowed is None else np.where(allowed, np.exp(scores - top), 0)
        total = e.sum(axis=-1, keepdims=True)
        return np.where(total > 0, e / np.where(total > 0, total, 1), 0)


def test_poison_that_changes_outputs_to_finite_values_is_not_called_0_times_nan():
    """0 * NaN in P @ V leaves NaN; finite wrong outputs under NaN keys mean the poison entered a reduction before
    the mask, which the message says, instead of "not a leak" and the masked_poison declaration."""
    mutant = dataclasses.replace(BY_NAME["mutant-padding-ignored"], loaded=_MaskAddedThenMaxTaken)
    report = mha_harness.check(MutantBackend(mutant, weights=False),
                               cases=["check_padding_mask_blocks_padded_keys"], isolate=False)
    failed = {f.params["poison"]: f.message for f in report.failures()}
    assert set(failed) == {"nan", "inf"}, failed
    assert all("the changed outputs are finite" in m and "before any reduction" in m and "not a leak" not in m
               for m in failed.values()), failed


class _SoftmaxInHalfPrecision(zoo.NumpyNaiveLoaded):
    def softmax(self, scores):  # the weights rounded to float16, whatever the call's dtype
        return super().softmax(scores).astype(np.float16).astype(self.dtype)


def test_a_float32_error_of_half_precision_size_says_so_and_a_wrong_scale_does_not():
    mutant = dataclasses.replace(BY_NAME["mutant-padding-ignored"], loaded=_SoftmaxInHalfPrecision)
    failures = mha_harness.check(MutantBackend(mutant, weights=False), cases=["check_output_matches_reference"],
                                 isolate=False).failures()
    assert failures and all("the float32 call may compute in float16 or bfloat16 somewhere" in f.message
                            for f in failures), [f.message for f in failures][:1]
    scale = quick_report("mutant-scale-sqrt-d-model", cases=("check_output_matches_reference",)).failures()
    assert scale and not [f.message for f in scale if "half precision's size" in f.message]


class _CausalKeyRangeOneShort(zoo._TiledLoaded):
    """A tiled kernel whose causal key range stops one key short of each query block's last query (a stranger's
    bound): with 16-key blocks only a query block starting at a block boundary past the last key block misses its
    own key."""

    def key_limit(self, inputs, q1):
        return super().key_limit(inputs, q1) - 1 if inputs.causal else inputs.tk


def test_rows_failing_only_at_a_block_boundary_say_so():
    mutant = dataclasses.replace(BY_NAME["mutant-tiled-running-max-from-zero"], loaded=_CausalKeyRangeOneShort)
    report = mha_harness.check(MutantBackend(mutant, weights=False), cases=["check_causal_output_matches_reference"],
                               isolate=False)
    square = [f.message for f in report.failures() if f.params["variant"] == "square"]
    assert square and all("(batch:position 0:64, 1:64); every row outside it is the first of a 64-row block" in m
                          for m in square), square[:1]


class _MaskedBlockLeavesZero(zoo._TiledLoaded):
    """A tiled kernel right on rows of negative scores that leaves a finite placeholder (0) as the running maximum
    when a row's first key block has no visible key (here: the first 16 keys padded), as a stranger's kernel did."""

    def attend(self, inputs, need_weights):
        padded = inputs.key_padding_mask
        self.initial_max = 0.0 if padded is not None and padded[:, :self.block_k].all() else float("-inf")
        return super().attend(inputs, need_weights)


def test_a_key_block_with_no_visible_key_must_leave_the_running_maximum_at_minus_inf():
    """Only the negative rows after 200 padded keys catch a kernel whose all-masked block leaves a finite running
    maximum: the rows of negative scores without padding pass."""
    mutant = dataclasses.replace(BY_NAME["mutant-tiled-running-max-from-zero"], loaded=_MaskedBlockLeavesZero)
    report = mha_harness.check(MutantBackend(mutant, weights=False),
                               cases=["check_large_logits_stay_finite_and_correct"])
    assert {r.params["variant"] for r in report.failures()} == {"negative_rows_after_padded_keys"}
    assert "a key block with no visible key must leave it at -inf" in report.failures()[0].message


def test_the_mutation_score_of_the_cases_asked_for_says_so_and_shows_progress(tmp_path):
    """``check --mutants --case X`` scores the zoo against those cases alone (a case author's question: which bugs
    does my case catch?), prints a progress line every 16 mutants and names the cases in the score; an outside user
    waited 300 s on a silent run and could not tell whether --case was honoured."""
    import json

    from tests.conftest import run_cli
    out = run_cli("check", "--backend", "numpy-naive", "--case", "check_scores_scaled_by_sqrt_d_head", "--mutants",
                  "--no-isolate", "--results", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    total = len(MUTANTS)
    assert f"  mutants: 16/{total} run, " in out.stdout and f"  mutants: {total}/{total} run, " in out.stdout
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    m = doc["mutation"]
    assert m["cases"] == ["check_scores_scaled_by_sqrt_d_head"] and m["total"] == total
    assert {r["name"] for r in m["mutants"] if r["caught_by"]} >= {"mutant-no-scale", "mutant-scale-sqrt-d-model"}
    assert all(set(r["caught_by"]) <= {"check_scores_scaled_by_sqrt_d_head"} for r in m["mutants"])
    assert (f"mutation score: {m['caught']}/{total} mutants caught by the cases asked for "
            "(check_scores_scaled_by_sqrt_d_head)") in out.stdout
