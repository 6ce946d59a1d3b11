"""Shared set-up for the asv benchmarks: parameters generated from the registry, threads fixed for all.

Every registered backend is a parameter value, so a new plugin is benchmarked with no new
benchmark code. Unavailable backends, and combinations a backend cannot run, raise
NotImplementedError in setup (asv records them as skipped); nothing here fails at import.
Calls are built exactly as ``mha-harness bench`` builds them (mha_harness.bench.calls), and
throughput comes from the same metrics function (mha_harness.bench.metrics).

Environment knobs (for quick runs and tests): MHA_ASV_BACKENDS (comma-separated names),
MHA_ASV_BACKEND_SPECS (comma-separated 'module:object' plugins, as `--backend-spec` takes them; asv keeps
PYTHONPATH from its benchmark processes, so put the plugin's folder in ASV_PYTHONPATH, which asv passes on as
PYTHONPATH),
MHA_ASV_SEQ_LENS (comma-separated lengths), MHA_ASV_MAX_CPU_SEQ (default 8192),
MHA_ASV_DECODE_KV_LENS (default 1024,4096,16384,65536), MHA_ASV_CROSS_KV_LENS and MHA_ASV_CROSS_QUERY_LENS
(bench_cross.py's key/value lengths, default 77,1024,4096, and query lengths, default 128,4096), MHA_ASV_THREADS
(default: the bench default, 2);
bench_layer_features.py's lengths: MHA_ASV_FEATURE_SEQ_LENS (default 1024,4096) and MHA_ASV_FEATURE_KV_LENS (default
4096,65536).
"""
from __future__ import annotations

import os

from mha_harness.bench.threads import DEFAULT_THREADS, pin_cpus, thread_env

THREADS = int(os.environ.get("MHA_ASV_THREADS", DEFAULT_THREADS))
os.environ.update(thread_env(THREADS))  # before any backend imports its framework (BLAS reads these at load)
pin_cpus(THREADS)  # this benchmark process runs on THREADS CPUs (where there are more): XLA sizes its pools so

CPU_SEQ_LENS = (128, 256, 512, 1024, 2048, 4096, 8192)
GPU_SEQ_LENS = (16384, 32768, 65536)
DECODE_KV_LENS = (1024, 4096, 16384, 65536)
DECODE_QUERY_LENS = (1, 16)
#: the cross workload's key/value lengths (`mha-harness bench --workload cross`'s defaults less 256, for asv's time)
#: and query lengths (its defaults: 128, a decoder's chunk; 4096, a 64 x 64 latent's image tokens)
CROSS_KV_LENS = (77, 1024, 4096)
CROSS_QUERY_LENS = (128, 4096)


def _listed(variable: str) -> list[str]:
    return [v.strip() for v in os.environ.get(variable, "").split(",") if v.strip()]


SPECS = _listed("MHA_ASV_BACKEND_SPECS")
_REGISTRY = None


def registry():
    """The registry with MHA_ASV_BACKEND_SPECS's plugins (ValueError for a malformed spec)."""
    global _REGISTRY
    if _REGISTRY is None:
        from mha_harness.registry import load_registry
        _REGISTRY = load_registry(SPECS)
    return _REGISTRY


def _backend_names(variable: str = "MHA_ASV_BACKENDS") -> list[str]:
    """The names ``variable`` lists, then the backends of MHA_ASV_BACKEND_SPECS (with either set, only those, as the
    command line's --backend and --backend-spec); with neither, every registered backend that loaded."""
    wanted = _listed(variable)
    if wanted and not SPECS:
        return wanted
    try:
        entries = list(registry().entries.values())
    except Exception:  # noqa: BLE001 - asv must still import this file (a malformed spec: setup says why)
        return wanted + [s for s in SPECS if s not in wanted]
    if SPECS:  # a spec that failed to import is a row too: its setup skips with the reason
        return wanted + [e.name for e in entries if e.spec in SPECS and e.name not in wanted]
    return [e.name for e in entries if e.backend is not None]


def _ints(variable: str, default) -> list[int]:
    text = os.environ.get(variable, "")
    return [int(v) for v in text.split(",") if v] if text else list(default)


BACKENDS = _backend_names()
SEQ_LENS = _ints("MHA_ASV_SEQ_LENS", CPU_SEQ_LENS + GPU_SEQ_LENS)
KV_LENS = _ints("MHA_ASV_DECODE_KV_LENS", DECODE_KV_LENS)
CROSS_LENS = _ints("MHA_ASV_CROSS_KV_LENS", CROSS_KV_LENS)
CROSS_QUERIES = _ints("MHA_ASV_CROSS_QUERY_LENS", CROSS_QUERY_LENS)
CAUSAL = [False, True]
PARAMS = [BACKENDS, SEQ_LENS, CAUSAL]
PARAM_NAMES = ["backend", "seq_len", "causal"]
MAX_CPU_SEQ = int(os.environ.get("MHA_ASV_MAX_CPU_SEQ", "8192"))
_ROOFS = {}


def roofs() -> dict:
    """This machine's GEMM peak and memory bandwidth, measured once per process like ``mha-harness bench`` does."""
    if not _ROOFS:
        from mha_harness.bench.metrics import gemm_peak_gflops, memory_bandwidth_gbs
        from mha_harness.bench.threads import apply_threads
        apply_threads(THREADS)
        _ROOFS.update(gemm_peak_gflops=gemm_peak_gflops(), memory_bandwidth_gbs=memory_bandwidth_gbs())
    return _ROOFS


def half_dtype(backend) -> str:
    """float32 on CPU; on GPU the first declared half precision (bfloat16, else float16)."""
    if backend.device == "cpu":
        return "float32"
    return next((d for d in ("bfloat16", "float16") if d in backend.capabilities.dtypes), "float32")


def prepared(backend_name: str, seq_len: int, causal: bool, backward: bool = False, tq: int | None = None, *,
             for_memory: bool = False, **layer):
    """(backend, prepared callable, Shape) or NotImplementedError with the reason; ``tq`` given is decode (Tq new
    queries over a cache of ``seq_len`` keys), or with ``cross=True`` cross-attention (Tq queries against ``seq_len``
    keys of another sequence);
    ``layer``: the layer's shape and features beyond the default (``num_kv_heads``, ``rotary``, ``qk_norm``,
    ``sliding_window``: :class:`~mha_harness.bench.metrics.Shape`'s fields), as `mha-harness bench` takes them.

    ``for_memory``: the call is prepared for a peak-memory reading, so glibc's mmap threshold is pinned first
    (:func:`~mha_harness.bench.memory.pin_mmap_threshold`: every large buffer a fresh mapping the ``rss`` method
    sees). Timings keep glibc's default, as `mha-harness bench`'s timing workers do: pinned, every large allocation
    pays fresh pages, and a step that allocates per call (a KV cache grown with a concat) timed 3.2-3.8x slower here
    than in bench."""
    from mha_harness.bench.calls import prepared_call, unsupported
    from mha_harness.bench.memory import pin_mmap_threshold
    from mha_harness.bench.metrics import Shape
    from mha_harness.bench.sweep import BenchConfig, warm_up
    from mha_harness.bench.threads import apply_threads
    from mha_harness.contract.api import Unsupported
    try:
        entry = registry().get(backend_name)
    except ValueError as exc:
        raise NotImplementedError(str(exc)) from None
    reason = entry.reason_unavailable
    if reason:
        raise NotImplementedError(reason)
    backend = entry.backend
    if for_memory:
        pin_mmap_threshold()
    if backend.device == "cpu" and seq_len > MAX_CPU_SEQ and tq is None:
        raise NotImplementedError(f"T={seq_len} is a GPU-only length (CPU sweep stops at {MAX_CPU_SEQ})")
    shape = Shape(1, tq or seq_len, seq_len, 512, 8, half_dtype(backend), causal, backward,
                  cached=tq is not None and not layer.get("cross"), **layer)
    why = unsupported(backend, shape)
    if why:
        raise NotImplementedError(why)
    try:
        fn = prepared_call(backend, shape)
        apply_threads(THREADS)  # before the warm-up: pinning the pools after it left the first timed call cold
        # warmed up as `mha-harness bench` warms a point (compilation, thread pools, first-touch pages): under
        # `asv run --quick` the one timed call is the first after this, and a cold one measured a stranger's
        # 0.39 ms decode step at 5.5 ms
        warm_up(fn, BenchConfig.warm_up_s)
    except (Unsupported, NotImplementedError) as exc:
        raise NotImplementedError(str(exc) or type(exc).__name__) from None
    return backend, fn, shape


def median_call_s(fn, calls: int = 3) -> float:
    import statistics
    import time
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class PreparedBenchmark:
    """Base of the asv benchmark classes: backend x sequence length x causal, prepared callable in setup."""

    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 600
    backward = False
    for_memory = False  # True: a peak-memory benchmark (:func:`prepared`'s for_memory); asv runs each in its process

    def setup(self, backend, seq_len, causal):
        self.backend, self.fn, self.shape = prepared(backend, seq_len, causal, backward=self.backward,
                                                     for_memory=self.for_memory)
