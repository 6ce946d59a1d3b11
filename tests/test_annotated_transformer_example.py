"""examples/annotated_transformer_plugin: the worked separate-form torch example of docs/plugins.md is the file; the
Annotated Transformer's MultiHeadedAttention, wrapped as it is, passes every case it declares with its two
divergences verified (a finite -1e9 mask value, a dense P @ V); and the bugs the docs quote fail with the diagnoses
they quote: the module's masked_fill without its assignment, and the wrapper's weight gradients left in nn.Linear's
(out, in) layout."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import mha_harness
from tests.example_modules import module_from_file, shown_in_plugins_docs

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "annotated_transformer_plugin" / "annotated_attention" / "__init__.py"


def _variant(path: Path, name: str, old: str, new: str):
    """The example with one line changed, as a module of its own."""
    text = EXAMPLE.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return module_from_file(path, name)


def test_the_docs_show_the_example_file_verbatim():
    assert shown_in_plugins_docs("annotated-example") == EXAMPLE.read_text()


@pytest.fixture(scope="module")
def quick_report():
    backend = module_from_file(EXAMPLE, "annotated_attention").AnnotatedAttention()
    return mha_harness.check(backend, include_slow=False, isolate=False)


def test_the_module_passes_every_case_it_declares_with_its_divergences_verified(quick_report):
    assert quick_report.ok, "\n".join(quick_report.summary_lines())
    by_status = {}
    for r in quick_report.results:
        by_status.setdefault(r.status.value, set()).add(r.case)
    assert "error" not in by_status and "failed" not in by_status and "unexpected-pass" not in by_status
    assert by_status["passed"] >= {
        "check_gradients_match_reference", "check_causal_jacobian_zero_for_future_inputs",
        "check_padding_mask_blocks_padded_keys", "check_causal_mask_blocks_future_keys",
        "check_bool_attn_mask_matches_reference", "check_attention_weights_match_reference",
        "check_parameter_count_is_4_d_model_squared", "check_output_matches_reference"}
    # the finite -1e9 (rows with no key to attend: the average of V) and the dense P @ V (0 * NaN), each verified
    assert by_status["expected-divergence"] >= {"check_fully_masked_rows_output_zeros",
                                                "check_padding_mask_blocks_padded_keys",
                                                "check_causal_mask_blocks_future_keys"}


def test_a_per_head_mask_and_a_bias_free_count_skip_with_the_modules_reason(quick_report):
    reasons = {r.message for r in quick_report.results if r.status.value == "skipped"}
    assert "the module's mask is the same for every head (no per-head mask)" in reasons
    assert "nn.Linear(d_model, d_model) always allocates a bias" in reasons


def test_masked_fill_without_its_assignment_fails_as_masks_ignored(tmp_path):
    """`scores.masked_fill(...)` returns a new tensor: without `scores = ` every mask is dropped."""
    broken = _variant(tmp_path / "annotated_unassigned.py", "annotated_unassigned",
                      "scores = scores.masked_fill(mask == 0, -1e9)", "scores.masked_fill(mask == 0, -1e9)")
    report = mha_harness.check(broken.AnnotatedAttention(), include_slow=False, isolate=False,
                               cases=["check_padding_mask_output_matches_reference",
                                      "check_causal_mask_blocks_future_keys"])
    failed = {r.case: r.message for r in report.results if r.status.value == "failed"}
    # real rows only: a mask along the query axis looks the same there, and both are named
    assert "the same call without key_padding_mask: the mask is not applied" in \
        failed["check_padding_mask_output_matches_reference"], failed
    assert "causal leak" in failed["check_causal_mask_blocks_future_keys"], failed


def test_weight_gradients_left_in_nn_linears_layout_are_named_transposed(tmp_path):
    broken = _variant(tmp_path / "annotated_untransposed.py", "annotated_untransposed",
                      'grads[f"W_{p}"] = _np(linear.weight.grad, transpose=True)',
                      'grads[f"W_{p}"] = _np(linear.weight.grad)')
    report = mha_harness.check(broken.AnnotatedAttention(), include_slow=False, isolate=False,
                               cases=["check_gradients_match_reference"])
    failures = report.failures()
    assert failures and all("the reference's transposed" in f.message for f in failures), \
        [f.message for f in failures]


def test_the_forward_backward_call_is_checked_by_its_gradients():
    from mha_harness.bench.calls import prepare_point
    from mha_harness.bench.metrics import Shape
    from mha_harness.bench.verify import check_point
    backend = module_from_file(EXAMPLE, "annotated_attention").AnnotatedAttention()
    shape = Shape(1, 32, 32, 64, 4, "float32", True, True)
    point = prepare_point(backend, shape)
    first = check_point(backend, shape, point.checked_values(point.fn()))
    again = check_point(backend, shape, point.checked_values(point.fn()))
    assert {"query", "key", "value", "W_q", "W_k", "W_v", "W_o"} <= set(first["gradients"])
    assert again["max_error"] == first["max_error"] <= first["bound"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_layer_whose_first_dtype_is_bfloat16_gets_its_uniform_rows_verified(dtype):
    """The fully-masked case runs in the layer's first declared dtype and names its rows within that dtype's bound:
    a bfloat16 layer's uniform average of V is one bfloat16 rounding away from the float64 one (a stranger's BERT
    layer there was refused as "other" by a fixed float32-sized bound, 0.0083 from the average)."""
    example = module_from_file(EXAMPLE, "annotated_attention")
    caps = dataclasses.replace(example.AnnotatedAttention.capabilities, dtypes=(dtype,))
    backend = type("FirstDtype", (example.AnnotatedAttention,), {"capabilities": caps})()
    report = mha_harness.check(backend, cases=["check_fully_masked_rows_output_zeros"], include_slow=False,
                               isolate=False)
    assert report.results and {r.status.value for r in report.results} == {"expected-divergence"}, \
        [(r.status.value, r.message) for r in report.results]


def test_the_mask_read_with_its_polarity_flipped_is_named_in_the_causal_and_padding_cases(tmp_path):
    """`masked_fill(mask == 1, ...)` hides the keys a query may attend and shows the others: the causal mask becomes
    its complement (query i sees only the keys after i, the last none: rows the module's -1e9 turns into the
    average of V) and the padding mask its opposite; each case names what it sees (a stranger's BERT copy with its
    extended mask inverted got numbers only from the causal case)."""
    broken = _variant(tmp_path / "annotated_inverted.py", "annotated_inverted",
                      "scores.masked_fill(mask == 0, -1e9)", "scores.masked_fill(mask == 1, -1e9)")
    report = mha_harness.check(broken.AnnotatedAttention(), include_slow=False, isolate=False,
                               cases=["check_causal_output_matches_reference",
                                      "check_padding_mask_output_matches_reference"])
    failed = {}
    for r in report.results:
        if r.status.value == "failed":
            failed.setdefault(r.case, []).append(r.message)
    causal = [m for m in failed["check_causal_output_matches_reference"] if "top-left" in m]
    assert causal and all("the causal mask inverted: query i sees only the keys after i" in m for m in causal), causal
    padding = failed["check_padding_mask_output_matches_reference"]
    # the layer reads its own mask inverted: the message says to fix the layer, not to flip the wrapper's conversion
    assert padding and all("read with the opposite polarity" in m and "not by flipping the wrapper" in m
                           for m in padding), padding
