"""The benchmark sweep: formulas, fits, JSON and plots, and the pytest-benchmark smoke run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mha_harness.bench.memory import peak_extra_bytes
from mha_harness.bench.sweep import BenchConfig, attention_flops, fit_exponent, run_bench
from mha_harness.registry import load_registry
from tests.conftest import ROOT


def test_flops_follow_the_flash_attention_formula():
    config = BenchConfig(batch=2, d_model=512, num_heads=8)
    assert attention_flops(config, 1024, False, False) == 4 * 2 * 8 * 1024 * 1024 * 64
    assert attention_flops(config, 1024, True, False) == 2 * 2 * 8 * 1024 * 1024 * 64
    assert attention_flops(config, 1024, False, True) == 3.5 * 4 * 2 * 8 * 1024 * 1024 * 64


def test_fit_exponent_recovers_a_power_law_from_the_largest_points():
    xs = [64, 128, 256, 512, 1024]
    ys = [1.0] + [x ** 2 for x in xs[1:]]  # fixed cost at the smallest size is ignored
    assert fit_exponent(xs, ys) == pytest.approx(2.0, abs=1e-6)
    assert fit_exponent(xs[:2], ys[:2]) is None


def test_tracemalloc_sees_numpy_buffers():
    size = 32 * 2 ** 20
    assert peak_extra_bytes(lambda: np.ones(size // 8), "tracemalloc") >= size


def test_rss_method_sees_a_fresh_allocation():
    size = 64 * 2 ** 20
    assert peak_extra_bytes(lambda: np.ones(size // 8), "rss") >= size * 0.9


def test_sweep_writes_json_with_spread_and_fits_and_two_loglog_plots(tmp_path, capsys):
    registry = load_registry()
    doc = run_bench(registry, ["numpy-naive", "numpy-tiled"], tmp_path, seq_lens=[64, 128, 256], repeats=3,
                    config=BenchConfig(d_model=64, num_heads=4))
    out = capsys.readouterr().out
    assert "T = 256" in out and "GFLOP/s" in out and "growth exponent" in out
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["schema"] == "mha-harness/bench" and saved["machine"]["gemm_peak_gflops_float32"] > 0
    point = next(p for p in saved["points"] if p["backend"] == "numpy-naive" and p["seq_len"] == 256)
    assert len(point["times_s"]) == 3 and point["spread"] >= 1.0 and point["peak_extra_bytes"] > 0
    assert point["memory_method"] == "tracemalloc" and 0 < point["fraction_of_gemm_peak"]
    assert saved["fits"]["numpy-naive|full|forward"]["memory_exponent"] > 1.5
    for name in ("time_vs_seq_len.png", "memory_vs_seq_len.png"):
        assert (tmp_path / "bench" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["points"]


def test_unavailable_or_unsupported_points_are_skipped_with_a_reason(tmp_path):
    registry = load_registry()
    doc = run_bench(registry, ["numpy-tiled"], tmp_path, seq_lens=[32], repeats=1, backward=True,
                    config=BenchConfig(d_model=32, num_heads=2))
    backward = [p for p in doc["points"] if p["mode"] == "forward+backward"]
    assert backward and backward[0]["skipped"] == "no gradients"


def test_pytest_benchmark_side_by_side_smoke_run(tmp_path):
    env = {**os.environ, "MHA_BENCH_SEQ_LENS": "64", "MHA_BENCH_BACKENDS": "numpy-naive,numpy-tiled"}
    out = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/test_side_by_side.py", "-q", "-p",
                          "no:cacheprovider", "--benchmark-json", str(tmp_path / "b.json")], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert {b["group"] for b in data["benchmarks"]} == {"T=64"}
    assert all("peak_extra_bytes" in b["extra_info"] and "gflops" in b["extra_info"] for b in data["benchmarks"])
