"""onnxruntime-cpu: the exact reason when onnx/onnxruntime is missing or cannot run the operator, masks in the ONNX
Attention operator's convention, one cached session per graph structure, no gradients. Its correctness against the
reference is the conformance suite's (tests/test_conformance_all.py checks every available backend)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.implementations import ort_attention
from mha_harness.registry import load_registry


def test_registered_as_a_built_in():
    entry = load_registry(entry_points=False).get("onnxruntime-cpu")
    assert entry.source == "built-in mha_harness.implementations.ort_attention:backends"


@pytest.mark.parametrize("module", ["onnxruntime", "onnx"])
def test_a_missing_package_is_the_reason_with_the_install_hint(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    reason = ort_attention.OrtAttention().availability()
    assert reason.startswith(f"{module} is not installed (pip install -c constraints.txt -e '.[onnx]' from the "
                             "mha-harness clone)")


def test_mha_harness_list_says_why_when_onnxruntime_does_not_import():
    code = ("import sys; sys.modules['onnxruntime'] = None\n"
            "from mha_harness.cli import main; sys.exit(main(['list']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = next(row for row in out.stdout.splitlines() if row.startswith("onnxruntime-cpu "))
    assert "unavailable: onnxruntime is not installed (pip install -c constraints.txt -e '.[onnx]'" in line, out.stdout


def test_a_runtime_that_cannot_run_the_operator_says_so(monkeypatch):
    pytest.importorskip("onnxruntime")

    def refuses(key):
        raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : Attention(23) is not a registered function/op")
    ort_attention.operator_reason.cache_clear()
    monkeypatch.setattr(ort_attention, "session", refuses)
    try:
        reason = ort_attention.OrtAttention().availability()
    finally:
        ort_attention.operator_reason.cache_clear()
    assert "cannot run the ONNX Attention operator (opset 23): [ONNXRuntimeError]" in reason


def _inputs(**masks):
    return make_inputs(AttentionConfig(8, 2), batch=2, tq=3, tk=5, **masks)


def test_top_left_causal_is_the_operators_flag_and_nothing_else_is_masked():
    assert ort_attention.native_mask(_inputs(causal="top-left"), np.dtype("float32")) == ("none", None, True)


def test_bottom_right_causal_and_padding_become_one_bool_mask_true_takes_part():
    padding = np.zeros((2, 5), bool)
    padding[1, 4] = True
    kind, mask, is_causal = ort_attention.native_mask(_inputs(causal="bottom-right", key_padding_mask=padding),
                                                      np.dtype("float32"))
    assert (kind, is_causal, mask.dtype, mask.shape) == ("bool", False, np.bool_, (2, 1, 3, 5))
    assert mask[0, 0, 0].tolist() == [True, True, True, False, False]  # query 0 sees keys <= 0 + Tk - Tq
    assert mask[1, 0, 2].tolist() == [True, True, True, True, False]   # the padded key 4 of item 1


def test_an_additive_mask_becomes_one_float_mask_with_minus_inf_where_masked_and_the_query_axis_explicit():
    additive = np.zeros((3, 5))
    additive[0, 1] = 0.5
    additive[2, 0] = -np.inf
    kind, mask, is_causal = ort_attention.native_mask(_inputs(causal="top-left", attn_mask=additive),
                                                      np.dtype("float16"))
    assert (kind, is_causal, mask.dtype, mask.shape) == ("float", True, np.float16, (1, 1, 3, 5))
    assert mask[0, 0, 0, 1] == np.float16(0.5) and np.isneginf(mask[0, 0, 2, 0])


def test_one_session_per_structure_serves_every_parameter_set_and_shape():
    pytest.importorskip("onnxruntime")
    config = AttentionConfig(16, 4, num_kv_heads=2, bias=True)
    backend = ort_attention.OrtAttention()
    first, second = (backend.load(make_params(config, seed=s), dtype="float32") for s in (1, 2))
    key_a, _ = first.feeds(make_inputs(config, batch=1, tq=4, causal="top-left"))
    key_b, _ = second.feeds(make_inputs(config, batch=3, tq=9, tk=7, causal="top-left"))
    assert key_a == key_b
    before = ort_attention.session.cache_info()
    first.forward(make_inputs(config, batch=1, tq=4, causal="top-left"))
    second.forward(make_inputs(config, batch=3, tq=9, tk=7, causal="top-left"))
    after = ort_attention.session.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 1


def test_parameters_are_the_graphs_weight_inputs_with_grouped_query_widths():
    pytest.importorskip("onnx")
    shapes = ort_attention.OrtAttention().native_parameter_shapes(AttentionConfig(16, 4, num_kv_heads=1, bias=True))
    assert shapes == {"W_q": (16, 16), "W_k": (16, 4), "W_v": (16, 4), "W_o": (16, 16),
                      "b_q": (16,), "b_k": (4,), "b_v": (4,), "b_o": (16,)}


def test_no_gradients_declared_and_no_backward_callable():
    pytest.importorskip("onnxruntime")
    backend = ort_attention.OrtAttention()
    assert backend.capabilities.gradients is False and "bfloat16" not in backend.capabilities.dtypes
    loaded = backend.load(make_params(AttentionConfig(8, 2)), dtype="float32")
    with pytest.raises(NotImplementedError, match="computes no gradients"):
        loaded.prepare(make_inputs(AttentionConfig(8, 2), batch=1, tq=3), backward=True)


def test_float64_loses_only_the_scale_rounded_to_float32():
    """The declared precision:float32 of float64 is the operator's float32 scale: the error is far above float64
    rounding and far below float32's; the conformance suite verifies the declaration against the float32 bound."""
    pytest.importorskip("onnxruntime")
    config = AttentionConfig(64, 2)
    params, inputs = make_params(config), make_inputs(config, batch=1, tq=64)
    got = ort_attention.OrtAttention().load(params, dtype="float64").forward(inputs).output
    error = np.abs(got - mha_harness.reference_attention(params, inputs).output).max()
    assert 1e-12 < error < 1e-6


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("tq, kv_heads", [(1, 8), (16, 2)])
def test_the_decode_step_attends_over_the_operators_own_cache_and_matches_the_reference(dtype, tq, kv_heads):
    """A fill graph projects the cached positions into past_key/past_value once; each step's Attention appends
    x_new's keys and values (present_key/present_value) and attends over all Tk under bottom-right causal masking:
    its output, checked the way bench checks a decode point, is within the conformance bound on every call."""
    from mha_harness.bench.calls import prepare_point
    from mha_harness.bench.metrics import Shape
    from mha_harness.bench.verify import check_point
    backend = load_registry(entry_points=False).get("onnxruntime-cpu").backend
    if backend.availability():
        pytest.skip(backend.availability())
    shape = Shape(1, tq, 256, 64, 8, dtype, True, False, num_kv_heads=kv_heads, cached=True)
    point = prepare_point(backend, shape)
    for _ in range(2):  # every step writes the same slots: the same output each call
        record = check_point(backend, shape, point.checked_values(point.fn()))
        assert record["rows"] == tq and record["max_error"] <= record["bound"]
    present = ort_attention.session(point.loaded.graph_key("bool", False, "step")).get_outputs()
    assert [o.name for o in present] == ["output", "present_key", "present_value"]
