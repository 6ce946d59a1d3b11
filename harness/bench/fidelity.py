"""Figures that show the benchmarks measure what they claim (``mha-harness fidelity``).

1. **Timing against torch.utils.benchmark.** For every CPU backend at T = 512 and 2048: the median of
   ``mha-harness bench`` with all backends interleaved ("sweep"), the same engine with this backend alone
   ("alone"), and torch.utils.benchmark's ``adaptive_autorange`` on the very same prepared callable, alone in
   the backend's own worker. Targets: sweep within +-10% of adaptive_autorange; sweep within +-5% of alone
   (the interleaving does not slow a backend down).
2. **Memory methods against analytical figures.** Each method the benchmarks use measures a dense kernel whose
   allocations can be counted, at T = 1024 and 2048, in the backend's own worker; target within +-10% of
   a*B*H*T^2*s + b*B*T*d_model*s (score-sized and projection-sized buffers live at the peak, s the itemsize):
   numpy-naive (a=3: scores, scores - max, exp; b=3: q, k, v) with tracemalloc and with RSS; torch-eager (a=3:
   scores, exp(scores - max), weights; b=6: q, k, v, their head-split copies, the merged heads, the output) with
   RSS on CPU and torch.cuda on a GPU; jax-explicit (a=2: XLA fuses the softmax and keeps the scores and their
   exp; b=3: q, k, v) with RSS on CPU and the device statistics on a GPU, and against XLA's own compiled memory
   analysis (temp + output of ``jax.jit(f).lower(...).compile().memory_analysis()``, the buffer assignment: an
   upper bound, since RSS counts only pages touched). Each method's noise floor (an empty call) is printed;
   readings below the method's resolution are flagged.
3. **Harness overhead**: a backend's prepared callable against its direct library call, through the public
   ``AttentionBackend.direct_callable`` hook where a backend offers it (target <= 1.03).
4. **numpy-tiled against numpy-naive** at T = 4096: memory ratio (target <= 1/10), throughput ratio (>= 1).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from mha_harness.bench.memory import resolution_bytes
from mha_harness.bench.metrics import ITEMSIZE, Shape
from mha_harness.bench.sweep import MEASURED, BenchConfig, run_bench
from mha_harness.bench.worker import BackendWorker, WorkerLost
from mha_harness.util.atomic import write_json_atomic

TIMING_SEQ_LENS = (512, 2048)
MEMORY_SEQ_LENS = (2048, 4096)
#: (backend, method, a, b): peak = a*B*H*T^2*s + b*B*T*d_model*s, counted from each kernel's code
MEMORY_KERNELS = (
    ("numpy-naive", "tracemalloc", 3, 3),
    ("numpy-naive", "rss", 3, 3),
    ("torch-eager", "rss", 3, 6),
    ("jax-explicit", "rss", 2, 3),
    ("torch-eager-cuda", "cuda", 3, 6),
    ("jax-explicit-gpu", "jax-device", 2, 3),
)
OVERHEAD_BACKENDS = ("torch-sdpa-flash-cpu", "jax-dpa", "torch-sdpa-flash-cuda", "jax-dpa-xla-gpu")


def _quiet(*args, **kwargs):
    pass


def _medians(doc) -> dict:
    return {(p["backend"], p["seq_len"]): p["median_s"] for p in doc["points"] if p["status"] == MEASURED}


def _ask(worker: BackendWorker, message: tuple, timeout: float = 600):
    status, value = worker.request(message, timeout)
    if status != "ok":
        raise RuntimeError(f"{status}: {value}")
    return value


def timing_agreement(backends: list, config: BenchConfig, seq_lens=TIMING_SEQ_LENS, log=print) -> list[dict]:
    """Sweep median vs alone vs torch.utils.benchmark adaptive_autorange, per backend and T."""
    log(f"timing: {len(backends)} backends interleaved at T = {list(seq_lens)} ...", flush=True)
    sweep = _medians(run_bench(backends, None, seq_lens=seq_lens, config=config, log=_quiet))
    rows = []
    for backend in backends:
        log(f"timing: {backend.name} alone, and torch.utils.benchmark adaptive_autorange ...", flush=True)
        alone = _medians(run_bench([backend], None, seq_lens=seq_lens, config=config, log=_quiet))
        worker = BackendWorker(backend, config.threads, max_bytes=config.max_memory_bytes)
        try:
            for t in seq_lens:
                shape = Shape(config.batch, t, t, config.d_model, config.num_heads, config.dtype)
                row = {"backend": backend.name, "seq_len": t, "sweep_median_s": sweep.get((backend.name, t)),
                       "alone_median_s": alone.get((backend.name, t))}
                try:
                    _ask(worker, ("prepare", "fidelity", shape, config.warm_up_s, config.min_sample_s))
                    row["autorange"] = _ask(worker, ("autorange", "fidelity", 10.0))
                    row["autorange_median_s"] = row["autorange"]["median_s"]
                except (RuntimeError, WorkerLost) as exc:
                    row["autorange_error"] = str(exc)
                if row["sweep_median_s"] and row.get("autorange_median_s"):
                    row["sweep_over_autorange"] = round(row["sweep_median_s"] / row["autorange_median_s"], 4)
                    row["within_10pct"] = abs(row["sweep_over_autorange"] - 1) <= 0.10
                if row["sweep_median_s"] and row["alone_median_s"]:
                    row["sweep_over_alone"] = round(row["sweep_median_s"] / row["alone_median_s"], 4)
                    row["within_5pct"] = abs(row["sweep_over_alone"] - 1) <= 0.05
                rows.append(row)
                log(_timing_line(row), flush=True)
        finally:
            worker.close()
    return rows


def _ms(x):
    return f"{x * 1e3:8.2f}" if x else "     n/a"


def _timing_line(row: dict) -> str:
    a = row.get("sweep_over_autorange")
    b = row.get("sweep_over_alone")
    return (f"  {row['backend']:<24} T={row['seq_len']:<5} sweep {_ms(row['sweep_median_s'])} ms  alone "
            f"{_ms(row['alone_median_s'])} ms  adaptive_autorange {_ms(row.get('autorange_median_s'))} ms  "
            f"sweep/autorange {a if a else 'n/a'} {'ok' if row.get('within_10pct') else 'OUTSIDE +-10%'}  "
            f"sweep/alone {b if b else 'n/a'} {'ok' if row.get('within_5pct') else 'OUTSIDE +-5%'}")


def predicted_bytes(a: int, b: int, shape: Shape) -> int:
    s = ITEMSIZE[shape.dtype]
    return a * shape.batch * shape.num_heads * shape.tq * shape.tk * s + b * shape.batch * shape.tq * shape.d_model * s


def memory_validation(registry, config: BenchConfig, seq_lens=MEMORY_SEQ_LENS, kernels=MEMORY_KERNELS,
                      log=print) -> list[dict]:
    """Each memory method on a countable dense kernel, in the kernel's own worker, against its formula."""
    rows = []
    for name, method, a, b in kernels:
        formula = f"{a}*B*H*T^2*s + {b}*B*T*d_model*s"
        base = {"backend": name, "method": method, "formula": formula}
        entry = registry.entries.get(name)
        reason = "not registered" if entry is None else entry.reason_unavailable
        if reason:
            rows.append({**base, "not_runnable": reason})
            log(f"  memory {method:<11} {name:<18} not runnable here: {reason}")
            continue
        worker = BackendWorker(entry.backend, config.threads, max_bytes=config.max_memory_bytes)
        try:
            floor = _ask(worker, ("memory_floor",)) if method == entry.backend.memory_method else None
            for t in seq_lens:
                shape = Shape(config.batch, t, t, config.d_model, config.num_heads, config.dtype)
                row = {**base, "seq_len": t, "noise_floor_bytes": floor, "resolution_bytes": resolution_bytes(method)}
                try:
                    readings = [_ask(worker, ("memory", f"m{t}", shape, config.warm_up_s, config.min_sample_s,
                                              method))["peak_extra_bytes"] for _ in range(3)]
                    row["measured_bytes"] = int(statistics.median(readings))
                    row["readings_bytes"] = readings
                    row["predicted_bytes"] = predicted_bytes(a, b, shape)
                    row["relative_error"] = round(row["measured_bytes"] / row["predicted_bytes"] - 1, 4)
                    row["within_10pct"] = abs(row["relative_error"]) <= 0.10
                    row["below_resolution"] = row["measured_bytes"] < row["resolution_bytes"]
                    xla = _ask(worker, ("memory_analysis", f"m{t}"))
                    if xla:
                        row["xla_memory_analysis"] = xla
                        row["xla_temp_plus_output_bytes"] = xla["temp"] + xla["output"]
                        row["relative_error_vs_xla"] = round(row["measured_bytes"] / row["xla_temp_plus_output_bytes"]
                                                             - 1, 4)
                        row["within_10pct_of_xla"] = abs(row["relative_error_vs_xla"]) <= 0.10
                except (RuntimeError, WorkerLost) as exc:
                    row["error"] = str(exc)
                rows.append(row)
                log(_memory_line(row), flush=True)
        finally:
            worker.close()
    return rows


def _mib(x):
    return f"{x / 2 ** 20:8.1f}"


def _memory_line(row: dict) -> str:
    if "error" in row:
        return f"  memory {row['method']:<11} {row['backend']:<18} T={row['seq_len']}: error: {row['error']}"
    line = (f"  memory {row['method']:<11} {row['backend']:<18} T={row['seq_len']:<5} measured "
            f"{_mib(row['measured_bytes'])} MiB  {row['formula']} = {_mib(row['predicted_bytes'])} MiB  "
            f"error {100 * row['relative_error']:+5.1f}% {'ok' if row['within_10pct'] else 'OUTSIDE +-10%'}")
    if "xla_temp_plus_output_bytes" in row:
        line += (f"  XLA memory_analysis temp+output {_mib(row['xla_temp_plus_output_bytes'])} MiB "
                 f"({100 * row['relative_error_vs_xla']:+.1f}% "
                 f"{'ok' if row['within_10pct_of_xla'] else 'OUTSIDE +-10%'})")
    if row.get("noise_floor_bytes") is not None:
        line += f"  noise floor {row['noise_floor_bytes'] / 1024:.0f} KiB"
    return line


def harness_overhead(registry, config: BenchConfig, seq_len: int = 1024, rounds: int = 30, log=print) -> list[dict]:
    """Prepared callable vs the backend's direct library call (public hook ``direct_callable``), same inputs."""
    rows = []
    for name in OVERHEAD_BACKENDS:
        entry = registry.entries.get(name)
        if entry is None or entry.reason_unavailable:
            continue
        if not callable(getattr(entry.backend, "direct_callable", None)):
            rows.append({"backend": name, "not_runnable": "the backend offers no direct_callable hook"})
            log(f"  overhead {name}: the backend offers no direct_callable hook")
            continue
        worker = BackendWorker(entry.backend, config.threads, max_bytes=config.max_memory_bytes)
        shape = Shape(config.batch, seq_len, seq_len, config.d_model, config.num_heads, config.dtype)
        try:
            _ask(worker, ("prepare", "o", shape, config.warm_up_s, config.min_sample_s))
            medians = _ask(worker, ("overhead", "o", shape, rounds))
            row = {"backend": name, "seq_len": seq_len, "rounds": rounds, "harness_median_s": medians["harness"],
                   "direct_median_s": medians["direct"], "ratio": round(medians["harness"] / medians["direct"], 4),
                   "target": "<= 1.03"}
        except (RuntimeError, WorkerLost) as exc:
            row = {"backend": name, "error": str(exc)}
        finally:
            worker.close()
        rows.append(row)
        if "ratio" in row:
            log(f"  overhead {name} at T={seq_len}: prepared {row['harness_median_s'] * 1e3:.2f} ms vs direct "
                f"{row['direct_median_s'] * 1e3:.2f} ms, ratio {row['ratio']:.3f} (target <= 1.03)")
        else:
            log(f"  overhead {name}: {row.get('error')}")
    return rows


def tiled_vs_naive(registry, config: BenchConfig, seq_len: int = 4096, log=print) -> dict:
    """numpy-tiled against numpy-naive through the bench engine: peak memory ratio and throughput ratio."""
    backends = [registry.get(n).backend for n in ("numpy-naive", "numpy-tiled")]
    doc = run_bench(backends, None, seq_lens=[seq_len], config=replace(config, budget_s=4.0), log=_quiet)
    points = {p["backend"]: p for p in doc["points"]}
    naive, tiled = points["numpy-naive"], points["numpy-tiled"]
    row = {"seq_len": seq_len, "peak_extra_bytes": {n: p["peak_extra_bytes"] for n, p in points.items()},
           "median_s": {n: p["median_s"] for n, p in points.items()},
           "memory_ratio_tiled_over_naive": round(tiled["peak_extra_bytes"] / naive["peak_extra_bytes"], 4),
           "throughput_ratio_tiled_over_naive": round(naive["median_s"] / tiled["median_s"], 3),
           "targets": {"memory_ratio": "<= 0.1", "throughput_ratio": ">= 1"}}
    log(f"  numpy-tiled vs numpy-naive at T={seq_len}: memory {_mib(tiled['peak_extra_bytes'])} vs "
        f"{_mib(naive['peak_extra_bytes'])} MiB (ratio {row['memory_ratio_tiled_over_naive']:.3f}, target <= 0.1); "
        f"time {tiled['median_s'] * 1e3:.0f} vs {naive['median_s'] * 1e3:.0f} ms (throughput ratio "
        f"{row['throughput_ratio_tiled_over_naive']:.2f}, target >= 1)")
    return row


def run_fidelity(registry, names, results_dir: Path, threads: int = 2, *, timing_budget_s: float = 3.0,
                 log=print) -> dict:
    """All four figures; written to ``<results>/bench/fidelity.json``."""
    import importlib.util
    config = BenchConfig(threads=threads, budget_s=timing_budget_s)
    doc = {"schema": "mha-harness/fidelity", "schema_version": "2.0", "threads": threads,
           "config": {"batch": config.batch, "d_model": config.d_model, "num_heads": config.num_heads,
                      "dtype": config.dtype}}
    path = Path(results_dir) / "bench" / "fidelity.json"
    log("memory methods against analytical figures (each kernel in its own worker):", flush=True)
    doc["memory"] = memory_validation(registry, config, log=log)
    write_json_atomic(path, doc)
    log("harness overhead (prepared callable vs the backend's direct library call):", flush=True)
    doc["overhead"] = harness_overhead(registry, config, log=log)
    write_json_atomic(path, doc)
    log("numpy-tiled vs numpy-naive:", flush=True)
    doc["tiled_vs_naive"] = tiled_vs_naive(registry, config, log=log)
    write_json_atomic(path, doc)
    if importlib.util.find_spec("torch") is None:
        doc["timing"] = "not runnable: torch (torch.utils.benchmark) is not installed"
        log(f"timing: {doc['timing']}")
    else:
        backends = [registry.get(n).backend for n in names]
        doc["timing"] = timing_agreement(backends, config, log=log)
        ok = [r for r in doc["timing"] if r.get("within_10pct")]
        alone_ok = [r for r in doc["timing"] if r.get("within_5pct")]
        log(f"timing: {len(ok)}/{len(doc['timing'])} sweep medians within +-10% of adaptive_autorange; "
            f"{len(alone_ok)}/{len(doc['timing'])} within +-5% of the backend alone")
    write_json_atomic(path, doc)
    log(f"  json: {path}")
    return doc
