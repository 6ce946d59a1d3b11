"""What an outside user met benchmarking a Llama-style grouped-query self-attention module (called as module(x),
always causal top-left, grouped_query=True, no biases) from the README alone: no way to time it with fewer key/value
heads, a fidelity timing run that compared nothing and exited 0, a decode skip that gave the wrong reason and an
undocumented mask value, FLOP columns that did not say they count the core only, roofs measured before learning that
nothing could run, and a memory-bandwidth roof that moved between runs."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mha_harness.bench.metrics import Shape, best_time, compulsory_bytes, core_flops, metrics, projection_flops
from mha_harness.bench.sweep import BenchConfig, BenchPoint, run_bench, table
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.implementations.numpy_tiled import NumpyTiled
from tests.always_causal_objects import NaiveAlwaysBottomRight, NaiveAlwaysTopLeft
from tests.bench_plugins import LlamaLikeGQA

SMALL = dict(d_model=64, num_heads=4, budget_s=0.2, warm_up_s=0.05, min_sample_s=0.005, turn_s=0.02)


def _quiet(*args, **kwargs):
    pass


def _multi_head_only() -> NumpyNaive:
    backend = NumpyNaive()
    backend.name = "numpy-naive-multi-head-only"
    backend.capabilities = dataclasses.replace(backend.capabilities, grouped_query=False)
    return backend


# ---------------------------------------------------------------- 1. --kv-heads

def test_grouped_query_heads_shrink_the_projection_flops_and_the_weight_bytes_not_the_core():
    """With num_kv_heads < num_heads, W_k and W_v are d_model x (num_kv_heads * d_head): the layer's FLOPs and its
    compulsory bytes count those smaller matrices; the attention core is the same (every query head scores its
    keys)."""
    mha, gqa = Shape(1, 1024, 1024, 512, 8), Shape(1, 1024, 1024, 512, 8, num_kv_heads=2)
    kv_width = 2 * 64
    assert gqa.kv_width == kv_width and mha.kv_width == 512
    assert core_flops(gqa) == core_flops(mha)
    assert projection_flops(mha) == 2 * 512 * (2 * 1024 * 512 + 2 * 1024 * 512)
    assert projection_flops(gqa) == 2 * 512 * (2 * 1024 * 512 + 2 * 1024 * kv_width)
    assert compulsory_bytes(gqa) == (1024 * 512 + 1024 * 512 + 2 * 512 * 512 + 2 * 512 * kv_width) * 4
    decode = Shape(1, 1, 65536, 512, 8, "float32", True, False, 1)
    assert projection_flops(decode) == 2 * 512 * (2 * 1 * 512 + 2 * 65536 * 64)
    assert metrics(gqa, 0.01)["layer_gflops"] < metrics(mha, 0.01)["layer_gflops"]
    assert metrics(gqa, 0.01)["gflops"] == metrics(mha, 0.01)["gflops"]


def test_bench_kv_heads_times_the_grouped_query_layer_and_skips_a_backend_without_grouped_query(tmp_path, capsys):
    """``BenchConfig(num_kv_heads=2)`` (``bench --kv-heads 2``): the call is made with two key/value heads, bench.json's
    config and the header say so, GFLOP/s and GB/s count the smaller K/V projections, and a backend that does not
    declare grouped_query is skipped at every point naming the capability."""
    from mha_harness.bench.calls import backend_arguments
    from mha_harness.bench.sweep import shape_of
    config = BenchConfig(num_kv_heads=2, **SMALL)
    run_bench([NumpyTiled(), _multi_head_only()], tmp_path, seq_lens=[64, 128], config=config)
    out = capsys.readouterr().out
    assert "4 heads, num_kv_heads 2 (grouped-query)" in out.splitlines()[0], out.splitlines()[0]
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["config"]["num_kv_heads"] == 2
    tiled = [p for p in saved["points"] if p["backend"] == "numpy-tiled"]
    assert tiled and all(p["status"] == "measured" for p in tiled)
    for p in tiled:
        shape = shape_of(BenchPoint(**p), config)
        assert shape.kv_heads == 2 and backend_arguments(NumpyTiled(), shape)[0].W_k.shape == (64, 2 * 16)
        layer = (core_flops(shape) + projection_flops(shape)) / p["median_s"] / 1e9
        full_kv = dataclasses.replace(shape, num_kv_heads=None)
        assert p["layer_gflops"] == pytest.approx(layer, rel=1e-3)
        assert p["layer_gflops"] < (core_flops(full_kv) + projection_flops(full_kv)) / p["median_s"] / 1e9
        assert p["gbytes_per_s"] == pytest.approx(compulsory_bytes(shape) / p["median_s"] / 1e9, rel=1e-3)
    skipped = [p for p in saved["points"] if p["backend"] == "numpy-naive-multi-head-only"]
    assert skipped and all(p["status"] == "skipped" and "grouped_query" in p["skipped"] for p in skipped)
    # decode takes it too
    decode = run_bench([NumpyTiled()], None, seq_lens=[64], config=BenchConfig(workload="decode", num_kv_heads=1,
                                                                                **SMALL), query_lens=(1,), log=_quiet)
    assert decode["config"]["num_kv_heads"] == 1 and decode["points"][0]["status"] == "measured"
    refused = r"num_kv_heads: got 3, which does not divide num_heads 4; accepted: .*1, 2, 4"
    with pytest.raises(ValueError, match=refused):
        run_bench([NumpyTiled()], None, seq_lens=[64], config=BenchConfig(num_kv_heads=3, **SMALL), log=_quiet)


def test_kv_heads_is_validated_naming_the_option_and_the_accepted_values(tmp_path, capsys):
    from mha_harness.cli import main
    for bad, said in (("3", "--kv-heads: got 3, which does not divide --heads 8"),
                      ("16", "--kv-heads: got 16, outside 1..8"), ("0", "--kv-heads: got '0'")):
        assert main(["bench", "--heads", "8", "--kv-heads", bad, "--results", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert said in err, err
        if bad != "0":
            assert "accepted: an integer 1 <= N <= --heads (8) that divides it: 1, 2, 4, 8" in err, err


def test_the_plots_titles_name_the_heads_and_the_key_value_heads(tmp_path, monkeypatch):
    from mha_harness.bench import sweep
    titles = []
    monkeypatch.setattr(sweep, "_figure", lambda points, metric, ylabel, title, *a, **k: titles.append(title))
    point = BenchPoint("a", "prefill", 64, 64, 64, False, "forward")
    sweep.plot([point], tmp_path, {}, BenchConfig(num_kv_heads=2, **SMALL))
    decode = BenchPoint("a", "decode", 64, 1, 64, True, "forward")
    sweep.plot([decode], tmp_path, {"memory_bandwidth_gbs": 10.0}, BenchConfig(workload="decode", **SMALL))
    cross = BenchPoint("a", "cross", 64, 128, 64, False, "forward")
    sweep.plot([cross], tmp_path, {}, BenchConfig(workload="cross", **SMALL))
    assert len(titles) == 7  # prefill 2, decode 3 (time, bandwidth, memory), cross 2
    assert all("4 heads, num_kv_heads 2 (grouped-query)" in t for t in titles[:2]), titles
    assert all("4 heads, num_kv_heads 4 (multi-head)" in t for t in titles[2:]), titles


def test_the_outside_users_grouped_query_module_x_layer_benchmarks_from_the_command_line(tmp_path):
    """The user's command: a module(x), always-causal, grouped-query layer with --causal on --kv-heads: measured with
    top-left calls of one x and two key/value heads, exit 0."""
    done = subprocess.run([sys.executable, "-m", "mha_harness", "bench", "--backend-spec",
                           "tests.bench_plugins:LlamaLikeGQA", "--causal", "on", "--heads", "4", "--kv-heads", "2",
                           "--d-model", "64", "--seq-lens", "32,64", "--budget", "0.1", "--results", str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout + done.stderr
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["config"]["num_kv_heads"] == 2
    assert {(p["status"], p["call_mask"]) for p in saved["points"]} == {("measured", "top-left")}


# ---------------------------------------------------------------- 2. fidelity of an always-causal backend

def test_fidelity_times_an_always_causal_backend_with_causal_calls_and_says_so():
    """An always-causal backend has no full-attention call: fidelity's timing now times it causal, in the alignment
    bench --causal on gives it (the test backends raise on any other call), labelled in the row and the line."""
    pytest.importorskip("torch")
    from mha_harness.bench.fidelity import timing_agreement
    lines = []
    rows = timing_agreement([NaiveAlwaysTopLeft(), NaiveAlwaysBottomRight(), NumpyTiled()], BenchConfig(**SMALL),
                            seq_lens=(64,), rounds=1, max_rounds=1, autorange_s=0.1,
                            log=lambda *a, **k: lines.append(a[0]))
    by = {r["backend"]: r for r in rows}
    for name, mask in (("numpy-naive-always-top-left", "top-left"),
                       ("numpy-naive-always-bottom-right", "bottom-right")):
        row = by[name]
        assert row["call_mask"] == mask and row["causal"] is True, row
        assert not row.get("errors") and row["sweep_over_autorange"] is not None and row["within_10pct"] is not None
        assert any(line.split()[:4] == [name, "T=64", "causal", mask] for line in lines), lines
    assert by["numpy-tiled"]["call_mask"] == "none" and by["numpy-tiled"]["causal"] is False


def test_a_fidelity_section_asked_for_that_compared_nothing_for_a_requested_backend_exits_1(tmp_path, monkeypatch,
                                                                                            capsys):
    """``fidelity --backend-spec mod:Obj --section timing`` printed n/a and "0/0 within +-10%" and exited 0; a section
    the user asked for that compares nothing for a requested backend now says so on stderr and exits 1."""
    pytest.importorskip("torch")
    from mha_harness.bench import fidelity
    from mha_harness.cli import main
    monkeypatch.setattr(fidelity, "speed_stability", lambda: {"error": "not measured in this test"})
    code = main(["fidelity", "--backend-spec", "tests.always_causal_objects:GPTCausalSelfAttention", "--section",
                 "timing", "--results", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "a section you asked for compared nothing" in err
    assert "timing: compared nothing for gpt-causal-self-attention (prepare: " in err and "prepared callable" in err


def test_nothing_compared_names_each_section_asked_for_that_compared_nothing():
    from mha_harness.bench.fidelity import nothing_compared
    doc = {"timing": [{"backend": "a", "seq_len": 512, "within_10pct": True, "within_5pct": False},
                      {"backend": "b", "seq_len": 512, "within_10pct": None, "within_5pct": None,
                       "errors": ["prepare: no prepared callable"]}],
           "overhead": [{"backend": "a", "not_runnable": "no direct_callable (the library call written by hand)"}],
           "memory": "not run: not among the chosen sections (--section timing)",
           "tiled_vs_naive": {"not_runnable": "numpy-tiled: not registered"}}
    assert nothing_compared(doc, ["a", "b"], ["timing"]) == [
        "timing: compared nothing for b (prepare: no prepared callable)"]
    assert nothing_compared(doc, ["a"], ["timing"]) == []
    assert nothing_compared(doc, ["a"], ["overhead"], overhead_names=["a"]) == [
        "overhead: compared nothing for a (no direct_callable (the library call written by hand))"]
    assert nothing_compared(doc, ["a"], ["tiled-vs-naive"]) == [
        "tiled-vs-naive: compared nothing (numpy-tiled: not registered)"]
    assert nothing_compared({"timing": "not runnable: torch (torch.utils.benchmark) is not installed"}, ["a"],
                            ["timing"]) == ["timing: compared nothing (not runnable: torch (torch.utils.benchmark) is "
                                            "not installed)"]


# ---------------------------------------------------------------- 3. decode of a one-x layer

def test_decode_of_a_one_x_layer_gives_the_real_reason_first_and_a_documented_mask_value(tmp_path, capsys):
    """A self-form layer (inputs="self") cannot take Tq != Tk: every decode point says that, not "no bottom-right
    causal mask"; the table's mask column shows the mask the workload asks for (bottom-right), one of the README's
    values, not "causal"; the exit message says what to run instead."""
    from mha_harness.cli import _nothing_measured
    doc = run_bench([LlamaLikeGQA()], tmp_path, seq_lens=[64, 128], query_lens=(1, 16),
                    config=BenchConfig(workload="decode", **SMALL))
    out = capsys.readouterr().out
    assert doc["points"] and all(p["status"] == "skipped" for p in doc["points"])
    assert all(p["skipped"].startswith("declares inputs='self' (one x): Tq = ") and "decode" in p["skipped"]
               for p in doc["points"]), doc["points"][0]["skipped"]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["llama-like-gqa"]]
    assert rows and {r[2] for r in rows} == {"bottom-right"}, rows
    [line] = _nothing_measured(doc)
    assert "prefill workload" in line and "inputs='shared_kv'" in line, line


def test_the_mask_column_of_a_point_never_prepared_is_one_of_the_documented_values():
    points = [BenchPoint("b", "prefill", 64, 64, 64, True, "forward", status="skipped", skipped="x"),
              BenchPoint("b", "prefill", 64, 64, 64, False, "forward", status="skipped", skipped="x"),
              BenchPoint("b", "decode", 64, 1, 64, True, "forward", status="not-run", skipped="x")]
    masks = {line.split()[2] for line in table(points).splitlines() if line.split()[:1] == ["b"]}
    assert masks == {"top-left", "none", "bottom-right"}


# ---------------------------------------------------------------- 4. core GFLOP/s

def test_the_table_labels_its_flop_columns_as_the_attention_core():
    """The table's GFLOP/s and %GEMM count the attention core only (bench.json's layer_gflops the whole layer): the
    header says "core", the numbers sit under it, and the note names the JSON fields."""
    point = BenchPoint("a", "prefill", 64, 64, 64, False, "forward", status="measured", median_s=1e-3, n_samples=6,
                       ci95_rel_halfwidth=0.01, calls_per_sample=3, peak_extra_bytes=2 ** 22,
                       memory_below_resolution=False, gflops=123.4, fraction_of_gemm_peak=0.456, gbytes_per_s=7.25,
                       fraction_of_memory_bandwidth=0.321)
    lines = table([point]).splitlines()
    [header] = [line for line in lines if "backend" in line and "median ms" in line]
    [row] = [line for line in lines if line.split()[:1] == ["a"]]
    assert "core GFLOP/s" in header and "core %GEMM" in header
    assert header.index("core GFLOP/s") + len("core GFLOP/s") == row.index("123.4") + len("123.4")
    assert header.index("core %GEMM") + len("core %GEMM") == row.index("45.6%") + len("45.6%")
    assert header.index("GB/s") + len("GB/s") == row.index("7.25") + len("7.25")
    note = " ".join(lines)
    assert "the attention core alone" in note and "layer_gflops" in note and "fraction_of_gemm_peak" in note


# ---------------------------------------------------------------- 5. fail fast

def test_a_bench_in_which_nothing_can_run_stops_before_measuring_the_roofs(tmp_path, monkeypatch):
    """An always-causal layer at the default causal off: every point is unsupported from the declarations alone, so
    the run reports it (table, complete bench.json, the exit message's hint) without the roofs (seconds) or a
    worker."""
    from mha_harness.bench import sweep
    from mha_harness.cli import _nothing_measured

    def measured(*args, **kwargs):
        raise AssertionError("the roofs were measured although nothing can run")
    monkeypatch.setattr(sweep, "gemm_roofs", measured)
    monkeypatch.setattr(sweep, "bandwidth_roof", measured, raising=False)
    monkeypatch.setattr(sweep, "memory_bandwidth_gbs", measured, raising=False)
    monkeypatch.setattr(sweep, "BackendWorker", measured)
    doc = run_bench([NaiveAlwaysTopLeft()], tmp_path, seq_lens=[32, 64], config=BenchConfig(**SMALL), log=_quiet)
    assert [p["status"] for p in doc["points"]] == ["skipped", "skipped"]
    assert doc["machine"]["roofs_measured"] is False and doc["machine"]["memory_bandwidth_gbs"] is None
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["complete"] is True
    [line] = _nothing_measured(doc)
    assert "always causal" in line and line.endswith("; pass --causal on (or both)")


def test_a_plot_of_a_run_whose_every_point_was_unsupported_says_so(tmp_path, monkeypatch):
    """A run that measured nothing still redraws its plots (none is left from an earlier run in the folder); their
    "nothing to plot ... see the note below" had no note when every point was skipped as unsupported."""
    from matplotlib.figure import Figure

    from mha_harness.bench.sweep import plot
    texts = []
    original = Figure.text
    monkeypatch.setattr(Figure, "text", lambda self, x, y, s, *a, **k: (texts.append(s),
                                                                         original(self, x, y, s, *a, **k))[1])
    skipped = [BenchPoint("llama-like-gqa", "prefill", t, t, t, False, "forward", status="skipped",
                          skipped="always causal (declares always_causal): no full-attention call") for t in (64, 128)]
    plot(skipped, tmp_path, {})
    assert any("every point skipped as unsupported" in t and "llama-like-gqa" in t for t in texts), texts


# ---------------------------------------------------------------- 7. the bandwidth roof's estimator

def test_a_roof_is_the_best_call_over_at_least_a_span_of_time_not_of_the_first_few_calls():
    """A roof is what the machine can reach: the fastest call (noise only adds time). The bandwidth's calls last a few
    ms each, and a shared box's speed moves in regimes lasting about a second, so its calls span at least
    min_seconds: a fast moment after the first five calls is still found."""
    from mha_harness.bench.metrics import BANDWIDTH_MIN_SECONDS, timed_calls
    now = [0.0]

    def clock():
        return now[0]

    def scripted(durations):
        durations = iter(durations)

        def call():
            now[0] += next(durations)
        return call
    # the warm-up call (first) is not counted; the fastest of the five timed calls is
    assert best_time(scripted([0.010, 0.009, 0.008, 0.009, 0.010, 0.009]), 5, clock=clock) == pytest.approx(0.008)
    later_fast_moment = [0.010] + [0.009] * 6 + [0.004] + [0.009] * 100
    assert best_time(scripted(later_fast_moment), 5, clock=clock) == pytest.approx(0.009)  # five calls miss it
    times = timed_calls(scripted(later_fast_moment), 5, min_seconds=0.08, clock=clock)
    assert len(times) == 10 and sum(times) >= 0.08 > sum(times[:-1]) and min(times) == pytest.approx(0.004)
    assert best_time(scripted(later_fast_moment), 5, min_seconds=0.08, clock=clock) == pytest.approx(0.004)
    assert BANDWIDTH_MIN_SECONDS >= 1.0


def test_fidelity_with_one_backend_does_not_compare_sweep_against_alone():
    """A stranger checked only their own backend: every sweep turn followed its own, so sweep/alone was ~1 and printed
    'ok' while testing nothing. It is 'not compared' (naming how to compare), and it asks for no extra rounds."""
    from mha_harness.bench.fidelity import _ratios_unsure, _timing_line, _timing_row
    own = [{"after": "mine", "sweep_s": 1.0 + 0.001 * i, "alone_s": 1.0, "autorange_s": 1.0} for i in range(12)]
    row = _timing_row("mine", 512, own)
    assert row["sweep_over_alone"] is None and row["within_5pct"] is None and row["within_10pct"] is True
    assert "not compared" in _timing_line(row) and "--backend" in _timing_line(row)
    noisy_alone = [dict(f, alone_s=0.5 + (i % 3) * 0.5) for i, f in enumerate(own)]
    assert not _ratios_unsure(noisy_alone, "mine") and _ratios_unsure(noisy_alone)
    other = [dict(f, after="numpy-tiled") for f in own]
    assert _timing_row("mine", 512, other)["within_5pct"] is True


def test_fidelity_says_a_ratio_outside_its_target_with_a_ci_including_1_is_undetermined():
    """A ninth stranger on a loaded box read 'OUTSIDE +-10%' on a ratio whose 95 % CI was [0.26, 8.4]: the rounds
    established no difference. The verdict stays OUTSIDE (the target is not met), and the row says it is
    undetermined; an OUTSIDE whose CI excludes 1.0 says nothing more."""
    from mha_harness.bench.fidelity import _timing_line
    row = {"backend": "mine", "seq_len": 512, "sweep_median_s": 0.01, "alone_median_s": 0.01,
           "autorange_median_s": 0.004, "sweep_over_autorange": 2.5, "sweep_over_autorange_ci95": [0.26, 8.4],
           "within_10pct": False, "sweep_over_alone": 1.2, "sweep_over_alone_ci95": [1.1, 1.3], "within_5pct": False}
    line = _timing_line(row)
    assert "sweep/autorange 2.500 [0.260-8.400] OUTSIDE +-10% (undetermined: the CI includes 1.0)" in line, line
    assert line.endswith("sweep/alone 1.200 [1.100-1.300] OUTSIDE +-5%"), line


def test_fidelity_says_why_the_printed_medians_disagree_with_the_compared_ratio():
    """An outside user read 'sweep 185.99 ms ... adaptive_autorange 539.55 ms sweep/autorange 0.962 ok' as a
    contradiction: the ratio is the median of each round's ratio, the medians are over all rounds of a box whose
    speed changed. The line says so when the two disagree by more than MEDIANS_APART, and only then."""
    from mha_harness.bench.fidelity import _timing_line
    row = {"backend": "mine", "seq_len": 1024, "sweep_median_s": 0.186, "alone_median_s": 0.233,
           "autorange_median_s": 0.5396, "sweep_over_autorange": 0.962, "sweep_over_autorange_ci95": [0.345, 1.093],
           "within_10pct": True, "sweep_over_alone": 1.0, "sweep_over_alone_ci95": [0.9, 1.1], "within_5pct": True}
    assert "the medians' own ratio, 0.345, is not the compared one" in _timing_line(row)
    assert "medians' own ratio" not in _timing_line(dict(row, autorange_median_s=0.19))


def test_fidelity_timing_lengths_and_rounds_are_options(tmp_path, monkeypatch):
    """A stranger checking only their own backend waited through 12-36 rounds at T = 512 and 2048: the timing
    section's lengths and rounds are options (defaults unchanged), recorded in fidelity.json's config."""
    import json

    from mha_harness import cli
    from mha_harness.bench import fidelity

    asked = {}

    def fake_timing(backends, config, seq_lens=fidelity.TIMING_SEQ_LENS, *, rounds=fidelity.TIMING_ROUNDS,
                    max_rounds=fidelity.TIMING_MAX_ROUNDS, **_):
        asked.update(names=[b.name for b in backends], seq_lens=tuple(seq_lens), rounds=rounds, max_rounds=max_rounds)
        return []

    monkeypatch.setattr(fidelity, "timing_agreement", fake_timing)
    monkeypatch.setattr(fidelity, "speed_stability", lambda: {"error": "not measured in this test"})
    argv = ["fidelity", "--backend", "numpy-naive", "--section", "timing", "--results", str(tmp_path)]
    cli.main(argv + ["--timing-seq-lens", "64,128", "--timing-rounds", "2"])
    assert asked == {"names": ["numpy-naive"], "seq_lens": (64, 128), "rounds": 2, "max_rounds": 6}
    config = json.loads((tmp_path / "bench" / "fidelity.json").read_text())["config"]
    assert (config["timing_seq_lens"], config["timing_rounds"], config["timing_max_rounds"]) == ([64, 128], 2, 6)
    cli.main(argv)
    assert (asked["seq_lens"], asked["rounds"], asked["max_rounds"]) == ((512, 2048), 12, 36)


def test_the_roofs_line_names_every_librarys_gemm_figure():
    """A stranger read 'float32 GEMM 196.6 GFLOP/s (NumPy), 196.6 (numpy, the compute roof)' in a run with JAX
    backends and could not tell whether JAX's GEMM was measured; the line lists each library's figure."""
    from mha_harness.bench.sweep import _gemm_by_library
    machine = {"gemm_gflops_float32_by_library": {"numpy": 196.6, "jax": 190.2, "torch": 150.0,
                                                  "onnxruntime": "not installed"}}
    assert _gemm_by_library(machine) == "numpy 196.6, jax 190.2, torch 150.0, onnxruntime: not installed"
    assert _gemm_by_library({}) == ""


def test_a_long_skip_reason_is_printed_whole_once_and_no_legend_when_nothing_ran():
    """A stranger's module(x) layer in decode: every row cut its reason at 90 characters ('...so dec'), the same
    reason on every point, and the whole legend followed though no figure was printed."""
    from mha_harness.bench.sweep import SKIPPED, BenchPoint, table
    why = ("declares inputs='self' (one x): Tq = {tq} != Tk = {tk} cannot be expressed with one x, so decode is not "
           "defined for it; wrap it a second time as layer(x_q, x_kv)")
    points = [BenchPoint("mine", "decode", tk, tq, tk, True, "forward", status=SKIPPED,
                         skipped=why.format(tq=tq, tk=tk)) for tk in (256, 512) for tq in (1, 16)]
    out = table(points)
    rows = [line for line in out.splitlines() if line.split()[:2] == ["mine", "fwd"]]
    assert len(rows) == 4 and all("(in full below)" in row for row in rows)
    whole = [line for line in out.splitlines() if line.startswith("  - mine (skipped")]
    assert whole == ["  - mine (skipped, 4 point(s)): " + why.format(tq=1, tk=256)]
    assert "time budget ran out" not in out and "core GFLOP/s, core %GEMM" not in out


# ---------------------------------------------------------------- reading a side-by-side

def _timed(backend, median, low, high, other_cores=0.0):
    return BenchPoint(backend, "prefill", 1024, 1024, 1024, True, "forward", status="measured", median_s=median,
                      ci95_s=[low, high], ci95_rel_halfwidth=max(median - low, high - median) / median,
                      n_samples=8, calls_per_sample=1, other_cores=other_cores)


def test_the_table_says_how_many_times_slower_each_backend_is_and_whether_this_run_separates_them():
    """A stranger comparing their layer with SDPA flash and torch-eager divided medians by hand and compared CIs to
    see which gaps were real: each row gives its median over the fastest's, marked '?' when their CIs overlap."""
    points = [_timed("flash", 0.063, 0.059, 0.068), _timed("mine", 0.188, 0.160, 0.222),
              _timed("eager", 0.258, 0.220, 0.289)]
    points.append(_timed("close", 0.066, 0.061, 0.075))
    lines = table(points).splitlines()
    [header] = [line for line in lines if "median ms" in line]
    rows = {line.split()[0]: line for line in lines if line.split()[:1] in (["flash"], ["mine"], ["eager"], ["close"])}
    end = header.index("x best") + len("x best")
    assert rows["flash"][:end].rstrip().endswith("1.00")
    assert rows["mine"][:end].endswith("2.98 ")  # disjoint CIs: a real gap
    assert rows["close"][:end].endswith("1.05?")  # its CI reaches into flash's: not separated by this run
    assert any(line.strip().startswith("x best: the median over the fastest") and "'?'" in line for line in lines)


def test_a_ci_wider_than_the_median_prints_both_sides_not_a_negative_lower_bound():
    """A stranger read '+-1128%' as a lower bound below zero: the interval [0.59, 23.3] ms around 1.89 ms is
    skewed; beyond 100% both sides are printed."""
    [row] = [line for line in table([_timed("noisy", 1.89e-3, 0.59e-3, 23.3e-3)]).splitlines()
             if line.split()[:1] == ["noisy"]]
    assert "-69/+1133%" in row and "1128" not in row, row


def test_the_time_plot_draws_a_loaded_points_marker_open_and_says_so(tmp_path, monkeypatch):
    """The table marks a point timed on a busy machine 'L'; the plot drew it like any other. The memory plot does
    not mark it."""
    from matplotlib.figure import Figure

    from mha_harness.bench.sweep import plot
    notes = []
    real_text = Figure.text
    monkeypatch.setattr(Figure, "text", lambda self, x, y, s, *a, **k: (notes.append(s), real_text(self, x, y, s,
                                                                                                   *a, **k))[1])
    points = [_timed("busy", 0.01 * t / 1024, 0.009 * t / 1024, 0.011 * t / 1024, other_cores=1.0 if t == 512 else 0)
              for t in (256, 512, 1024)]
    for p, t in zip(points, (256, 512, 1024)):
        p.seq_len = p.tq = p.tk = t
        p.peak_extra_bytes = 4096 * t
    plot(points, tmp_path, {})
    assert any("open marker" in n and "busy" in n and "512" in n for n in notes), notes
    # a peak of memory, measured in its own pass, is not marked for the timing's load (an outside user read the
    # open markers of the memory plot as readings below the resolution): only the time plot's note says so
    assert sum("open marker" in n for n in notes) == 1, notes
