"""pytest-benchmark side-by-sides: every available backend x sequence length, grouped by length.

    pytest benchmarks/test_side_by_side.py -m benchmark_suite --benchmark-group-by=group
    pytest benchmarks/test_side_by_side.py --benchmark-save=base ...; later --benchmark-compare

Peak extra memory and the metrics of mha_harness.bench.metrics (GFLOP/s, bytes per second and their fractions
of this machine's GEMM peak and memory bandwidth) go into extra_info, so they are saved and compared with the
times. MHA_BENCH_SEQ_LENS and MHA_BENCH_BACKENDS narrow the sweep. Not part of the default test run (tests/
only smoke-runs this file at one small size).
"""
from __future__ import annotations

import os

import pytest

from benchmarks._common import prepared, registry, roofs

SEQ_LENS = [int(v) for v in os.environ.get("MHA_BENCH_SEQ_LENS", "256,1024,4096").split(",") if v]


def _backends():
    wanted = [n for n in os.environ.get("MHA_BENCH_BACKENDS", "").split(",") if n]
    return wanted or [e.name for e in registry().available()]


@pytest.mark.benchmark_suite
@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("backend_name", _backends())
def test_forward(benchmark, backend_name, seq_len):
    from mha_harness.bench.memory import peak_extra_bytes
    from mha_harness.bench.metrics import metrics
    try:
        backend, fn, shape = prepared(backend_name, seq_len, causal=False)
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    benchmark.group = f"T={seq_len}"
    benchmark.extra_info["peak_extra_bytes"] = peak_extra_bytes(fn, backend.memory_method)
    benchmark.extra_info["memory_method"] = backend.memory_method
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(metrics(shape, benchmark.stats.stats.median, **roofs()))
