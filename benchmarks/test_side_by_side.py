"""pytest-benchmark side-by-sides: every available backend x sequence length, grouped by length.

    pytest benchmarks/test_side_by_side.py -m benchmark_suite --benchmark-group-by=group
    pytest benchmarks/test_side_by_side.py --benchmark-save=base ...; later --benchmark-compare

Peak extra memory and the metrics of mha_harness.bench.metrics (GFLOP/s, bytes per second and their fractions
of this machine's GEMM peak and memory bandwidth) go into extra_info, so they are saved and compared with the
times. MHA_BENCH_SEQ_LENS (default 256,1024,4096) and MHA_BENCH_BACKENDS (names) narrow the sweep; a plugin comes in
as for asv, MHA_ASV_BACKEND_SPECS=module:object with its folder on PYTHONPATH (then only the specs' backends, and
MHA_BENCH_BACKENDS's). Backends that run only when named (opt_in: the compiled torch backends) are left out unless
MHA_BENCH_BACKENDS names them. Not part of the default test run (tests/ only smoke-runs this file at one small size).

Peak memory is read in a worker process per backend (as `mha-harness bench`'s memory pass reads it): the reading
pins glibc's mmap threshold, which cannot be unpinned, and a pinned threshold in this process would slow every later
timing of a backend that allocates per call.

Every backend runs in this one pytest process, one after another: a framework's thread pool left spinning by the
backend before can slow the next several times (a stranger measured a plugin at 15 ms alone and ~125 ms right after
torch-sdpa-flash-cpu), and there is no confidence interval. Compare one backend with itself across commits
(--benchmark-compare); compare backends with `mha-harness bench`, which times each in its own worker.
"""
from __future__ import annotations

import os

import pytest

from benchmarks._common import SPECS, THREADS, _backend_names, _listed, prepared, registry, roofs

SEQ_LENS = [int(v) for v in os.environ.get("MHA_BENCH_SEQ_LENS", "256,1024,4096").split(",") if v]


def _backends():
    """MHA_BENCH_BACKENDS's names, then MHA_ASV_BACKEND_SPECS's backends, as asv takes them; with neither, every
    available backend that does not run only when named (opt_in)."""
    from mha_harness.registry import opt_in_reason
    if _listed("MHA_BENCH_BACKENDS") or SPECS:
        return _backend_names("MHA_BENCH_BACKENDS")
    return [e.name for e in registry().available() if not opt_in_reason(e)]


@pytest.fixture(scope="module")
def memory_workers():
    """Each backend's memory worker (:class:`~mha_harness.bench.worker.BackendWorker`), started at its first reading,
    closed at the end."""
    workers = {}
    yield workers
    for worker in workers.values():
        worker.close()


def peak_memory(workers: dict, backend, shape) -> tuple[int | None, str]:
    """(peak extra bytes of one call, the method) read in the backend's memory worker; (None, why) when the worker
    could not read it (a skip, an error, a lost worker)."""
    from mha_harness.bench.sweep import BenchConfig
    from mha_harness.bench.worker import BackendWorker, WorkerLost
    if backend.name not in workers:
        workers[backend.name] = BackendWorker(backend, THREADS)
    request = ("memory", repr(shape), shape, BenchConfig.warm_up_s, BenchConfig.min_sample_s)
    try:
        status, value = workers[backend.name].request(request, timeout=600)
    except WorkerLost as exc:
        return None, f"memory worker lost: {exc}"
    if status != "ok":
        return None, f"{status}: {value}"
    return value["peak_extra_bytes"], value["memory_method"]


@pytest.mark.benchmark_suite
@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("backend_name", _backends())
def test_forward(benchmark, memory_workers, backend_name, seq_len):
    from mha_harness.bench.metrics import metrics
    try:
        backend, fn, shape = prepared(backend_name, seq_len, causal=False)
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    benchmark.group = f"T={seq_len}"
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(metrics(shape, benchmark.stats.stats.median, **roofs()))
    peak, method = peak_memory(memory_workers, backend, shape)
    benchmark.extra_info["peak_extra_bytes"] = peak
    benchmark.extra_info["memory_method" if peak is not None else "memory_error"] = method
