"""The cross workload of ``mha-harness bench``: x_q of one sequence against one x_kv of another, unmasked."""
from __future__ import annotations

import dataclasses

import pytest

from mha_harness.bench.calls import backend_arguments, unsupported
from mha_harness.bench.metrics import Shape, compulsory_bytes
from mha_harness.bench.sweep import BenchConfig, BenchPoint, run_bench, table
from mha_harness.cli import _skip_hint, main
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.implementations.numpy_tiled import NumpyTiled

SMALL = dict(d_model=64, num_heads=4, budget_s=0.2, warm_up_s=0.05, min_sample_s=0.005, turn_s=0.02)


def _declaring(**capabilities):
    backend = NumpyNaive()
    backend.capabilities = dataclasses.replace(backend.capabilities, **capabilities)
    return backend


def test_cross_bytes_count_the_query_sequence_and_one_key_value_sequence_once():
    """Cross-attention reads x_q (Tq rows) and one x_kv (Tk rows) that makes both K and V, not a key and a value
    input apart, at Tq = Tk too (where self-attention reads one x)."""
    for tq, tk in ((4096, 77), (64, 64)):
        s = Shape(1, tq, tk, 512, 8, cross=True)
        assert compulsory_bytes(s) == ((tq + tk) * 512 + tq * 512 + 4 * 512 * 512) * 4
    assert compulsory_bytes(Shape(1, 64, 64, 512, 8)) == (64 * 512 * 2 + 4 * 512 * 512) * 4  # self-attention


def test_a_cross_call_is_x_q_against_one_x_kv_of_another_sequence_at_any_lengths():
    """The call's key is its value (the shared_kv form) and neither is the query, at Tq = Tk, Tq < Tk and Tq > Tk;
    no mask."""
    for tq, tk in ((32, 32), (8, 64), (100, 16)):
        params, inputs = backend_arguments(NumpyNaive(), Shape(1, tq, tk, 64, 4, cross=True))
        assert inputs.form == "shared_kv" and inputs.key is inputs.value and inputs.query is not inputs.key
        assert (inputs.tq, inputs.tk) == (tq, tk) and inputs.causal is None


def test_layers_that_cannot_take_another_sequences_keys_are_skipped_naming_why():
    shape = Shape(1, 16, 64, 64, 4, cross=True)
    assert "inputs='self'" in unsupported(_declaring(inputs="self", cross_attention=False), shape)
    assert "inputs='kv_cache'" in unsupported(_declaring(inputs="kv_cache", causal_alignments=("bottom-right",)),
                                              shape)
    assert "declares cross_attention=False" in unsupported(_declaring(cross_attention=False), shape)
    assert "more_queries_than_keys=False" in unsupported(_declaring(more_queries_than_keys=False),
                                                         Shape(1, 100, 16, 64, 4, cross=True))
    assert unsupported(_declaring(inputs="shared_kv"), shape) is None
    assert "always causal" in unsupported(_declaring(always_causal=True), shape)
    # what to do, per reason: never to pass --causal on, which the cross workload refuses
    assert "--workload prefill" in _skip_hint(unsupported(_declaring(inputs="self", cross_attention=False), shape),
                                              "cross")
    hint = _skip_hint("always causal (declares always_causal): no full-attention call", "cross")
    assert "pass --causal on" not in hint and "cross-attention is unmasked" in hint


def test_cross_workload_measures_every_pair_of_lengths_unmasked_with_its_own_plots(tmp_path):
    one_x = _declaring(inputs="self", cross_attention=False)
    one_x.name = "numpy-naive-one-x"
    doc = run_bench([NumpyTiled(), one_x], tmp_path, seq_lens=[16, 64], config=BenchConfig(workload="cross", **SMALL),
                    query_lens=(8, 100))
    mine = [p for p in doc["points"] if p["backend"] == "numpy-tiled"]
    assert {(p["tq"], p["tk"]) for p in mine} == {(8, 16), (100, 16), (8, 64), (100, 64)}
    assert all(p["status"] == "measured" and not p["causal"] and p["call_mask"] == "none" for p in mine)
    assert all(p["output_check"]["max_error"] <= p["output_check"]["bound"] for p in mine)
    assert all(p["status"] == "skipped" and "inputs='self'" in p["skipped"] for p in doc["points"]
               if p["backend"] == "numpy-naive-one-x")
    assert doc["workload"] == "cross" and doc["causal"] == "off" and doc["query_lens"] == [8, 100]
    assert "x_kv" in doc["cross_call"]
    assert "numpy-tiled|cross tq=8|forward" in doc["fits"]
    rows = table([BenchPoint(**p) for p in doc["points"]])
    assert "cross Tq = 100, KV = 16" in rows
    for name in ("cross_time_vs_kv_len.png", "cross_memory_vs_kv_len.png", "bench.json"):
        assert (tmp_path / "bench-cross" / name).exists()
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("options, named", [
    (["--causal", "on"], "--causal: got 'on' with --workload cross"),
    (["--rotary", "half_split"], "--rotary: got 'half_split' with the cross workload"),
    (["--sliding-window", "8"], "--sliding-window: got 8 with the cross workload"),
    (["--alibi", "linear"], "--alibi: got 'linear' with the cross workload"),
])
def test_cross_workload_refuses_a_mask_and_positional_features_naming_the_option(tmp_path, capsys, options, named):
    assert main(["bench", "--workload", "cross", "--backend", "numpy-tiled", *options,
                 "--results", str(tmp_path)]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("tq, tk", [(32, 32), (48, 16)])
def test_a_cross_call_whose_keys_and_values_come_from_the_queries_is_named_by_benchs_output_check(tq, tk):
    """An outside user's encoder-decoder block projecting K and V from the decoder's input: check named it, bench
    said only 'wrong-output'. Its output is self-attention over the queries, at Tq = Tk and at Tq != Tk."""
    from mha_harness.bench.calls import checked_rows
    from mha_harness.bench.verify import WrongOutput, check_output
    from mha_harness.contract.mistakes import SELF_ATTENTION_OVER_QUERIES
    from mha_harness.contract.reference import reference_attention
    backend, shape = NumpyNaive(), Shape(1, tq, tk, 64, 4, cross=True)
    params, inputs = backend_arguments(backend, shape)
    rows = checked_rows(tq)
    wrong = reference_attention(params, inputs.replace(key=inputs.query, value=inputs.query), rows=rows).output
    with pytest.raises(WrongOutput, match=SELF_ATTENTION_OVER_QUERIES + "x_kv belongs"):
        check_output(backend, shape, wrong)
    right = reference_attention(params, inputs, rows=rows).output
    assert check_output(backend, shape, right)["max_error"] == 0.0


def test_cross_workload_accepts_causal_off_what_it_does(tmp_path):
    """A script that always passes --causal off broke on the cross workload: off is what cross-attention does."""
    assert main(["bench", "--workload", "cross", "--causal", "off", "--backend", "numpy-tiled", "--seq-lens", "16",
                 "--query-lens", "8", "--d-model", "64", "--heads", "4", "--budget", "0.2",
                 "--results", str(tmp_path)]) == 0
    assert (tmp_path / "bench-cross" / "bench.json").exists()
