"""Input forms as a capability: separate query/key/value, shared K/V (x_q, x_kv) and one x (self-attention).
Cases run in the backend's form; a self-attention module without its causal mask is caught by --quick."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mha_harness
from mha_harness.conformance.casekit import all_cases
from tests.conftest import run_cli
from tests.form_objects import (
    LessonSelf,
    LessonSelfNoMask,
    LessonSharedKV,
    SelfAttentionModule,
    SelfAttentionModuleNoMask,
    multi_head_attention,
)


def test_unknown_form_is_refused_naming_inputs_and_the_accepted_values():
    with pytest.raises(ValueError, match=r"inputs: got 'qkv'; accepted: 'separate', 'shared_kv', 'self'"):
        mha_harness.Capabilities(inputs="qkv")


def test_self_form_implies_no_cross_attention():
    assert mha_harness.Capabilities(inputs="self").cross_attention is False
    assert mha_harness.Capabilities(inputs="self").has("inputs:self")
    assert not mha_harness.Capabilities(inputs="self").has("inputs:separate")
    assert mha_harness.Capabilities(inputs="shared_kv").has("inputs:self")
    assert mha_harness.Capabilities().has("inputs:shared_kv")


def test_inputs_carry_their_form_by_identity():
    x, y = np.zeros((1, 2, 4)), np.ones((1, 2, 4))
    assert mha_harness.AttentionInputs(x, x, x).form == "self"
    assert mha_harness.AttentionInputs(y, x, x).form == "shared_kv"
    assert mha_harness.AttentionInputs(x, x, y).form == "separate"


def test_validation_refuses_a_form_the_backend_did_not_declare():
    params = mha_harness.make_params(mha_harness.AttentionConfig(8, 2))
    loaded = SelfAttentionModule().load(params, dtype="float64")
    x = np.random.default_rng(0).standard_normal((1, 3, 8))
    with pytest.raises(ValueError, match=r"inputs: got the separate form but the backend declares inputs='self'"):
        loaded.forward(mha_harness.AttentionInputs(x, x.copy(), x.copy()))
    shared = LessonSharedKV.load(params, dtype="float64")
    with pytest.raises(ValueError, match=r"inputs: .*accepted: x_q and one x_kv"):
        shared.forward(mha_harness.AttentionInputs(x, x.copy(), x.copy() + 1))
    assert shared.forward(mha_harness.AttentionInputs(x, x, x)).output.shape == (1, 3, 8)


def test_function_backend_reads_the_form_from_the_signature():
    assert LessonSelf.capabilities.inputs == "self"
    assert LessonSharedKV.capabilities.inputs == "shared_kv"
    from tests.plugin_objects import LessonFunction
    assert LessonFunction.capabilities.inputs == "separate"
    with pytest.raises(ValueError, match="inputs: fn takes 2 required positional parameters"):
        mha_harness.function_backend(lambda a, b: a, name="two")
    with pytest.raises(ValueError, match="inputs: got 'x'"):
        mha_harness.function_backend(multi_head_attention, name="bad", inputs="x")


def test_lesson_example_through_the_self_form_function_gives_the_printed_weights_output():
    """The lesson's own call, multi_head_attention(X, W_q, W_k, W_v, W_o, h), equals the reference."""
    from mha_harness.cases.golden import lesson_example
    params, inputs = lesson_example()
    out = multi_head_attention(inputs.query[0], params.W_q, params.W_k, params.W_v, params.W_o, 2)
    assert np.allclose(out, mha_harness.reference_attention(params, inputs).output[0])


def _form_skips(report):
    return [r for r in report.results if r.status == "skipped" and ("inputs=" in r.message or "form" in r.message)]


@pytest.mark.parametrize("backend", [LessonSelf, LessonSharedKV, SelfAttentionModule()], ids=lambda b: b.name)
def test_correct_self_and_shared_kv_modules_pass_with_no_skip_due_to_their_form(backend):
    report = mha_harness.check(backend, include_slow=False)
    assert report.ok, [(r.case, r.message[:150]) for r in report.results if r.status not in ("passed", "skipped")]
    # the only form skips: a property defined only for keys that move apart from the queries (cross-attention),
    # and, with one x, the grid rows with Tq != Tk (each a skip naming the form)
    grid_rows = [r for r in _form_skips(report) if r.case == "check_output_matches_reference"]
    assert all(r.params["seq"] != r.params["tk"] and "inputs='self'" in r.message for r in grid_rows)
    others = {r.case for r in _form_skips(report) if r not in grid_rows}
    assert others <= {"check_cross_attention_is_invariant_to_key_order",
                      "check_decode_step_over_filled_cache_matches_reference"}  # a decode step has x_new and x_kv
    if backend.capabilities.inputs == "shared_kv":
        assert not _form_skips(report)
    forms = {r.params.get("form") for r in report.results}
    assert forms == {backend.capabilities.inputs}
    ran = {r.case for r in report.results if r.status == "passed"}
    assert {"check_causal_mask_blocks_future_keys", "check_causal_output_matches_reference",
            "check_scores_scaled_by_sqrt_d_head", "check_heads_are_separated", "check_output_projection_mixes_heads",
            "check_output_matches_reference", "check_large_logits_stay_finite_and_correct",
            "check_batch_items_are_independent", "check_bad_input_raises_clear_error"} <= ran


@pytest.mark.parametrize("spec", ["tests.form_objects:LessonSelfNoMask",
                                  "tests.form_objects:SelfAttentionModuleNoMask"])
def test_self_attention_without_its_causal_mask_fails_quick_check_naming_causal_leakage(spec, tmp_path):
    out = run_cli("check", "--backend-spec", spec, "--quick", "--results", tmp_path, "--jobs", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    leaks = [r for r in doc["results"]
             if r["status"] == "failed" and r["case"] == "check_causal_mask_blocks_future_keys"]
    assert leaks and all("causal leak" in r["message"] for r in leaks), [r["message"] for r in leaks]
    assert all(r["params"]["form"] == "self" for r in doc["results"] if "form" in r["params"])


def test_self_attention_module_without_mask_is_caught_in_process_too():
    for backend in (LessonSelfNoMask, SelfAttentionModuleNoMask()):
        report = mha_harness.check(backend, cases=["check_causal_mask_blocks_future_keys"])
        assert report.failures() and "causal leak" in report.failures()[0].message


def test_every_case_declares_the_forms_it_is_defined_for():
    cross_only = {n for n, c in all_cases().items() if "self" not in c.forms}
    assert cross_only == {"check_cross_attention_is_invariant_to_key_order",
                          "check_decode_step_over_filled_cache_matches_reference"}


def test_cross_attention_only_case_skips_naming_the_form():
    report = mha_harness.check(LessonSelf, cases=["check_cross_attention_is_invariant_to_key_order"])
    (result,) = report.results
    assert result.status == "skipped" and "inputs='self'" in result.message and "one x" in result.message


def test_report_counts_skips_due_to_the_input_form_per_backend():
    report = mha_harness.check(LessonSelf, cases=["check_cross_attention_is_invariant_to_key_order",
                                                  "check_heads_are_separated"])
    assert report.form_of("lesson-self") == "self" and report.form_skips("lesson-self") == 1
    assert report.to_json()["input_forms"]["lesson-self"] == {"form": "self", "skipped_for_form": 1}
    row = next(line for line in report.to_markdown().splitlines() if line.startswith("| lesson-self | self |"))
    assert row.rstrip(" |").endswith("1")
    assert "1 skipped: not defined for inputs='self'" in "\n".join(report.summary_lines())
    # the grid rows with Tq != Tk are skipped for the form too, and counted so (a stranger's summary said 1 while
    # conformance.md listed 4 skips naming the form)
    grid = mha_harness.check(LessonSelf, cases=["check_output_matches_reference"], include_slow=False)
    for_form = [r for r in grid.results if r.status == "skipped" and "inputs='self'" in r.message]
    assert for_form and grid.form_skips("lesson-self") == len(for_form)


class _LeakyGradientLoaded(mha_harness.LoadedAttention):
    """The reference layer whose input gradients reach every position (the backward ignores the causal mask)."""

    def __init__(self, params):
        self.params = params

    def compute(self, inputs, *, need_weights=False):
        return mha_harness.AttentionOutput(mha_harness.reference_attention(self.params, inputs).output)

    def compute_vjp(self, inputs, cotangent):
        grads = mha_harness.reference_vjp(self.params, inputs, cotangent)
        return {k: (v + 1.0 if k in ("query", "key", "value") else v) for k, v in grads.items()}


@pytest.mark.parametrize("form, shown", [("self", "/dx at position"), ("shared_kv", "/dx_kv at position"),
                                         ("separate", "/dkey at position")])
def test_a_gradient_leak_names_the_input_by_its_form(form, shown):
    """d(...)/dx for one x, d(...)/dx_kv for shared K/V: never /dquery for an input the module has not got."""
    backend = type("LeakyGradient", (mha_harness.AttentionBackend,), {
        "name": f"leaky-gradient-{form}",
        "capabilities": mha_harness.Capabilities(inputs=form, gradients=True, causal_alignments=("top-left",)),
        "load_native": lambda self, params, dtype: _LeakyGradientLoaded(params)})()
    report = mha_harness.check(backend, cases=["check_causal_jacobian_zero_for_future_inputs"])
    failed = report.failures()
    assert failed and all("causal leak in gradients" in r.message and shown in r.message for r in failed), \
        [r.message for r in report.results]
    if form != "separate":
        assert not any("/dquery" in r.message or "/dkey" in r.message for r in failed)


def test_parametrize_with_cases_is_in_the_namespace():
    assert "parametrize_with_cases" in dir(mha_harness) and "parametrize_with_cases" in mha_harness.__all__
    assert callable(mha_harness.parametrize_with_cases)
