"""Bench times only calls it has seen compute the layer: before a point is timed, one call's output at a few query
rows is compared with the float64 reference (mha_harness.bench.verify), in the parent for `mha-harness bench` and in
the caller's process for asv and pytest-benchmark (prepared_call). A wrong or missing output is `wrong-output`."""
from __future__ import annotations

import numpy as np
import pytest

from mha_harness.bench.calls import CHECKED_ROWS, checked_rows, prepare_point, prepared_call
from mha_harness.bench.metrics import Shape
from mha_harness.bench.sweep import BenchConfig, BenchPoint, output_check_line, run_bench, table
from mha_harness.bench.verify import WRONG_OUTPUT, WrongOutput, check_output
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.implementations.numpy_tiled import NumpyTiled
from tests.bench_plugins import (
    AccumulatesIntoItsOutputBuffer,
    FastPathForgetsTheCausalMask,
    ReturnsNothingWhenTimed,
    _ComputesFloat64InFloat32,
)
from tests.test_bench import SMALL


def test_checked_rows_are_every_row_of_a_short_call_and_first_last_and_seeded_others_of_a_long_one():
    assert checked_rows(1) == [0] and checked_rows(CHECKED_ROWS) == list(range(CHECKED_ROWS))
    rows = checked_rows(2048)
    assert len(rows) == CHECKED_ROWS and rows == sorted(set(rows)) and rows[0] == 0 and rows[-1] == 2047
    assert rows == checked_rows(2048) and rows != checked_rows(2047)  # seeded by Tq: the same in every process


def test_a_fast_path_that_drops_the_causal_mask_is_reported_wrong_output_and_not_timed(tmp_path):
    """Its compute() is right (conformance passes it); its prepared call attends to future keys. The causal point is
    wrong-output with the reference's figures and the row, never timed; its full-attention point, the same call,
    is measured; numpy-tiled beside it is measured at both, each with its output_check under the bound."""
    doc = run_bench([FastPathForgetsTheCausalMask(), NumpyTiled()], tmp_path, seq_lens=[64], causal="both",
                    config=BenchConfig(**SMALL))
    by = {(p["backend"], p["causal"]): p for p in doc["points"]}
    wrong = by[("bench-fast-path-forgets-causal-mask", True)]
    assert wrong["status"] == WRONG_OUTPUT and not wrong["samples_s"] and wrong["median_s"] is None, wrong
    assert "output differs from the float64 reference" in wrong["skipped"] and "position 0" in wrong["skipped"]
    assert "never prepare()'s call" in wrong["skipped"]  # where to look: check cannot see it
    assert wrong["output_check"] == {"rows": 16, "wrong": wrong["skipped"]}
    assert by[("bench-fast-path-forgets-causal-mask", False)]["status"] == "measured"
    for causal in (False, True):
        ok = by[("numpy-tiled", causal)]
        assert ok["status"] == "measured" and ok["output_check"]["rows"] == 16
        assert 0 <= ok["output_check"]["max_error"] <= ok["output_check"]["bound"]
    assert any("bench-fast-path-forgets-causal-mask" in line and WRONG_OUTPUT in line
               for line in table([BenchPoint(**p) for p in doc["points"]]).splitlines())
    from mha_harness.cli import _bench_problems
    assert any("bench-fast-path-forgets-causal-mask" in line and "mask top-left" in line
               for line in _bench_problems(doc))


def test_a_timed_call_that_returns_nothing_is_told_to_return_the_output(tmp_path):
    doc = run_bench([ReturnsNothingWhenTimed()], None, seq_lens=[32], config=BenchConfig(**SMALL))
    (point,) = doc["points"]
    assert point["status"] == WRONG_OUTPUT
    assert "prepare()'s call returned None; accepted: the layer's output, shape (batch, Tq, d_model) = (1, 32, 64)" \
        in point["skipped"]


def test_asv_and_pytest_benchmark_setup_refuse_a_wrong_prepared_call_in_their_own_process():
    causal = Shape(1, 48, 48, 64, 4, "float32", True, False)
    with pytest.raises(WrongOutput, match="differs from the float64 reference"):
        prepared_call(FastPathForgetsTheCausalMask(), causal)
    assert prepared_call(NumpyTiled(), causal)() is not None


def test_a_declared_precision_divergence_sets_the_bound_and_an_undeclared_one_fails():
    """A float64 call computed in float32 fails the float64 bound; declared (precision:float32 on the output case,
    as jax-dpa and onnxruntime-cpu declare it, verified by conformance) it is held to the float32 bound."""
    from mha_harness.toolkit.divergences import precision_divergences

    class Float32Inside(NumpyNaive):
        name, loaded_class = "float32-inside", _ComputesFloat64InFloat32

    class Declared(Float32Inside):
        name = "float32-inside-declared"
        divergences = precision_divergences("float64", "float32", "computes in float32",
                                            ("check_output_matches_reference",))

    shape = Shape(1, 64, 64, 64, 4, "float64", False, False)
    point = prepare_point(Float32Inside(), shape)
    rows = point.checked_values(point.fn())
    with pytest.raises(WrongOutput, match="exceeds tolerance"):
        check_output(Float32Inside(), shape, rows)
    record = check_output(Declared(), shape, rows)
    assert record["bound_dtype"] == "float32" and record["declared_precision"] == "float32"
    assert record["max_error"] <= record["bound"]
    assert np.all(np.isfinite(rows))


def test_the_sweep_ends_saying_how_many_points_matched_the_reference_and_how_many_were_refused():
    ok = BenchPoint("numpy-tiled", "prefill", 64, 64, 64, True, "forward", status="measured",
                    output_check={"rows": 16, "max_error": 1e-7, "bound": 4e-7, "bound_dtype": "float32"})
    unchecked = BenchPoint("torch-eager", "prefill", 64, 64, 64, True, "forward+backward", status="measured",
                           output_check={"rows": 0, "unchecked": "forward + backward"})
    wrong = BenchPoint("bench-fast-path-forgets-causal-mask", "prefill", 64, 64, 64, True, "forward",
                       status=WRONG_OUTPUT, skipped="output differs ...")
    drifted = BenchPoint("bench-accumulates-into-its-buffer", "prefill", 64, 64, 64, True, "forward",
                         status=WRONG_OUTPUT, skipped="its first call matched ...", samples_s=[1e-3] * 6)
    line = output_check_line([ok, unchecked, wrong, drifted])
    assert line.startswith("1 measured point(s) matched the float64 reference at up to 16 query rows")
    assert "error 0.25 of its bound" in line and "1 forward+backward point(s) unchecked" in line
    assert "1 point(s) wrong-output at their first call, not timed" in line
    assert "1 point(s) wrong-output after their timed calls (right at first): no figure made" in line
    assert output_check_line([]) is None


def test_a_call_right_only_at_first_is_wrong_output_after_its_timed_calls(tmp_path):
    """One more call after the timed ones is checked like the first: an accumulator never zeroed (right once, then
    2x, 3x ...) keeps its samples but makes no figure; numpy-tiled's point records the second check too."""
    doc = run_bench([AccumulatesIntoItsOutputBuffer(), NumpyTiled()], tmp_path, seq_lens=[32],
                    config=BenchConfig(**SMALL))
    by = {p["backend"]: p for p in doc["points"]}
    drifted = by["bench-accumulates-into-its-buffer"]
    assert drifted["status"] == WRONG_OUTPUT and drifted["median_s"] is None and drifted["n_samples"] > 0, drifted
    assert drifted["skipped"].startswith("its first call matched the reference, but the call after its")
    assert "differs from the float64 reference" in drifted["skipped"]
    assert drifted["output_check"]["after_timing"] == {"wrong": drifted["skipped"].split(" did not: ", 1)[1]}
    ok = by["numpy-tiled"]
    assert ok["status"] == "measured" and ok["output_check"]["after_timing"]["max_error"] <= ok["output_check"]["bound"]


def test_x_best_compares_top_left_and_bottom_right_at_tq_equal_tk_as_the_one_mask_they_are():
    """A stranger's bottom-right-only KV layer and a top-left layer, both causal prefill, each got 'x best 1.00':
    at Tq = Tk the two alignments are one mask, so they are ranked together."""
    from mha_harness.bench.sweep import fastest
    kv = BenchPoint("kv-layer", "prefill", 64, 64, 64, True, "forward", call_mask="bottom-right", status="measured",
                    median_s=2e-3, ci95_s=[1.9e-3, 2.1e-3])
    selfattn = BenchPoint("self-layer", "prefill", 64, 64, 64, True, "forward", call_mask="top-left",
                          status="measured", median_s=1e-3, ci95_s=[0.9e-3, 1.1e-3])
    assert list(fastest([kv, selfattn]).values()) == [selfattn]
    rows = {line.split()[0]: line for line in table([kv, selfattn]).splitlines()
            if line.strip().startswith(("kv", "self"))}
    assert " 2.00 " in rows["kv-layer"] and " 1.00 " in rows["self-layer"]


def _with_mask(inputs, allowed):
    return inputs.replace(causal=None, attn_mask=allowed)


def _rows_of(params, inputs, shape_rows):
    from mha_harness.contract.reference import reference_attention
    return reference_attention(params, inputs, rows=shape_rows).output


@pytest.mark.parametrize("mistake, says", [
    ("no_causal_mask", "matches the same call without its causal mask (top-left): the call does not apply it"),
    ("scale_1_sqrt_d_model", "matches scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)"),
    ("no_w_o", "matches the heads' concatenation: W_o is not applied"),
    ("top_left_decode", "matches the causal mask's top-left alignment instead of bottom-right: query i sees keys 0..i, "
                        "not keys 0..i + Tk - Tq (tril(ones(Tq, Tk)) where tril(ones(Tq, Tk), diagonal=Tk - Tq) "
                        "belongs); in a KV-cache step the new queries then miss the cached keys"),
    ("one_key_too_wide", "matches a causal mask one key too wide (query i also sees key i + 1"),
    ("reversed_mask", "matches a reversed causal mask"),
    ("no_diagonal", "matches a causal mask that excludes the diagonal"),
    ("no_diagonal_decode", "a causal mask that excludes the diagonal (query i cannot see its own key) (in a KV-cache "
                           "step: one that attends to the cache before it writes the new tokens' keys and values"),
    ("kv_tiled", "matches grouped-query key/value heads expanded by tiling: query head h reads key/value head h % "
                 "kv_heads"),
    ("noise", None),
])
def test_a_wrong_output_names_the_known_mistake_its_checked_rows_match(mistake, says):
    """bench's wrong-output names the mistake as check does where its rows suffice: the causal mask dropped, the
    other alignment of a decode step, a common wrong scale, W_o left out; an output wrong in no known way names
    none; a causal mask one key too wide, reversed or without its diagonal are named too (a decode step's without
    its diagonal as attending before writing, as check names it: an outside user's bench named it otherwise)."""
    from mha_harness.bench.calls import backend_arguments
    from mha_harness.conformance.diagnoses import wrong_layer_output
    from mha_harness.contract.mistakes import with_score_scale, without_output_projection
    decode = mistake in ("top_left_decode", "no_diagonal_decode")
    shape = Shape(1, 16 if decode else 48, 64 if decode else 48, 64, 4, "float32", True, False, cached=decode,
                  num_kv_heads=2 if mistake == "kv_tiled" else None)
    backend = NumpyTiled()
    params, inputs = backend_arguments(backend, shape)
    rows = checked_rows(inputs.tq)
    wrong = {"no_causal_mask": lambda: _rows_of(params, inputs.replace(causal=None), rows),
             "scale_1_sqrt_d_model": lambda: _rows_of(with_score_scale(params, np.sqrt(16 / 64)), inputs, rows),
             "no_w_o": lambda: _rows_of(without_output_projection(params), inputs, rows),
             "top_left_decode": lambda: _rows_of(params, inputs.replace(causal="top-left"), rows),
             "one_key_too_wide": lambda: _rows_of(params, _with_mask(inputs, np.tri(48, 48, k=1, dtype=bool)), rows),
             "reversed_mask": lambda: _rows_of(params, _with_mask(inputs, ~np.tri(48, 48, k=-1, dtype=bool)), rows),
             "no_diagonal": lambda: _rows_of(params, _with_mask(inputs, np.tri(48, 48, k=-1, dtype=bool)), rows),
             "no_diagonal_decode": lambda: _rows_of(params, _with_mask(inputs, np.tri(16, 64, k=64 - 16 - 1,
                                                                                     dtype=bool)), rows),
             "kv_tiled": lambda: wrong_layer_output(params, inputs, kv_tiled=True)[:, rows],
             "noise": lambda: _rows_of(params, inputs, rows) * 1.01}[mistake]()
    with pytest.raises(WrongOutput) as raised:
        check_output(backend, shape, wrong)
    message = str(raised.value)
    if says:
        assert says in message, message
    else:
        assert "the output matches" not in message, message
    assert ("decode step (prepare_decode_step)" if decode else "never prepare()'s call") in message


def _backward_points(backends, causal="off", seq_lens=(32,)):
    pytest.importorskip("torch")
    doc = run_bench(backends, None, seq_lens=list(seq_lens), backward=True, causal=causal,
                    config=BenchConfig(**SMALL))
    return {(p["backend"], p["mode"], p["causal"]): p for p in doc["points"]}, doc


def test_forward_backward_points_are_checked_by_their_gradients_before_and_after_timing():
    """torch-eager's forward + backward call returns the gradients of output.sum(); bench compares a few rows of
    each input's and weight's gradient, and each bias whole, with the float64 reference's under the conformance
    gradient case's tolerance, before and after timing."""
    from mha_harness.registry import load_registry
    by, doc = _backward_points([load_registry().get("torch-eager").backend], causal="both")
    for causal in (False, True):
        check = by[("torch-eager", "forward+backward", causal)]["output_check"]
        assert check["rows"] == 16 and set(check["gradients"]) >= {"query", "key", "value", "W_q", "W_k", "W_v", "W_o"}
        assert 0 < check["max_error"] <= check["bound"] and check["worst"] in check["gradients"]
        assert check["after_timing"]["max_error"] <= check["bound"]
    line = output_check_line([BenchPoint(**p) for p in doc["points"]])
    assert "(2 of them forward+backward, by their gradients; largest" in line


def test_gradients_accumulated_over_calls_are_right_only_at_first_and_make_no_figure():
    from tests.backward_plugins import AccumulatesGradients
    by, _ = _backward_points([AccumulatesGradients()])
    point = by[("bench-accumulates-gradients", "forward+backward", False)]
    assert point["status"] == WRONG_OUTPUT and point["samples_s"] and point["median_s"] is None, point
    assert point["output_check"]["max_error"] <= point["output_check"]["bound"]  # right at its first call
    assert "gradients accumulated over calls" in point["output_check"]["after_timing"]["wrong"]
    assert by[("bench-accumulates-gradients", "forward", False)]["status"] == "measured"


def test_a_backward_that_leaves_the_parameters_out_is_wrong_output_naming_the_gradient():
    from tests.backward_plugins import FreezesParameters
    by, _ = _backward_points([FreezesParameters()])
    point = by[("bench-freezes-parameters", "forward+backward", False)]
    assert point["status"] == WRONG_OUTPUT and not point["samples_s"], point
    assert "left no gradient for W_q (None): its backward did not reach it" in point["skipped"]


def test_a_backward_fast_path_that_drops_the_causal_mask_is_wrong_output_at_its_causal_point():
    from tests.backward_plugins import BackwardDropsCausalMask
    by, _ = _backward_points([BackwardDropsCausalMask()], causal="both")
    wrong = by[("bench-backward-drops-causal-mask", "forward+backward", True)]
    assert wrong["status"] == WRONG_OUTPUT and "differs from the float64 reference" in wrong["skipped"], wrong
    assert "runs the layer's vjp, never prepare()'s call" in wrong["skipped"]
    assert by[("bench-backward-drops-causal-mask", "forward+backward", False)]["status"] == "measured"
    assert by[("bench-backward-drops-causal-mask", "forward", True)]["status"] == "measured"


def test_a_layer_that_does_not_read_its_gradients_is_timed_unchecked_saying_so():
    from tests.backward_plugins import ReadsNoGradients
    by, _ = _backward_points([ReadsNoGradients()])
    point = by[("bench-reads-no-gradients", "forward+backward", False)]
    assert point["status"] == "measured" and point["output_check"]["rows"] == 0
    assert "no native_gradients" in point["output_check"]["unchecked"]


def test_gradients_past_the_reference_size_limit_are_unchecked_saying_why(monkeypatch):
    pytest.importorskip("torch")
    from mha_harness.bench import verify
    from mha_harness.registry import load_registry
    backend = load_registry().get("torch-eager").backend
    shape = Shape(1, 32, 32, 64, 4, "float32", False, True)
    point = prepare_point(backend, shape)
    values = point.checked_values(point.fn())
    assert verify.check_point(backend, shape, values)["rows"] == 16
    monkeypatch.setattr(verify, "GRADIENT_CHECK_SCORES", 4 * 32 * 32 - 1)
    record = verify.check_point(backend, shape, values)
    assert record["rows"] == 0 and "4,096 scores" in record["unchecked"]


def test_a_long_plugin_name_keeps_the_table_columns_apart():
    name = "my-mha-bug-fwdonly-bwd-readme-only"
    point = BenchPoint(name, "prefill", 1, 32, 32, False, "forward", status="skipped", skipped="no gradients")
    (row,) = [line for line in table([point]).splitlines() if line.strip().startswith(name)]
    assert row.split()[:2] == [name, "fwd"], row


def _gradients_as_sent(grads: dict) -> dict:
    from mha_harness.bench.calls import gradient_part
    return {name: {"shape": list(g.shape), "part": gradient_part(np.asarray(g, np.float64))}
            for name, g in grads.items()}


@pytest.mark.parametrize("mistake, says", [
    ("float32_inside", "the error is within the float32 bound"),
    ("one_key_too_wide", "the gradients match those of a causal mask one key too wide"),
    ("no_causal_mask", "the gradients match those of the same call without its causal mask (top-left)"),
    ("accumulated", "every gradient is 3 x the reference's: gradients accumulated over calls"),
])
def test_wrong_gradients_name_the_known_mistake_they_match(mistake, says):
    """bench's gradient check names what the wrong gradients match: a float64 call computing in float32, a causal
    mask missing or one key too wide in the backward, gradients accumulated over calls; the two values it quotes
    differ in print (a float64 error of 1e-7 is shown with the digits that tell them apart)."""
    from mha_harness.bench.calls import backend_arguments
    from mha_harness.bench.verify import check_gradients
    from mha_harness.contract.reference import reference_vjp
    shape = Shape(1, 24, 24, 32, 4, "float64" if mistake == "float32_inside" else "float32", True, True)
    backend = NumpyNaive()
    params, inputs = backend_arguments(backend, shape)
    ones = np.ones((1, 24, 32))
    wrong = {"float32_inside": lambda: reference_vjp(params, inputs, ones, dtype="float32"),
             "one_key_too_wide": lambda: reference_vjp(params, _with_mask(inputs, np.tri(24, 24, k=1, dtype=bool)),
                                                       ones),
             "no_causal_mask": lambda: reference_vjp(params, inputs.replace(causal=None), ones),
             "accumulated": lambda: {n: 3 * g for n, g in reference_vjp(params, inputs, ones).items()}}[mistake]()
    with pytest.raises(WrongOutput) as raised:
        check_gradients(backend, shape, _gradients_as_sent(wrong))
    message = str(raised.value)
    assert says in message, message
    import re
    expected, got = re.search(r"expected (\S+), got (\S+) at", message).groups()
    assert expected != got, message


def test_a_gradient_reader_tripping_on_a_none_grad_is_told_to_return_none_for_it():
    import types

    from mha_harness.bench.calls import PreparedPoint

    class Reader:
        def native_gradients(self, value):
            return {"W_k": value.grad.double()}  # value.grad is None: the backward did not reach it
    point = PreparedPoint(fn=None, loaded=Reader(), params=None, inputs=None,
                          shape=Shape(1, 8, 8, 32, 4, "float32", False, True))
    with pytest.raises(WrongOutput, match="stays None .*: return None for it and bench names it"):
        point.checked_values(types.SimpleNamespace(grad=None))


def test_bias_times_a_layer_with_biases_and_checks_their_gradients():
    """--bias (BenchConfig.bias): the layer's projections carry b_q ... b_o, whose gradients bench checks whole
    beside the others; a backend declaring bias=False is skipped, saying so."""
    pytest.importorskip("torch")
    from mha_harness.registry import load_registry
    from tests.bench_plugins import LlamaLikeGQA
    doc = run_bench([load_registry().get("torch-eager").backend, LlamaLikeGQA()], None, seq_lens=[32], backward=True,
                    causal="on", config=BenchConfig(bias=True, **SMALL))
    assert doc["config"]["bias"] is True
    by = {(p["backend"], p["mode"]): p for p in doc["points"]}
    check = by[("torch-eager", "forward+backward")]["output_check"]
    assert {"b_q", "b_k", "b_v", "b_o"} <= set(check["gradients"]) and check["max_error"] <= check["bound"]
    assert by[("torch-eager", "forward")]["output_check"]["rows"] == 16
    assert "no biases (declares bias=False)" in by[("llama-like-gqa", "forward")]["skipped"]


def _reference_gradient_parts(backend, shape: Shape) -> dict:
    """What a correct layer's native_gradients would send for ``shape``: the float64 reference's gradients of
    output.sum() in the backend's form, each as its full shape and gradient_part."""
    from mha_harness.bench.calls import backend_arguments, gradient_part
    from mha_harness.contract.expected import input_gradients
    from mha_harness.contract.reference import reference_vjp
    params, inputs = backend_arguments(backend, shape)
    grads = input_gradients(reference_vjp(params, inputs, np.ones((shape.batch, shape.tq, shape.d_model))),
                            backend.capabilities.inputs)
    return {name: {"shape": list(g.shape), "part": gradient_part(g)} for name, g in grads.items()}


GRADIENT_SHAPE = Shape(1, 32, 32, 64, 4, "float64", causal=False, backward=True)


def test_gradient_names_are_exactly_the_gradients_the_tolerance_compares():
    """bench names a missing gradient from gradient_names before paying for the reference: the names must be the
    ones the comparison then needs, for every input form, with and without biases, cached positions or not."""
    from mha_harness.contract.api import AttentionConfig, AttentionInputs
    from mha_harness.contract.expected import gradient_names, gradient_tolerances
    from mha_harness.contract.params import make_params
    rng = np.random.default_rng(0)
    for bias in (False, True):
        params = make_params(AttentionConfig(16, 2, bias=bias))
        for tq, tk in ((4, 4), (2, 6)):
            x = rng.standard_normal((1, tk, 16))
            for form in ("separate", "self", "shared_kv", "kv_cache"):
                if form == "self" and tq != tk:
                    continue
                inputs = AttentionInputs(x[:, tk - tq:], x, x, causal="bottom-right" if form == "kv_cache" else None)
                compared = gradient_tolerances(params, inputs, np.ones((1, tq, 16)), "float32", form)
                assert sorted(gradient_names(params, inputs, form)) == sorted(compared), (form, bias, tq, tk)


def test_a_missing_gradient_is_named_before_the_reference_is_computed(monkeypatch):
    from mha_harness.bench import verify
    backend = NumpyNaive()
    got = _reference_gradient_parts(backend, GRADIENT_SHAPE)
    del got["W_o"]

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference was computed for a call already known to be wrong")
    monkeypatch.setattr(verify, "gradient_tolerances", no_reference)
    with pytest.raises(WrongOutput, match="native_gradients returned no gradient for W_o"):
        verify.check_gradients(backend, GRADIENT_SHAPE, got)


def test_zero_parameter_gradients_are_named_as_a_backward_that_never_reaches_the_parameters():
    """The same hint as check's gradient case (mha_harness.contract.mistakes.frozen_parameters_hint): every
    weight's gradient zero while the inputs' are right."""
    from mha_harness.bench import verify
    backend = NumpyNaive()
    got = _reference_gradient_parts(backend, GRADIENT_SHAPE)
    assert verify.check_gradients(backend, GRADIENT_SHAPE, got)["max_error"] == 0.0
    for name in ("W_q", "W_k", "W_v", "W_o"):
        got[name]["part"] = np.zeros_like(got[name]["part"])
    with pytest.raises(WrongOutput, match="every parameter's gradient is zero or missing: the backward does not "
                                          "reach the parameters"):
        verify.check_gradients(backend, GRADIENT_SHAPE, got)
