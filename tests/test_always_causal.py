"""``Capabilities(always_causal=True)``: a layer that cannot attend without its causal mask (nanoGPT's
CausalSelfAttention) runs every case causally against the causal reference, instead of skipping all but the causal
cases; the cases whose property needs attention without a mask skip naming the capability; a module that declares it
and leaks or drops its mask fails."""
from __future__ import annotations

import collections

import pytest

import mha_harness
from mha_harness.bench.calls import unsupported
from mha_harness.bench.metrics import Shape
from mha_harness.conformance.strategies import SearchSpace
from mha_harness.contract.api import implicitly_causal
from mha_harness.contract.params import make_inputs, make_params
from tests.always_causal_objects import (
    GPTCausalSelfAttention,
    GPTCausalSelfAttentionReversedMask,
    GPTCausalSelfAttentionSeesNextToken,
    GPTCausalSelfAttentionSplitTokens,
    GPTCausalSelfAttentionWithoutMask,
    GPTFunction,
    NaiveAlwaysBottomRight,
    NaiveAlwaysTopLeft,
    NaiveDecodeKernel,
)

#: the cases whose property holds only without a causal mask
NON_CAUSAL_CASES = {"check_self_attention_is_permutation_equivariant",
                    "check_cross_attention_is_invariant_to_key_order", "check_lesson_worked_example_head_weights"}


def _check(backend):
    return mha_harness.check(backend, include_slow=False)


def _statuses(report):
    return collections.Counter(r.status.value for r in report.results)


def test_always_causal_without_an_alignment_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match=r"always_causal: got True with causal_alignments=\(\).*accepted"):
        mha_harness.Capabilities(always_causal=True, causal_alignments=())
    with pytest.raises(TypeError, match="always_causal"):
        mha_harness.Capabilities(always_causal="yes")


def test_inputs_made_inside_implicitly_causal_take_its_alignment_and_explicit_ones_stay():
    config = mha_harness.AttentionConfig(8, 2)
    assert make_inputs(config, 1, 3).causal is None
    with implicitly_causal("bottom-right"):
        made = make_inputs(config, 1, 3, 5)
        assert made.causal == "bottom-right"
        assert made.replace(key_padding_mask=None).causal == "bottom-right"
        assert make_inputs(config, 1, 3, causal="top-left").causal == "top-left"
        with implicitly_causal(None):
            assert make_inputs(config, 1, 3).causal is None
    assert make_inputs(config, 1, 3).causal is None
    with pytest.raises(ValueError, match="alignment: got 'diagonal'; accepted: None, 'top-left' or 'bottom-right'"):
        with implicitly_causal("diagonal"):
            pass


def test_an_always_causal_layer_refuses_a_call_without_causal_naming_the_parameter():
    params = make_params(mha_harness.AttentionConfig(8, 2), seed=1)
    loaded = GPTCausalSelfAttention().load(params, dtype="float64")
    x = make_inputs(params.config, 1, 4).query
    with pytest.raises(mha_harness.Unsupported, match=r"causal: got None; accepted: 'top-left' or 'bottom-right' "
                                                      r"\(the backend declares always_causal=True"):
        loaded.forward(mha_harness.AttentionInputs(x, x, x))
    assert loaded.forward(mha_harness.AttentionInputs(x, x, x, causal="top-left")).output.shape == (1, 4, 8)


def test_a_nanogpt_style_module_runs_every_case_causally_and_skips_only_what_it_lacks():
    report = _check(GPTCausalSelfAttention())
    assert report.ok, "\n".join(report.summary_lines())
    counts = _statuses(report)
    assert counts["passed"] >= 25  # was 5 (the causal cases only) before the capability, with 40 skips
    ran = {r.case for r in report.results if r.status.value == "passed"}
    assert {"check_output_matches_reference", "check_scores_scaled_by_sqrt_d_head", "check_heads_are_separated",
            "check_output_projection_mixes_heads", "check_batch_items_are_independent",
            "check_parameter_count_is_4_d_model_squared", "check_causal_mask_blocks_future_keys"} <= ran
    grid_skips = {r.params["variant"]: r.message for r in report.results
                  if r.case == "check_output_matches_reference" and r.status.value == "skipped"}
    assert set(grid_skips) == {"more_keys", "long_keys_with_bias", "single_key", "grouped_query",
                               "grouped_query_more_keys", "multi_query", "qk_norm_per_head", "qk_norm_over_projection",
                               "qk_layer_norm_per_head", "qk_layer_norm_no_bias_per_head", "rotary_half_split",
                               "rotary_interleaved", "rotary_more_keys", "rotary_other_base", "rotary_qk_norm_per_head",
                               "rotary_partial", "rotary_scaled_llama3", "rotary_scaled_linear",
                               "rotary_scaled_yarn"}
    assert "does not declare qk_norms 'rms_over_projection'" in grid_skips["qk_norm_over_projection"]
    assert "declares inputs='self' (one x): Tq = 7 != Tk = 64" in grid_skips["more_keys"]
    assert "does not declare capability 'grouped_query'" in grid_skips["multi_query"]
    for r in report.results:
        if r.status.value != "skipped":
            continue
        if r.case in NON_CAUSAL_CASES:
            assert "declares always_causal=True; the property holds only without a causal mask" in r.message
        else:  # every other skip names something the module does not declare (or no saved search regression)
            assert "declare" in r.message or "no search regression" in r.message, (r.case, r.message)


@pytest.mark.parametrize("backend, diagnosis", [
    (GPTCausalSelfAttentionSeesNextToken(), "a causal mask one key too wide (query i also sees key i + 1)"),
    (GPTCausalSelfAttentionWithoutMask(), "attention without a causal mask: the mask is not applied"),
    (GPTCausalSelfAttentionReversedMask(), "a reversed causal mask: query i sees key i and every later key"),
])
def test_an_always_causal_module_with_a_broken_mask_fails_with_the_diagnosis(backend, diagnosis):
    report = _check(backend)
    assert not report.ok
    failed = {r.case: r.message for r in report.results if r.status.value == "failed"}
    assert "top-left causal leak" in failed["check_causal_mask_blocks_future_keys"]
    assert diagnosis in failed["check_causal_output_matches_reference"]
    # the grid too: every case compares with the causal reference, and the grid names the mask mistake as well
    assert diagnosis in failed["check_output_matches_reference"]
    # the large-logit case does not blame the softmax for a bug that is there at ordinary logits too
    assert "also wrong with ordinary logits" in failed["check_large_logits_stay_finite_and_correct"]
    assert "softmax must subtract" not in failed["check_large_logits_stay_finite_and_correct"]


def test_function_backend_always_causal_calls_the_function_without_a_causal_argument():
    assert GPTFunction.capabilities.always_causal and GPTFunction.capabilities.causal_alignments == ("top-left",)
    report = _check(GPTFunction)
    assert report.ok, "\n".join(report.summary_lines())
    assert _statuses(report)["passed"] >= 15
    with pytest.raises(ValueError, match="causal: got 'sometimes'; accepted: False, True .* or 'always'"):
        mha_harness.function_backend(lambda *a: None, name="x", inputs="self", causal="sometimes")


@pytest.mark.parametrize("backend", [NaiveAlwaysTopLeft(), NaiveAlwaysBottomRight()])
def test_every_case_call_of_a_full_featured_always_causal_backend_is_causal_in_its_alignment(backend):
    """The backend raises on any call not causal in its alignment (masks, weights, Tq != Tk, the fully masked rows
    of bottom-right at Tq > Tk included): every case variant that runs must pass, none may error."""
    report = _check(backend)
    assert report.ok, "\n".join(report.summary_lines())
    counts = _statuses(report)
    assert counts["passed"] >= 70 and not counts["error"] and not counts["failed"]
    assert {r.case for r in report.results if "always_causal" in r.message} == NON_CAUSAL_CASES


def test_search_and_bench_never_ask_an_always_causal_backend_for_full_attention():
    backend = NaiveAlwaysBottomRight()
    assert SearchSpace.for_backend(backend).causal == ("bottom-right",)
    assert None in SearchSpace.for_backend(mha_harness.registry.load_registry().get("numpy-naive").backend).causal
    full = Shape(1, 16, 16, 32, 4, "float32", False, False)
    decode = Shape(1, 1, 16, 32, 4, "float32", True, False)
    assert "always_causal" in unsupported(backend, full)
    assert unsupported(backend, decode) is None
    assert backend.capabilities.has("causal:bottom-right") and not backend.capabilities.has("non_causal")


def test_a_decode_kernel_declaring_tq_at_most_tk_gets_no_call_with_more_queries_than_keys():
    """``more_queries_than_keys=False`` (a KV-cache decode kernel): every variant with Tq > Tk skips naming it, from
    the declaration (the backend raises on such a call, and nothing errors), and search never draws one."""
    backend = NaiveDecodeKernel()
    report = _check(backend)
    assert report.ok, "\n".join(report.summary_lines())
    assert not _statuses(report)["error"] and _statuses(report)["passed"] >= 60
    skipped = [r for r in report.results if "more_queries_than_keys" in r.message]
    assert {r.case for r in skipped} >= {"check_output_matches_reference", "check_causal_output_matches_reference",
                                         "check_causal_mask_blocks_future_keys"}
    assert all(r.status.value == "skipped" for r in skipped)
    config = mha_harness.AttentionConfig(8, 2)
    assert {"cross_attention", "more_queries_than_keys"} <= make_inputs(config, 1, 3, 2).features()
    assert "more_queries_than_keys" not in make_inputs(config, 1, 2, 3).features()
    space = SearchSpace.for_backend(backend)
    assert not space.more_queries_than_keys
    from hypothesis import given, settings

    from mha_harness.conformance.strategies import examples

    @settings(max_examples=60, database=None, deadline=None)
    @given(examples(space))
    def never_more_queries(example):
        assert example["tq"] <= example["tk"]
    never_more_queries()


def test_an_always_causal_module_splitting_tokens_is_named_by_the_head_and_grid_cases():
    """The head-split diagnosis compares with the split applied to the causal call the module got (a stranger's
    GPT-2 copy with view(B, h, T, d_head) failed without it: the diagnosis had compared with an unmasked split)."""
    failed = {r.case: r.message for r in _check(GPTCausalSelfAttentionSplitTokens()).results
              if r.status.value == "failed"}
    named = "the 'split tokens instead of features' mistake"
    assert named in failed["check_head_split_keeps_features_together"]
    assert named in failed["check_output_matches_reference"]
    assert named in failed["check_causal_output_matches_reference"]


def test_bench_of_an_always_causal_backend_at_causal_off_exits_1_saying_to_pass_causal_on(tmp_path):
    """Every point of a backend asked for by name skipped ("always causal" at the default --causal off): the run
    measured nothing of it, which is a failure naming the fix, not an exit 0."""
    import os
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "mha_harness", "bench", "--backend-spec",
                           "tests.always_causal_objects:NaiveAlwaysTopLeft", "--seq-lens", "32", "--budget", "0.1",
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no point measured" in done.stderr and "pass --causal on" in done.stderr
