"""The benchmark engine: metrics, statistics, workers that survive hostile plugins, interrupted sweeps, JSON, plots."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import types
from contextlib import contextmanager

import numpy as np
import pytest

from mha_harness.bench import stats
from mha_harness.bench.memory import peak_extra_bytes
from mha_harness.bench.metrics import Shape, compulsory_bytes, core_flops, metrics
from mha_harness.bench.sweep import BenchConfig, BenchPoint, run_bench, table
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.implementations.numpy_tiled import NumpyTiled
from tests.conftest import ROOT

SMALL = dict(d_model=64, num_heads=4, budget_s=0.2, warm_up_s=0.05, min_sample_s=0.005, turn_s=0.02)


def test_flops_follow_the_flash_attention_formula():
    s = Shape(batch=2, tq=1024, tk=1024, d_model=512, num_heads=8)
    assert core_flops(s) == 4 * 2 * 8 * 1024 * 1024 * 64
    assert core_flops(Shape(2, 1024, 1024, 512, 8, causal=True)) == 2 * 2 * 8 * 1024 * 1024 * 64
    assert core_flops(Shape(2, 1024, 1024, 512, 8, backward=True)) == 3.5 * 4 * 2 * 8 * 1024 * 1024 * 64


def test_decode_bytes_count_key_and_value_inputs_and_weights_once():
    s = Shape(batch=1, tq=1, tk=65536, d_model=512, num_heads=8, dtype="bfloat16")
    assert compulsory_bytes(s) == (1 * 512 + 2 * 65536 * 512 + 512 + 4 * 512 * 512) * 2
    m = metrics(s, 0.5, gemm_peak_gflops=100.0, memory_bandwidth_gbs=10.0)
    assert m["gbytes_per_s"] == pytest.approx(compulsory_bytes(s) / 0.5 / 1e9, rel=1e-3)
    assert m["fraction_of_memory_bandwidth"] == pytest.approx(m["gbytes_per_s"] / 10.0, rel=1e-3)
    assert m["fraction_of_gemm_peak"] == pytest.approx(m["gflops"] / 100.0, rel=1e-3)
    assert m["layer_gflops"] > m["gflops"]  # decode is dominated by the K/V projections


def test_median_ci_needs_six_samples_and_brackets_the_median():
    assert stats.median_ci([1.0, 1.1, 0.9, 1.0, 1.05]) is None
    samples = [1.0, 1.1, 0.9, 1.05, 1.02, 0.98]
    low, high = stats.median_ci(samples)
    assert low == 0.9 and high == 1.1  # n = 6: [min, max] covers 96.9%
    tight = list(np.random.default_rng(0).normal(1.0, 0.01, 200))
    assert stats.converged(tight, 0.03) and not stats.converged(samples, 0.03)


def test_calls_per_sample_make_a_sample_last_long_enough():
    assert stats.calls_per_sample(0.001, 0.02) == 20
    assert stats.calls_per_sample(0.5, 0.02) == 1


def test_fit_exponent_uses_the_largest_points_above_resolution_with_stderr():
    xs = [64, 128, 256, 512, 1024]
    ys = [1.0] + [x ** 2 for x in xs[1:]]
    fit = stats.fit_exponent(xs, ys)
    assert fit["exponent"] == pytest.approx(2.0, abs=1e-6) and fit["stderr"] == pytest.approx(0, abs=1e-6)
    assert stats.fit_exponent(xs, [10, 10, 10, 2 ** 20, 2 ** 22], floor=100) is None  # only 2 above the floor


def test_a_flat_memory_series_fits_exponent_zero_with_stderr_zero_not_nan():
    """numpy-tiled's decode memory is the same at every KV length: scipy's stderr was 0/0, written as NaN (invalid
    JSON) and printed "0.00 +- nan"."""
    assert stats.fit_exponent([4096, 16384, 65536], [1.1, 1.1, 1.1]) == {"exponent": 0.0, "stderr": 0.0,
                                                                           "points": [4096, 16384, 65536]}


def test_a_time_exponent_time_cannot_have_or_that_noise_leaves_undetermined_is_a_measurement_error():
    """A stranger's loaded-machine sweep printed time exponents -1.33 +- 0.41 and -1.07 +- 1.70 as results."""
    falling = stats.time_fit([128, 256, 512], [4e-3, 1.0e-3, 0.7e-3])
    assert "measurement_error" in falling and "exponent" not in falling and "outside [0.0, 3.0]" in \
        falling["measurement_error"]
    scattered = stats.time_fit([128, 256, 512], [1e-3, 8e-3, 0.4e-3])
    assert "measurement_error" in scattered and "undetermined" in scattered["measurement_error"]
    flat = stats.time_fit([128, 256, 512], [1.00e-3, 0.98e-3, 0.99e-3])  # overhead-bound: flat, not an error
    assert flat["exponent"] == pytest.approx(0.0, abs=0.05)
    assert stats.time_fit([256, 512, 1024], [1e-3, 4e-3, 16e-3])["exponent"] == pytest.approx(2.0)


def test_memory_exponent_outside_0_to_2_2_is_a_measurement_error():
    fit = stats.memory_fit([256, 512, 1024], [1e6, 1e6 * 8 ** 2, 1e6 * 8 ** 4], floor=0)  # slope 3.8
    assert "measurement_error" in fit and "exponent" not in fit
    assert stats.memory_fit([256, 512, 1024], [1e6, 4e6, 16e6], floor=0)["exponent"] == pytest.approx(2.0)


def test_tracemalloc_sees_numpy_buffers():
    size = 32 * 2 ** 20
    assert peak_extra_bytes(lambda: np.ones(size // 8), "tracemalloc") >= size


def test_rss_method_sees_a_fresh_allocation():
    size = 64 * 2 ** 20
    assert peak_extra_bytes(lambda: np.ones(size // 8), "rss") >= size * 0.9


def test_sweep_writes_ci_per_point_fits_and_plots(tmp_path, capsys):
    doc = run_bench([NumpyNaive(), NumpyTiled()], tmp_path, seq_lens=[64, 128, 256], config=BenchConfig(**SMALL))
    out = capsys.readouterr().out
    assert "T = 256" in out and "GFLOP/s" in out and "growth exponent" in out
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["complete"] is True and saved["schema"] == "mha-harness/bench"
    assert saved["machine"]["gemm_peak_gflops_float32"] > 0 and saved["machine"]["memory_bandwidth_gbs"] > 0
    assert saved["threads"]["threads"] == 2 and saved["threads"]["env"]["OPENBLAS_NUM_THREADS"] == "2"
    assert saved["backends"]["numpy-naive"]["threads"]["pools"]  # what threadpoolctl saw inside the worker
    for point in saved["points"]:
        assert point["status"] == "measured", point
        assert point["n_samples"] >= stats.MIN_SAMPLES and len(point["samples_s"]) == point["n_samples"]
        low, high = point["ci95_s"]
        assert low <= point["median_s"] <= high and point["calls_per_sample"] >= 1
        assert isinstance(point["budget_exhausted"], bool) and point["memory_method"] == "tracemalloc"
    naive = [p for p in saved["points"] if p["backend"] == "numpy-naive"]
    assert saved["fits"]["numpy-naive|full|forward"]["memory"]["exponent"] > 1.5
    assert naive[-1]["peak_extra_bytes"] > naive[0]["peak_extra_bytes"] > 0
    for name in ("time_vs_seq_len.png", "memory_vs_seq_len.png"):
        assert (tmp_path / "bench" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["points"]


def test_each_backend_runs_in_its_own_worker_process(tmp_path):
    doc = run_bench([NumpyNaive(), NumpyTiled()], None, seq_lens=[32], config=BenchConfig(**SMALL))
    pids = {info["pid"] for info in doc["backends"].values()}
    assert len(pids) == 2 and os.getpid() not in pids


def test_decode_workload_is_bottom_right_with_its_own_plots(tmp_path):
    doc = run_bench([NumpyTiled()], tmp_path, seq_lens=[64, 256], config=BenchConfig(workload="decode", **SMALL),
                    query_lens=(1, 16))
    assert {(p["tq"], p["tk"]) for p in doc["points"]} == {(1, 64), (16, 64), (1, 256), (16, 256)}
    assert all(p["causal"] and p["status"] == "measured" and p["gbytes_per_s"] > 0 for p in doc["points"])
    assert {p["call_mask"] for p in doc["points"]} == {"bottom-right"}
    assert "numpy-tiled|decode tq=1|forward" in doc["fits"]
    for name in ("decode_time_vs_kv_len.png", "decode_bandwidth_vs_kv_len.png", "decode_memory_vs_kv_len.png",
                 "bench.json"):
        assert (tmp_path / "bench-decode" / name).exists()


def test_unsupported_points_are_skipped_with_a_reason(tmp_path):
    doc = run_bench([NumpyTiled()], None, seq_lens=[32], backward=True, config=BenchConfig(**SMALL))
    backward = [p for p in doc["points"] if p["mode"] == "forward+backward"]
    assert backward and backward[0]["status"] == "skipped" and backward[0]["skipped"] == "no gradients"


def test_a_plugin_writing_junk_into_its_pipes_is_reported_and_the_sweep_goes_on(tmp_path):
    """A timed call that writes a forged frame to every inherited descriptor (the answer pipe, the sentinel): the
    backend is lost as an error within --bench-timeout, numpy-tiled's points are all measured, and the command ends
    (it hung for good before)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mha_harness", "bench", "--backend", "numpy-tiled", "--backend-spec",
                          "tests.bench_plugins:WritesJunkToItsPipes", "--seq-lens", "32,64", "--d-model", "64",
                          "--heads", "4", "--budget", "0.2", "--bench-timeout", "10", "--results", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=400)
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - start < 300
    doc = json.loads((tmp_path / "bench" / "bench.json").read_text())
    by = {}
    for p in doc["points"]:
        by.setdefault(p["backend"], []).append(p)
    assert [p["status"] for p in by["numpy-tiled"]] == ["measured"] * 2
    junk = by["bench-writes-junk-to-its-pipes"]
    assert junk[0]["status"] in ("error", "timeout") and "pipe" in junk[0]["skipped"] + out.stdout, junk[0]


def test_hanging_crashing_and_memory_hogging_plugins_are_reported_and_the_sweep_goes_on(tmp_path):
    """Through the command line, as a user meets them: each hostile plugin is reported for its points, the sweep
    goes on, every numpy-tiled point is measured, bench.json is complete, and the command exits 1 naming the
    backends whose points were lost."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    specs = [a for name in ("HangsInPrepare", "SegfaultsInCall", "HogsMemory")
             for a in ("--backend-spec", f"tests.bench_plugins:{name}")]
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mha_harness", "bench", "--backend", "numpy-tiled", *specs,
                          "--seq-lens", "32,64,128", "--d-model", "64", "--heads", "4", "--budget", "0.2",
                          "--bench-timeout", "10", "--max-memory", "300", "--results", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not every requested backend was measured" in out.stderr
    for name in ("bench-hangs-in-prepare", "bench-segfaults", "bench-hogs-memory"):
        assert name in out.stderr
    assert "numpy-tiled" not in out.stderr
    assert time.monotonic() - start < 300
    doc = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert doc["complete"] is True
    by = {}
    for p in doc["points"]:
        by.setdefault(p["backend"], []).append(p)
    assert [p["status"] for p in by["bench-hangs-in-prepare"]] == ["timeout", "not-run", "not-run"]
    assert "no answer within 10 s" in by["bench-hangs-in-prepare"][0]["skipped"]
    assert "(while preparing the call: loading the layer, its first call" in by["bench-hangs-in-prepare"][0]["skipped"]
    assert [p["status"] for p in by["bench-segfaults"]] == ["crashed", "crashed", "not-run"]
    assert "SIGSEGV" in by["bench-segfaults"][0]["skipped"]
    assert by["bench-hogs-memory"][0]["status"] == "out-of-memory"
    assert "memory limit of 300 MiB" in by["bench-hogs-memory"][0]["skipped"]
    tiled = by["numpy-tiled"]
    assert [p["status"] for p in tiled] == ["measured"] * 3
    assert all(p["median_s"] and p["ci95_s"] and p["peak_extra_bytes"] for p in tiled)
    for text in ("bench-hangs-in-prepare", "timeout", "crashed: worker process killed by signal SIGSEGV",
                 "out-of-memory: worker passed the memory limit of 300 MiB"):
        assert text in out.stdout, (text, out.stdout)
    for info in doc["backends"].values():  # no worker is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)


def test_figures_a_worker_cannot_account_for_with_the_harness_clock_are_not_figures(capsys):
    """The samples are timed in the backend's worker, where the plugin runs: one whose clock runs at a quarter of
    its speed would report calls 4x faster than they are. The parent's own clock around each sample request holds
    them to account: its points are unaccounted-timing, with no median; an honest worker's points are measured and
    record the share of that clock their samples fill."""
    from tests.bench_plugins import ReportsAQuarterOfItsTime
    config = BenchConfig(d_model=64, num_heads=4, budget_s=0.3, warm_up_s=0.05, min_sample_s=0.02, turn_s=0.1)
    doc = run_bench([NumpyTiled(), ReportsAQuarterOfItsTime()], None, seq_lens=[64], config=config)
    by = {p["backend"]: p for p in doc["points"]}
    honest, fake = by["numpy-tiled"], by["bench-reports-a-quarter-of-its-time"]
    assert honest["status"] == "measured" and honest["timed_fraction"] >= 0.8, honest
    assert fake["status"] == "unaccounted-timing" and fake["median_s"] is None and fake["samples_s"], fake
    assert fake["timed_fraction"] < 0.4
    assert "the clock or the figures were altered in the worker" in fake["skipped"]
    assert "unaccounted-timing" in capsys.readouterr().out


def _bench_command(results, extra=()):
    return [sys.executable, "-m", "mha_harness", "bench", "--backend", "numpy-naive", "--backend", "numpy-tiled",
            "--seq-lens", ",".join(str(64 + 16 * i) for i in range(40)), "--d-model", "64", "--heads", "4",
            "--budget", "0.3", "--results", str(results), *extra]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_sweep_keeps_every_finished_point_and_kills_its_workers(tmp_path, sig):
    path = tmp_path / "bench" / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    # SIGINT as a terminal's Ctrl-C delivers it: a background job of a non-interactive shell (nohup, CI runners)
    # starts with SIGINT ignored, and Python then keeps ignoring it, rightly; restore the default for the child
    proc = subprocess.Popen(_bench_command(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and seen < 4:
        time.sleep(0.2)
        if path.exists():
            seen = len(json.loads(path.read_text())["points"])
    assert seen >= 4, "the sweep wrote no points in time"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)  # a loaded 2-core box needs more than 60 s to stop the workers
    assert proc.returncode == 130, err
    doc = json.loads(path.read_text())
    assert doc["complete"] is False and len(doc["points"]) >= seen
    assert all(p["status"] == "measured" and p["ci95_s"] for p in doc["points"])
    # the memory pass comes after every timing: each timed point says why it has no memory figure
    assert all(p["peak_extra_bytes"] is not None or p["memory_error"].startswith("not measured: the sweep was "
               "interrupted") for p in doc["points"])
    assert "bench.json (complete: false" in out, out[-2000:]
    # the plots are redrawn from the finished points and say so: none is left from an earlier run beside this json
    for name in ("time_vs_seq_len.png", "memory_vs_seq_len.png"):
        assert (path.parent / name).stat().st_mtime >= path.stat().st_mtime - 60, name
    assert "plots of the finished points:" in out, out[-2000:]
    for info in doc["backends"].values():
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)


def test_bench_options_are_validated(tmp_path):
    from mha_harness.cli import main
    assert main(["bench", "--threads", "0", "--results", str(tmp_path)]) == 2
    assert main(["bench", "--workload", "train", "--results", str(tmp_path)]) == 2
    assert main(["bench", "--d-model", "100", "--heads", "8", "--results", str(tmp_path)]) == 2


def test_pytest_benchmark_side_by_side_smoke_run(tmp_path):
    env = {**os.environ, "MHA_BENCH_SEQ_LENS": "64", "MHA_BENCH_BACKENDS": "numpy-naive,numpy-tiled"}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/test_side_by_side.py", "-q", "-p",
                          "no:cacheprovider", "--benchmark-json", str(tmp_path / "b.json")], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert {b["group"] for b in data["benchmarks"]} == {"T=64"}
    assert all("gflops" in b["extra_info"] and "gbytes_per_s" in b["extra_info"] for b in data["benchmarks"])
    # read in each backend's memory worker (this process's mmap threshold stays glibc's for the timings)
    assert all(b["extra_info"]["peak_extra_bytes"] > 0 and b["extra_info"]["memory_method"] == "tracemalloc"
               for b in data["benchmarks"]), [b["extra_info"] for b in data["benchmarks"]]


def test_pytest_benchmark_side_by_side_leaves_opt_in_backends_out_unless_named():
    """A stranger's side-by-side collected the two compiled torch backends (opt-in: tens of minutes compiling); they
    run only when MHA_BENCH_BACKENDS names them, as `mha-harness bench` runs them only when named."""
    def collected(**extra):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "MHA_BENCH_BACKENDS")}
        env.update(MHA_BENCH_SEQ_LENS="64", **extra)
        out = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/test_side_by_side.py", "--collect-only",
                              "-q", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, env=env,
                             timeout=300)
        return out.stdout
    default = collected()
    assert "numpy-tiled-64" in default and "torch-flex-cpu" not in default and "torch-compile-cpu" not in default
    named = collected(MHA_BENCH_BACKENDS="torch-flex-cpu,numpy-naive")
    assert "torch-flex-cpu-64" in named and "numpy-naive-64" in named and "numpy-tiled-64" not in named


def test_run_survives_a_backend_that_passes_check_but_hangs_in_prepare(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    out = subprocess.run([sys.executable, "-m", "mha_harness", "run", "--backend", "numpy-tiled", "--backend-spec",
                          "tests.bench_plugins:HangsInPrepare", "--seq-lens", "32,64", "--bench-timeout", "15",
                          "--budget", "0.2", "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=1200)  # run includes check --mutants: minutes on a loaded box
    assert out.returncode == 1, out.stdout + out.stderr  # it finishes; the lost points make the benchmark incomplete
    assert "benchmark incomplete" in out.stdout and "bench-hangs-in-prepare" in out.stderr
    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    status = {(p["backend"], p["seq_len"]): p["status"] for p in bench["points"]}
    assert status == {("numpy-tiled", 32): "measured", ("numpy-tiled", 64): "measured",
                      ("bench-hangs-in-prepare", 32): "timeout", ("bench-hangs-in-prepare", 64): "not-run"}
    assert bench["complete"] is True


def test_fidelity_validates_tracemalloc_and_rss_against_the_dense_formula_in_own_workers():
    from mha_harness.bench.fidelity import memory_validation
    from mha_harness.registry import load_registry
    rows = memory_validation(load_registry(), BenchConfig(d_model=64, num_heads=4), seq_lens=(768,),
                             kernels=(("numpy-naive", "tracemalloc", 3, 3), ("numpy-naive", "rss", 3, 3),
                                      ("numpy-naive", "rss", 1, 0)), log=lambda *a, **k: None)
    assert [r["within_10pct"] for r in rows] == [True, True, False]  # a wrong formula is caught
    assert rows[0]["predicted_bytes"] == 3 * 4 * 768 ** 2 * 4 + 3 * 768 * 64 * 4
    lines = []
    small = memory_validation(load_registry(), BenchConfig(d_model=64, num_heads=4), seq_lens=(64,),
                              kernels=(("numpy-naive", "rss", 3, 3),), log=lambda *a, **k: lines.append(a[0]))
    assert small[0]["below_resolution"] and small[0]["within_10pct"] is None  # shown as such, not compared
    assert "below resolution" in lines[0] and "not compared" in lines[0]


def test_fidelity_compares_the_sweep_with_torch_utils_benchmark_and_alone():
    pytest.importorskip("torch")
    from mha_harness.bench.fidelity import timing_agreement
    # 2 rounds are too few for a 95% CI of the median ratio (6 at least): every backend gets a third, the most
    rows = timing_agreement([NumpyTiled(), NumpyNaive()], BenchConfig(**SMALL), seq_lens=(64,), rounds=2,
                            max_rounds=3, autorange_s=0.2, log=lambda *a, **k: None)
    assert [r["backend"] for r in rows] == ["numpy-tiled", "numpy-naive"]
    for row in rows:
        assert row["sweep_median_s"] > 0 and row["alone_median_s"] > 0 and row["autorange_median_s"] > 0
        assert {"sweep_over_autorange", "within_10pct", "sweep_over_alone", "within_5pct"} <= set(row)
        assert len(row["rounds"]) == 3 and row["sweep_over_alone_ci95"] is None
        assert all(f["sweep_s"] and f["alone_s"] and f["autorange_s"] for f in row["rounds"])
        assert [f["order"] for f in row["rounds"]] == ["alone, then autorange", "autorange, then alone",
                                                       "alone, then autorange"]
        # every sweep turn follows another backend's turn (with two backends too)
        assert all(f["after"] not in (None, row["backend"]) for f in row["rounds"])
        # the figure is the median of ratios taken within a round, not a ratio of figures minutes apart
        per_round = [f["sweep_s"] / f["autorange_s"] for f in row["rounds"]]
        assert row["sweep_over_autorange"] == pytest.approx(statistics.median(per_round), rel=1e-3)


def test_fidelity_gives_a_backend_more_rounds_only_while_its_ratio_is_unsure():
    from mha_harness.bench.fidelity import _ratios_unsure
    steady = [{"sweep_s": 1.0 + 0.001 * i, "alone_s": 1.0, "autorange_s": 1.0} for i in range(8)]
    noisy = [{"sweep_s": (0.7, 1.3)[i % 2], "alone_s": 1.0, "autorange_s": 1.0} for i in range(8)]
    assert not _ratios_unsure(steady) and _ratios_unsure(noisy) and _ratios_unsure(steady[:5])


def _spin_then_sleep(busy_s: float, spinning=None):
    if spinning is not None:
        spinning.set()
    end = time.perf_counter() + busy_s
    while time.perf_counter() < end:
        pass
    time.sleep(60)


@contextmanager
def _spinning_process(busy_s: float):
    """A spawned process that keeps one core busy for ``busy_s`` (yielded once it spins), killed at the end."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    spinning = context.Event()
    process = context.Process(target=_spin_then_sleep, args=(busy_s, spinning), daemon=True)
    process.start()
    try:
        assert spinning.wait(60)
        yield process
    finally:
        process.kill()


def test_the_next_turn_waits_until_other_workers_stop_spinning():
    """A process that keeps a core busy (a thread pool spin-waiting after its call) delays the next turn until it is
    idle; one that never stops is waited for up to the limit and reported as not settled."""
    from mha_harness.bench.worker import wait_until_idle
    with _spinning_process(1.0) as spinner:
        waited, settled = wait_until_idle([spinner.pid], limit_s=10.0)
        assert settled and 0.2 < waited < 5.0
        waited, settled = wait_until_idle([spinner.pid], limit_s=10.0)
        assert settled and waited < 0.2  # idle now: one window
    with _spinning_process(120.0) as forever:
        waited, settled = wait_until_idle([forever.pid], limit_s=0.3)
        assert not settled and waited >= 0.3


def test_a_bench_worker_reports_systemexit_and_keyboardinterrupt_from_plugin_code_as_errors():
    """The worker answers, instead of exiting 0 ("crashed, exit code 0") or dying on a plugin's KeyboardInterrupt."""
    from mha_harness.bench.worker import _Server
    from mha_harness.implementations.numpy_naive import NumpyNaive

    class Exits(NumpyNaive):
        def versions(self):
            raise SystemExit(0)

    class Interrupts(NumpyNaive):
        def versions(self):
            raise KeyboardInterrupt

    assert _Server(Exits(), 1).handle(("info",)) == ("error", "SystemExit: 0")
    assert _Server(Interrupts(), 1).handle(("info",))[0] == "error"


def _point(backend, t, peak, below, *, status="measured", median=1e-3):
    from mha_harness.bench.sweep import BenchPoint
    return BenchPoint(backend, "prefill", t, t, t, False, "forward", status=status, median_s=median * t,
                      ci95_s=[0.9 * median * t, 1.1 * median * t], peak_extra_bytes=peak, memory_method="rss",
                      memory_resolution_bytes=2 ** 21, memory_below_resolution=below)


def test_plots_never_fail_on_readings_below_resolution_or_missing(tmp_path):
    from mha_harness.bench.sweep import plot
    cases = {"all-below-resolution": [_point("a", t, 0, True) for t in (128, 256, 512)],
             "all-missing": [_point("a", t, None, None) for t in (128, 256, 512)],
             "mixed": [_point("a", 128, 10, True), _point("a", 256, 3 * 2 ** 20, False),
                       _point("a", 512, 12 * 2 ** 20, False), _point("b", 128, None, None),
                       _point("c", 128, 0, True), _point("c", 256, 0, True)]}
    for case, points in cases.items():
        paths = plot(points, tmp_path / case, {})
        assert [p.name for p in paths] == ["time_vs_seq_len.png", "memory_vs_seq_len.png"]
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    decode = [_point("a", t, 0, True) for t in (64, 128)]
    for p in decode:
        p.workload, p.tq, p.gbytes_per_s = "decode", 1, None  # nothing drawable on the bandwidth plot
    assert len(plot(decode, tmp_path / "decode", {"memory_bandwidth_gbs": 0.0})) == 3


def test_readings_below_one_resolution_at_one_length_are_drawn_side_by_side(tmp_path, monkeypatch):
    """Three backends below the same resolution at T = 128 drew one triangle on top of another (a stranger saw one
    where the note named three): each later one is moved right."""
    import matplotlib.axes

    from mha_harness.bench.sweep import plot
    drawn = []
    original = matplotlib.axes.Axes.plot

    def recording(self, *args, **kwargs):
        if kwargs.get("marker") == "v":
            drawn.append(list(args[0]))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    plot([_point(name, 128, 0, True) for name in "abc"], tmp_path, {})
    assert len(drawn) == 3 and len({x for xs in drawn for x in xs}) == 3, drawn


def test_tiled_vs_naive_shows_missing_and_below_resolution_readings_instead_of_crashing(monkeypatch):
    from dataclasses import asdict

    from mha_harness.bench import fidelity
    from mha_harness.registry import load_registry
    cases = {"missing": (_point("numpy-tiled", 4096, None, None), "no reading"),
             "below": (_point("numpy-tiled", 4096, 5, True), "below resolution"),
             "not measured": (_point("numpy-tiled", 4096, None, None, status="timeout", median=0), "timeout")}
    for name, (tiled, shown) in cases.items():
        naive = _point("numpy-naive", 4096, 1560 * 2 ** 20, False)
        monkeypatch.setattr(fidelity, "run_bench", lambda *a, _p=(naive, tiled), **k: {"points": [asdict(p) for p
                                                                                                   in _p]})
        lines = []
        row = fidelity.tiled_vs_naive(load_registry(), BenchConfig(), log=lambda *a, _l=lines, **k: _l.append(a[0]))
        assert row["memory_ratio_tiled_over_naive"] is None, name
        assert shown in lines[0], (name, lines)
    assert row["throughput_ratio_tiled_over_naive"] is None  # the timed-out point has no median either


def test_speed_stability_reports_each_window_against_the_median():
    from mha_harness.bench.fidelity import speed_stability
    s = speed_stability(seconds=1.0, window_s=0.25)
    assert s["windows"] >= 3 and len(s["window_over_median"]) == s["windows"]
    assert s["max_over_min"] >= 1.0 and min(s["window_over_median"]) <= 1.0 <= max(s["window_over_median"])


def test_fidelity_summary_counts_only_what_was_compared():
    from mha_harness.bench.fidelity import summary
    busy = [{"round_conditions": {"seconds": 10.0, "other_cpu_s": 2.5, "steal_s": 0.1}},
            {"round_conditions": {"seconds": 20.0, "other_cpu_s": 1.0, "steal_s": 0.2}}]
    doc = {"timing": [{"backend": "a", "seq_len": 512, "sweep_over_autorange": 1.04, "within_10pct": True,
                       "sweep_over_alone": 1.08, "within_5pct": False, "sweep_over_alone_ci95": [0.98, 1.2],
                       "rounds": busy},
                      {"backend": "c", "seq_len": 512, "sweep_over_autorange": 1.0, "within_10pct": True,
                       "sweep_over_alone": 1.07, "within_5pct": False, "sweep_over_alone_ci95": [1.02, 1.1]},
                      {"backend": "b", "seq_len": 512, "sweep_over_autorange": None, "within_10pct": None,
                       "sweep_over_alone": None, "within_5pct": None}],
           "memory": [{"backend": "n", "method": "rss", "seq_len": 2048, "within_10pct": True,
                       "xla_temp_plus_output_bytes": 1, "within_10pct_of_xla": False},
                      {"backend": "n", "method": "rss", "seq_len": 64, "within_10pct": None, "below_resolution": True},
                      {"backend": "g", "method": "cuda", "not_runnable": "no CUDA device"}]}
    s = summary(doc)
    assert s["sweep_over_autorange"]["within"] == 2 and s["sweep_over_autorange"]["compared"] == 2
    assert s["sweep_over_autorange"]["not_compared"] == ["b T=512"]
    assert s["sweep_over_alone"]["within"] == 0 and s["sweep_over_alone"]["worst"]["ratio"] == 1.08
    # a: outside +-5% but the rounds cannot tell it from 1.0; c: a difference its CI establishes
    assert s["sweep_over_alone"]["outside_with_ci_including_1"] == 1
    # a stranger's "sweep/autorange 1.011 [0.037-1.801] ok": within by its median, the CI says nothing
    doc["timing"][1]["sweep_over_autorange_ci95"] = [0.037, 1.801]
    assert summary(doc)["sweep_over_autorange"]["within_with_ci_past_target"] == 1
    from mha_harness.bench.fidelity import _timing_line
    assert "ok (undetermined: the CI reaches past +-10%)" in _timing_line(doc["timing"][1])
    assert "1.040 ok " in _timing_line(doc["timing"][0])  # no CI: nothing to say
    del doc["timing"][1]["sweep_over_autorange_ci95"]
    # how busy the rest of the box was: the busiest round's other-process CPU per second, and the steal
    assert s["timing_conditions"] == {"rounds": 2, "max_other_cores": 0.25, "steal_s": 0.3,
                                      "threads": doc.get("threads"), "cores": os.cpu_count()}
    # an outside user's fidelity rounds ran 30x slower than its first beside another process, summed up as "ok":
    # two threads and a busy core need more than 2 cores, and the summary says what fewer threads would do
    from mha_harness.bench.fidelity import _log_summary
    lines = []
    _log_summary({"timing_conditions": {**s["timing_conditions"], "max_other_cores": 1.25, "threads": 2,
                                        "cores": 2}}, lines.append)
    assert "kept up to 1.25 cores busy" in lines[-1] and "--threads 1 leaves the others room" in lines[-1]
    lines.clear()
    _log_summary({"timing_conditions": {**s["timing_conditions"], "threads": 2, "cores": 8}}, lines.append)
    assert "--threads" not in lines[-1]
    rss = s["memory_vs_formula"]["methods"]["rss"]
    assert (rss["within"], rss["compared"]) == (1, 1) and "below resolution" in rss["not_compared"][0]
    assert s["memory_vs_formula"]["methods"]["cuda"]["not_compared"] == ["g: no CUDA device"]
    assert s["memory_vs_xla"] == {"target": "+-10%", "within": 0, "compared": 1}
    # a stranger saw "throughput ratio 0.38, target >= 1" with no OUTSIDE and nothing in the summary
    doc["overhead"] = [{"backend": "t", "ratio": 1.01, "within_target": True},
                       {"backend": "p", "not_runnable": "no direct_callable"}]
    doc["tiled_vs_naive"] = {"targets": {"memory_ratio": "<= 0.1", "throughput_ratio": ">= 1"},
                             "memory_ratio_tiled_over_naive": 0.05, "memory_within_target": True,
                             "throughput_ratio_tiled_over_naive": 0.38, "throughput_within_target": False}
    s = summary(doc)
    assert s["overhead"] == {"target": "<= 1.03", "within": 1, "compared": 1, "not_compared": ["p: no direct_callable"]}
    assert s["tiled_vs_naive"]["throughput_within"] is False and s["tiled_vs_naive"]["memory_within"] is True
    lines = []
    fidelity_log_summary(s, lambda line, **k: lines.append(line))
    assert any("throughput ratio 0.38 (OUTSIDE >= 1)" in line for line in lines), lines
    assert any("1/1 within <= 1.03; not compared: p: no direct_callable" in line for line in lines), lines


def test_fidelity_runs_only_the_chosen_sections_and_says_which_were_left_out(tmp_path, monkeypatch):
    """A stranger waited 10 minutes for fidelity's every section to learn one plugin's timing agreement."""
    import json

    from mha_harness.bench import fidelity
    from mha_harness.registry import load_registry
    ran = []
    for name in ("memory_validation", "harness_overhead", "timing_agreement", "speed_stability"):
        monkeypatch.setattr(fidelity, name, lambda *a, _n=name, **k: ran.append(_n) or [])
    monkeypatch.setattr(fidelity, "tiled_vs_naive", lambda *a, **k: ran.append("tiled_vs_naive") or {
        "targets": {"memory_ratio": "<= 0.1", "throughput_ratio": ">= 1"}, "memory_ratio_tiled_over_naive": 0.05,
        "memory_within_target": True, "throughput_ratio_tiled_over_naive": 2.0, "throughput_within_target": True})
    lines = []
    doc = fidelity.run_fidelity(load_registry(), ["numpy-naive"], tmp_path, sections=["tiled-vs-naive"],
                                log=lambda *a, **k: lines.append(a[0] if a else ""))
    assert ran == ["tiled_vs_naive"]
    on_disk = json.loads((tmp_path / "bench" / "fidelity.json").read_text())
    assert on_disk["complete"] and on_disk["sections"] == ["tiled-vs-naive"]
    for key in ("memory", "overhead", "timing"):
        assert doc[key].startswith("not run: not among the chosen sections (--section tiled-vs-naive)"), doc[key]
        assert any(line.startswith(f"  {key}: not run") for line in lines), lines
    assert doc["summary"]["tiled_vs_naive"]["throughput_within"] is True
    with pytest.raises(ValueError, match="accepted: memory, overhead, tiled-vs-naive, timing"):
        fidelity.run_fidelity(load_registry(), [], tmp_path, sections=["speed"])


def fidelity_log_summary(s, log):
    from mha_harness.bench.fidelity import _log_summary
    _log_summary(s, log)


def test_fits_report_an_impossible_memory_exponent_as_a_measurement_error_in_the_json():
    from mha_harness.bench.sweep import _fmt_fit, fits
    good = [_point("ok", t, t * t * 100, False) for t in (256, 512, 1024)]  # exponent 2
    bad = [_point("bad", t, 2 ** 21 * (t // 128) ** 4, False) for t in (256, 512, 1024)]  # exponent 4
    low = [_point("low", 256, 0, True), _point("low", 512, 3 * 2 ** 20, False), _point("low", 1024, 5 * 2 ** 20, False)]
    out = fits(good + bad + low)
    ok, bad_fit = out["ok|full|forward"]["memory"], out["bad|full|forward"]["memory"]
    assert ok["exponent"] == pytest.approx(2.0) and "stderr" in ok
    assert "measurement_error" in bad_fit and "exponent" not in bad_fit
    assert "MEASUREMENT ERROR" in _fmt_fit(bad_fit)
    assert out["low|full|forward"]["memory"] is None  # only 2 points above resolution: no fit
    assert out["ok|full|forward"]["time"]["exponent"] == pytest.approx(1.0)


def test_a_backend_lost_at_a_long_length_keeps_the_memory_of_the_points_it_measured():
    from tests.bench_plugins import HangsAboveT32
    doc = run_bench([HangsAboveT32()], None, seq_lens=[32, 64, 128], config=BenchConfig(timeout_s=10, **SMALL),
                    log=lambda *a, **k: None)
    points = {p["seq_len"]: p for p in doc["points"]}
    assert [points[t]["status"] for t in (32, 64, 128)] == ["measured", "timeout", "not-run"]
    assert points[32]["peak_extra_bytes"] > 0 and points[32]["memory_error"] is None


def test_a_missing_growth_exponent_says_why():
    from mha_harness.bench.sweep import _fmt_fit
    assert _fmt_fit(None, 2) == "n/a (fewer than 3 lengths: 2 measured)"
    assert _fmt_fit(None, 5) == "n/a (fewer than 3 points above resolution)"


def test_every_backend_of_a_twelve_backend_sweep_gets_its_own_colour_and_marker():
    """matplotlib's default cycle repeats after 10 colours: two backends of the 12-backend quick sweep looked
    alike. Each backend has its own (colour, marker); its Tq = 1 and Tq = 16 series share them."""
    pytest.importorskip("matplotlib")
    from mha_harness.bench.sweep import BenchPoint, _backend_styles
    points = [BenchPoint(f"backend-{i}", "decode", 1024, tq, 1024, True, "forward")
              for i in range(12) for tq in (1, 16)]
    styles = _backend_styles(points)
    assert len(styles) == 12
    assert len({c for c, _ in styles.values()}) == 12 and len({m for _, m in styles.values()}) == 10


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least 2 CPUs")
def test_a_worker_with_fewer_threads_than_cpus_is_pinned_to_that_many():
    """XLA's CPU runtime sizes its pools from the affinity mask, not from XLA_FLAGS: a worker for --threads 1 runs
    on one CPU (every pool it starts inherits that), and its report says which."""
    from mha_harness.bench.worker import BackendWorker
    worker = BackendWorker(NumpyNaive(), 1)
    try:
        status, info = worker.request(("info",), timeout=120)
    finally:
        worker.close()
    assert status == "ok" and len(info["threads"]["cpus"]) == 1, info


def test_pin_cpus_keeps_all_when_threads_cover_them():
    from mha_harness.bench.threads import pin_cpus
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    assert pin_cpus(len(os.sched_getaffinity(0))) is None


def test_a_cross_attention_layer_without_causal_masks_runs_the_one_query_decode_step_unmasked():
    """A stranger's encoder-decoder cross-attention (no causal alignment) measured no decode point: every one was
    "no bottom-right causal mask". With one query, bottom-right sees every key, so the unmasked call is the same
    attention and runs; 16 queries still need the mask and stay skipped with the reason."""
    import dataclasses

    from mha_harness.bench.calls import backend_arguments, unsupported
    backend = NumpyNaive()
    backend.capabilities = dataclasses.replace(backend.capabilities, causal_alignments=())
    one, sixteen = (Shape(1, tq, 64, 32, 4, "float32", True, False) for tq in (1, 16))
    assert unsupported(backend, one) is None
    assert unsupported(backend, sixteen) == "no bottom-right causal mask"
    assert backend_arguments(backend, one)[1].causal is None
    assert backend_arguments(NumpyNaive(), one)[1].causal == "bottom-right"  # a causal backend gets its mask


def test_a_decode_point_run_unmasked_says_so_in_the_json_and_the_table(tmp_path):
    """The one-query decode step of a backend without bottom-right masking runs unmasked; its point recorded only
    the shape's ``causal: true``, so the JSON and the table read as if the call had carried the mask."""
    import dataclasses
    cross = NumpyNaive()
    cross.name = "numpy-naive-cross"
    cross.capabilities = dataclasses.replace(cross.capabilities, causal_alignments=())
    doc = run_bench([cross, NumpyTiled()], tmp_path, seq_lens=[64], config=BenchConfig(workload="decode", **SMALL),
                    query_lens=(1, 16))
    by = {(p["backend"], p["tq"]): p for p in doc["points"]}
    assert by[("numpy-naive-cross", 1)]["call_mask"] == "none" and by[("numpy-naive-cross", 1)]["causal"]
    assert by[("numpy-naive-cross", 1)]["status"] == "measured"
    assert by[("numpy-naive-cross", 16)]["status"] == "skipped"
    assert by[("numpy-tiled", 1)]["call_mask"] == by[("numpy-tiled", 16)]["call_mask"] == "bottom-right"
    rows = [line.split() for line in table([BenchPoint(**p) for p in doc["points"]]).splitlines()]
    assert ["numpy-naive-cross", "fwd", "none"] in [r[:3] for r in rows]
    assert ["numpy-tiled", "fwd", "bottom-right"] in [r[:3] for r in rows]


def test_a_time_exponent_carries_its_points_confidence_intervals():
    """Three medians exactly on a line had stderr 0.00 although each had a +-30 % CI (a stranger's sweep printed
    "time 1.31 +- 0.00"): the points' own uncertainty is added in quadrature."""
    xs, ys = [256, 512, 1024], [1e-3, 2e-3, 4e-3]
    assert stats.fit_exponent(xs, ys)["stderr"] == pytest.approx(0.0, abs=1e-9)
    wide = stats.fit_exponent(xs, ys, rel_ci95=[0.3, 0.3, 0.3])
    sigma = 0.3 / 1.96  # a relative 95 % half-width as the log's standard deviation
    assert wide["exponent"] == pytest.approx(1.0)
    assert wide["stderr"] == pytest.approx(sigma / np.sqrt(2 * np.log(2) ** 2), rel=0.01)


def test_calibration_takes_the_fastest_warm_up_call_so_a_slow_moment_does_not_shrink_samples(monkeypatch):
    """A stranger's 0.39 ms decode step got 3 calls per sample (1.2 ms samples for a 20 ms target): the one call
    that calibrated it had taken 8 ms on a loaded machine. Calibration now takes the fastest of the warm-up's calls
    and of three samples of the estimated size."""
    from mha_harness.bench import calls as calls_module
    from mha_harness.bench.worker import _Server
    began = []

    def step():  # 0.5 ms, but 25 ms in a loaded moment just as the warm-up (0.3 s) ends
        began.append(began[0] if began else time.perf_counter())
        time.sleep(0.025 if 0.28 < time.perf_counter() - began[0] < 0.4 else 0.0005)
    monkeypatch.setattr(calls_module, "prepare_point",
                        lambda backend, shape: types.SimpleNamespace(fn=step, checked_values=lambda value: None))
    server = _Server(NumpyNaive(), 1)
    shape = Shape(1, 1, 64, 32, 4, "float32", True, False)
    answer = server.do_prepare("k", shape, 0.3, 0.02)
    assert answer["calls_per_sample"] >= 20, answer  # 0.02 s / ~0.5-0.6 ms: 34-40; one slow call would give 1
    samples = server.do_sample("k", 3)["samples_s"]
    assert min(samples) * answer["calls_per_sample"] >= 0.015


def test_a_layer_declaring_only_bottom_right_runs_causal_prefill_with_that_mask(tmp_path):
    """A stranger's KV-cache layer (causal_alignments=("bottom-right",), as the README declares one) was skipped
    at every prefill point under --causal on ("no top-left causal mask"), though with Tq = Tk the two alignments
    are the same mask: it now runs with its own alignment, recorded as the call's mask."""
    import dataclasses

    from mha_harness.bench.calls import backend_arguments, unsupported
    decoder = NumpyNaive()
    decoder.name = "numpy-naive-bottom-right"
    decoder.capabilities = dataclasses.replace(decoder.capabilities, causal_alignments=("bottom-right",))
    square = Shape(1, 64, 64, 32, 4, "float32", True, False)
    assert unsupported(decoder, square) is None
    assert backend_arguments(decoder, square)[1].causal == "bottom-right"
    assert backend_arguments(NumpyNaive(), square)[1].causal == "top-left"
    doc = run_bench([decoder], tmp_path, seq_lens=[64], causal="on", backward=True, config=BenchConfig(**SMALL))
    forward, backward = sorted(doc["points"], key=lambda p: p["mode"])
    assert forward["status"] == "measured" and forward["call_mask"] == "bottom-right", forward
    # its skipped forward + backward row (NumpyNaive declares no gradients) showed "top-left" beside it (an outside
    # user's KV-cache layer): a skipped point shows the mask its backend's call would carry
    assert backward["status"] == "skipped" and backward["call_mask"] == "bottom-right", backward
    rows = [line.split()[:3] for line in table([BenchPoint(**p) for p in doc["points"]]).splitlines()]
    assert ["numpy-naive-bottom-right", "fwd+bwd", "bottom-right"] in rows


def test_figures_beyond_this_machines_roofs_are_flagged_not_compared():
    """A stranger's KV-cache plugin filled its cache in prepare() and timed only the step: its decode 'layer
    GFLOP/s' was 30x the machine's GEMM peak and printed as a result beside backends that project K/V in every
    call. A CPU figure past the compute roof is now flagged with the likely reason; one past the memory bandwidth
    says the working set stays in the caches or less was read."""
    from mha_harness.bench.metrics import over_roofs
    decode = Shape(1, 1, 65536, 512, 8, "float32", True, False)
    flagged = over_roofs(decode, 0.031, compute_roof_gflops=91.0, memory_bandwidth_gbs=18.6)
    assert "24.4x the fastest float32 GEMM of this machine's libraries" in flagged["over_compute_roof"]
    assert "prepare()" in flagged["over_compute_roof"]
    assert over_roofs(decode, 1.0, compute_roof_gflops=91.0, memory_bandwidth_gbs=18.6) == {}
    assert "over_compute_roof" not in over_roofs(dataclasses_replace(decode, dtype="bfloat16"), 0.031,
                                                 compute_roof_gflops=91.0)  # half precision: matrix units
    small = Shape(1, 1, 1024, 512, 8, "float32", True, False)
    assert "stays in the caches" in over_roofs(small, 1e-4, memory_bandwidth_gbs=18.6)["over_memory_bandwidth"]


def test_the_compute_roof_is_the_fastest_installed_gemm_not_numpys_alone():
    """With OpenBLAS pinned to an older kernel (OPENBLAS_CORETYPE=Haswell on an AVX-512 box) NumPy's GEMM is half of
    what onnxruntime and XLA reach, and a correct onnxruntime layer was flagged as past "the" roof. Every installed
    library times the same GEMM in a child process; the roof is the largest."""
    import importlib.util

    from mha_harness.bench.gemm_roof import LIBRARIES, gemm_roofs
    roof = gemm_roofs(2)
    installed = [n for n in LIBRARIES if importlib.util.find_spec(n) is not None]
    assert set(roof["by_library"]) == set(installed), roof
    figures = {k: v for k, v in roof["by_library"].items() if isinstance(v, float)}
    assert "numpy" in figures and roof["gflops"] == max(figures.values()) and roof["library"] in figures
    assert all(v > 0 for v in figures.values())


def dataclasses_replace(obj, **changes):
    import dataclasses
    return dataclasses.replace(obj, **changes)


def test_a_backend_that_does_no_work_in_its_timed_call_is_flagged_in_the_table_and_the_json(tmp_path):
    from mha_harness.bench.sweep import roof_warnings
    from tests.bench_plugins import DoesNothingWhenTimed
    doc = run_bench([DoesNothingWhenTimed(), NumpyTiled()], tmp_path, seq_lens=[256], config=BenchConfig(**SMALL))
    by = {p["backend"]: p for p in doc["points"]}
    assert by["does-nothing-when-timed"]["over_compute_roof"] and not by["numpy-tiled"]["over_compute_roof"]
    points = [BenchPoint(**p) for p in doc["points"]]
    assert any(line.split()[:1] == ["does-nothing-when-timed"] and "!" in line for line in table(points).splitlines())
    assert roof_warnings(points)[0].startswith("does-nothing-when-timed: 1 point(s) above the compute roof")


def test_points_timed_next_to_other_work_say_how_loaded_the_machine_was(tmp_path):
    """A stranger's sweep on a machine running a test suite printed CIs of +-2521 % and medians falling as T grew,
    with nothing saying the machine was busy. Each point records the cores other processes kept busy while its
    group was timed; above LOADED_CORES the table marks it 'L' and the sweep ends with a warning."""
    from mha_harness.bench.load import LOADED_CORES
    from mha_harness.bench.sweep import load_warning
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat on this platform")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        doc = run_bench([NumpyTiled()], None, seq_lens=[64], config=BenchConfig(**SMALL))
    finally:
        hog.kill()
        hog.wait()
    [point] = doc["points"]
    assert point["other_cores"] > LOADED_CORES, point
    points = [BenchPoint(**p) for p in doc["points"]]
    assert "cores busy" in load_warning(points)
    [row] = [line for line in table(points).splitlines() if line.split()[:1] == ["numpy-tiled"]]
    assert "%L " in row or "%*L " in row, row


def test_a_loaded_warning_suggests_fewer_threads_when_they_and_the_load_exceed_the_cores():
    """An eleventh stranger's decode figures on a busy 2-core box were ten times slower at the default 2 threads
    than at --threads 1, and the loaded-machine line did not say so; it does when the threads and the others'
    load need more cores than the machine has."""
    from mha_harness.bench.sweep import load_warning
    points = [BenchPoint(backend="b", workload="decode", seq_len=256, tq=1, tk=256, causal=True, mode="forward",
                         status="measured", other_cores=0.99)]
    line = load_warning(points, threads=2, cores=2)
    assert "--threads 1 leaves the others room" in line
    # an outside user read it as contradicting the committed 2-thread figures: it says what each rerun compares with
    assert "the committed ones included, are not comparable" in line and "rerun with --threads 2 once" in line
    assert "--threads" not in load_warning(points, threads=1, cores=2)
    assert "--threads" not in load_warning(points, threads=2, cores=8)


def test_a_group_timed_in_hundredths_of_a_second_still_says_how_loaded_the_machine_was(monkeypatch):
    """CI went red once: a fast group's window (0.04 s) rounded to 0.0 s and 0.0 CPU-s, and the point's
    other_cores became None next to a process keeping a core busy. The cores figure comes from the unrounded
    window: one other core busy over 0.04 s is 1.0, whatever the rounded seconds say."""
    from mha_harness.bench import load
    box = iter([(100.0, 0.0), (100.04 + 0.04, 0.0)])  # the whole box: our 0.04 CPU-s and another core's 0.04
    own = iter([5.0, 5.04])
    monkeypatch.setattr(load, "box_cpu_s", lambda: next(box))
    monkeypatch.setattr(load, "own_cpu_s", lambda pids: next(own))
    conditions = load.LoadMeter(lambda: []).conditions(0.04)
    assert conditions["seconds"] == 0.0 and conditions["other_cpu_s"] == 0.0  # what is shown, rounded
    assert conditions["other_cores"] == pytest.approx(1.0, abs=0.01)


def test_the_time_plot_says_why_a_line_ends_and_why_a_legend_has_no_exponent(tmp_path, monkeypatch):
    """A stranger's time plot ended a hung backend's line with no word, and a legend entry without an exponent gave
    no reason; the plot's note names the points lost (with their status) and those past the compute roof, and each
    legend entry without an exponent says why."""
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mha_harness.bench.sweep import plot
    texts, labels = [], []
    original_text, original_errorbar = Figure.text, Axes.errorbar
    monkeypatch.setattr(Figure, "text", lambda self, x, y, s, *a, **k: (texts.append(s),
                                                                         original_text(self, x, y, s, *a, **k))[1])
    monkeypatch.setattr(Axes, "errorbar", lambda self, *a, **k: (labels.append(k.get("label")),
                                                                 original_errorbar(self, *a, **k))[1])
    hung = [_point("hangs", 128, 2 ** 22, False), _point("hangs", 256, None, None, status="timeout"),
            _point("hangs", 512, None, None, status="not-run")]
    fast = [_point("fast", t, 2 ** 22, False) for t in (128, 256, 512)]
    fast[2].over_compute_roof = "layer 1e6 GFLOP/s ..."
    plot(hung + fast, tmp_path, {"memory_bandwidth_gbs": 10.0})
    note = " ".join(texts)
    assert "hangs: 256 timeout, 512 not-run" in note and "compute roof" in note and "fast: 512" in note, note
    assert "hangs (no exp: too few points)" in labels and any(str(lab).startswith("fast (exp ") for lab in labels)


def test_a_slow_untimed_preparation_is_said_and_a_lost_worker_names_its_phase():
    """An outside user's decode step filled its 16,384-position cache with a prefill that also attended the prompt:
    80 s and 16.6 GB untimed, with nothing printed, and a later run's out-of-memory did not say it came from the
    fill. A point records prepare_s; a preparation of SLOW_PREPARE_S or more is a progress line naming the fill; a
    worker lost while preparing says so."""
    import types

    from mha_harness.bench.sweep import SLOW_PREPARE_S, Sweep, _while
    lines = []
    sweep = types.SimpleNamespace(log=lines.append)
    decode = types.SimpleNamespace(backend="mine", key="decode-tq1-tk16384", workload="decode",
                                   prepare_s=SLOW_PREPARE_S + 70)
    Sweep.say_slow_preparation(sweep, decode)
    assert len(lines) == 1 and "preparing the call took 80.0 s, untimed (prepare_decode_step's cache fill" in lines[0]
    assert "O(Tk^2)" in lines[0]
    Sweep.say_slow_preparation(sweep, types.SimpleNamespace(**{**vars(decode), "prepare_s": SLOW_PREPARE_S / 2}))
    assert len(lines) == 1
    assert "prepare_decode_step filling its cache" in _while(("prepare", "k"), decode)
    assert "filling" not in _while(("prepare", "k"), types.SimpleNamespace(workload="prefill"))
    assert _while(("sample", "k", 3), decode) == ""
