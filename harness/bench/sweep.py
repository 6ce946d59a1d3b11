"""The benchmark sweep behind ``mha-harness bench`` and the quick sweep of ``mha-harness run``.

For each sequence length (and causal setting) every backend's prepared callable is warmed up,
then timed in interleaved repeats (the backend order rotates each repeat, so drift on a noisy
machine hits all backends alike); then one call's peak extra memory is measured with the
backend's own method (mha_harness.bench.memory). Reported per point: median, min, max and spread
(max/min) of the times, peak extra bytes, achieved GFLOP/s with the flash-attention formula
4*B*h*Tq*Tk*d_head (half for causal; forward+backward counts 3.5x forward, backward being 2.5x)
and its fraction of this machine's measured float32 GEMM peak. Growth exponents are fitted
log-log per backend and shown in the plot legends and the JSON.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from mha_harness.bench.memory import peak_extra_bytes, pin_mmap_threshold
from mha_harness.contract.api import AttentionConfig, Unsupported
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.util.atomic import check_writable, write_bytes_atomic, write_json_atomic

DEFAULT_SEQ_LENS = (128, 256, 512, 1024, 2048)
SCHEMA_VERSION = "1.0"


@dataclass
class BenchConfig:
    batch: int = 1
    d_model: int = 512
    num_heads: int = 8
    dtype: str = "float32"

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads


@dataclass
class BenchPoint:
    backend: str
    seq_len: int
    causal: bool
    mode: str  # "forward" or "forward+backward"
    times_s: list = field(default_factory=list)
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    spread: float | None = None
    peak_extra_bytes: int | None = None
    memory_method: str | None = None
    gflops: float | None = None
    fraction_of_gemm_peak: float | None = None
    skipped: str | None = None


def attention_flops(config: BenchConfig, seq_len: int, causal: bool, backward: bool) -> float:
    """4*B*h*Tq*Tk*d_head, halved for causal; forward+backward is 3.5x the forward count."""
    flops = 4.0 * config.batch * config.num_heads * seq_len * seq_len * config.d_head
    if causal:
        flops /= 2
    return flops * (3.5 if backward else 1.0)


def gemm_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 GEMM throughput (NumPy's BLAS, best of ``repeats``), the roofline for fractions."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2.0 * n ** 3 / best / 1e9


def warm_up(fn, seconds: float):
    """Call ``fn`` once, then until ``seconds`` have passed: compilation, thread-pool start and first-touch
    allocation stay outside the timings."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < seconds:
        fn()
    return fn


def rotated(names: list, r: int) -> list:
    """``names`` rotated by ``r``: repeat r starts with a different backend, so drift hits all alike."""
    k = r % max(1, len(names))
    return names[k:] + names[:k]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prepare(backend, config: BenchConfig, seq_len: int, causal: bool, backward: bool):
    """(callable, None) or (None, reason)."""
    caps = backend.capabilities
    if config.dtype not in caps.dtypes:
        return None, f"dtype {config.dtype} not declared"
    if causal and "top-left" not in caps.causal_alignments:
        return None, "no top-left causal mask"
    if backward and not caps.gradients:
        return None, "no gradients"
    if caps.max_seq_len and seq_len > caps.max_seq_len:
        return None, f"max_seq_len {caps.max_seq_len}"
    attn = AttentionConfig(config.d_model, config.num_heads)
    inputs = make_inputs(attn, config.batch, seq_len, seed=seq_len, causal="top-left" if causal else None)
    try:
        fn = warm_up(backend.load(make_params(attn, seed=0), dtype=config.dtype).prepare(inputs, backward=backward),
                     0.2)
    except (NotImplementedError, Unsupported) as exc:
        return None, str(exc) or type(exc).__name__
    except MemoryError:
        return None, "out of memory"
    except Exception as exc:  # noqa: BLE001 - a plugin's failure is reported, the sweep goes on
        return None, f"error: {type(exc).__name__}: {exc}"
    return fn, None


def fit_exponent(xs, ys, largest: int = 3) -> float | None:
    """Slope of log(y) against log(x) over the ``largest`` sequence lengths: the growth exponent.

    Small T is dominated by fixed costs (dispatch, projections), so only the largest points are fitted.
    """
    pts = sorted((x, y) for x, y in zip(xs, ys) if y and y > 0)[-largest:]
    if len(pts) < 3:
        return None
    slope, _ = np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)
    return round(float(slope), 3)


def sweep(backends: list, seq_lens, *, causal_modes=(False,), repeats: int = 5, backward: bool = False,
          config: BenchConfig | None = None, progress: bool = True) -> list[BenchPoint]:
    """Time every point (interleaved per point), then measure every point's peak memory.

    Memory comes last, in a second pass over the same prepared callables, because the RSS method
    pins glibc's mmap threshold, which would otherwise slow allocation-heavy backends' timings."""
    config = config or BenchConfig()
    modes = [False, True] if backward else [False]
    total = len(seq_lens) * len(causal_modes) * len(modes)
    bar = _progress(total, progress)
    points: list[BenchPoint] = []
    prepared: list[tuple[BenchPoint, object, object]] = []
    for seq_len in sorted(seq_lens):
        for causal in causal_modes:
            for mode_backward in modes:
                mode = "forward+backward" if mode_backward else "forward"
                here, ready = [], {}
                for backend in backends:
                    point = BenchPoint(backend.name, seq_len, causal, mode)
                    fn, reason = _prepare(backend, config, seq_len, causal, mode_backward)
                    point.skipped = reason
                    if fn is not None:
                        ready[backend.name] = (backend, fn, point)
                    here.append(point)
                names = list(ready)
                for r in range(repeats):  # interleaved: each repeat times every backend once, rotating order
                    for name in rotated(names, r):
                        backend, fn, point = ready[name]
                        if point.skipped:
                            continue
                        try:
                            point.times_s.append(_timed(fn))
                        except Exception as exc:  # noqa: BLE001 - a plugin's failure is reported, the sweep goes on
                            point.skipped = f"error: {type(exc).__name__}: {exc}"
                flops = attention_flops(config, seq_len, causal, mode_backward)
                for backend, fn, point in ready.values():
                    if point.skipped or not point.times_s:
                        point.skipped = point.skipped or "no timing"
                        continue
                    point.median_s = statistics.median(point.times_s)
                    point.min_s, point.max_s = min(point.times_s), max(point.times_s)
                    point.spread = round(point.max_s / point.min_s, 3)
                    point.gflops = round(flops / point.median_s / 1e9, 3)
                    prepared.append((point, backend, fn))
                points += here
                bar(f"T={seq_len}{' causal' if causal else ''} {mode}")
    pin_mmap_threshold()
    for point, backend, fn in prepared:
        point.memory_method = backend.memory_method
        try:
            point.peak_extra_bytes = peak_extra_bytes(fn, backend.memory_method)
        except Exception as exc:  # noqa: BLE001
            point.skipped = f"memory measurement failed: {type(exc).__name__}: {exc}"
    return points


def _progress(total: int, enabled: bool):
    if not enabled:
        return lambda label: None
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def plain(label):
            done[0] += 1
            print(f"  [{done[0]}/{total}] {label}", flush=True)
        return plain
    bar = tqdm(total=total, unit="point", desc="benchmark", leave=False)

    def update(label):
        bar.set_postfix_str(label)
        bar.update(1)
        if bar.n >= total:
            bar.close()
    return update


def series(points: list[BenchPoint]) -> dict[tuple, list[BenchPoint]]:
    """Measured points per (backend, causal, mode), sorted by sequence length."""
    out: dict[tuple, list[BenchPoint]] = {}
    for p in sorted((p for p in points if not p.skipped), key=lambda p: p.seq_len):
        out.setdefault((p.backend, p.causal, p.mode), []).append(p)
    return dict(sorted(out.items()))


def series_key(backend: str, causal: bool, mode: str) -> str:
    return f"{backend}|{'causal' if causal else 'full'}|{mode}"


def fits(points: list[BenchPoint]) -> dict:
    out = {}
    for (backend, causal, mode), series_ in series(points).items():
        lengths = [p.seq_len for p in series_]
        out[series_key(backend, causal, mode)] = {
            "time_exponent": fit_exponent(lengths, [p.median_s for p in series_]),
            "memory_exponent": fit_exponent(lengths, [p.peak_extra_bytes for p in series_])}
    return out


def table(points: list[BenchPoint], peak: float) -> str:
    lines = []
    for seq_len in sorted({p.seq_len for p in points}):
        lines.append(f"\nT = {seq_len}")
        lines.append(f"  {'backend':<26}{'mode':<18}{'causal':<8}{'median ms':>10}{'spread':>8}{'peak MiB':>10}"
                     f"{'GFLOP/s':>9}{'% GEMM':>8}")
        for p in (q for q in points if q.seq_len == seq_len):
            if p.skipped:
                lines.append(f"  {p.backend:<26}{p.mode:<18}{str(p.causal):<8}  skipped: {p.skipped[:60]}")
                continue
            lines.append(f"  {p.backend:<26}{p.mode:<18}{str(p.causal):<8}{p.median_s * 1e3:>10.2f}{p.spread:>8.2f}"
                         f"{p.peak_extra_bytes / 2 ** 20:>10.1f}{p.gflops:>9.1f}{100 * p.gflops / peak:>7.1f}%")
    return "\n".join(lines)


def plot(points: list[BenchPoint], exponents: dict, directory: Path) -> dict[str, Path]:
    """Log-log plots of time and of peak memory against sequence length, one line per backend."""
    import matplotlib
    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt
    paths = {}
    for metric, label, key, filename in (("median_s", "time per call (s)", "time_exponent", "time_vs_seq_len.png"),
                                         ("peak_extra_bytes", "peak extra memory (bytes)", "memory_exponent",
                                          "memory_vs_seq_len.png")):
        fig, ax = plt.subplots(figsize=(8, 5.5))
        for (backend, causal, mode), line in series(points).items():
            exp = exponents.get(series_key(backend, causal, mode), {}).get(key)
            name = backend + (" causal" if causal else "") + (" fwd+bwd" if mode != "forward" else "")
            ax.plot([p.seq_len for p in line], [getattr(p, metric) or np.nan for p in line],
                    marker="o", linestyle="--" if causal or mode != "forward" else "-",
                    label=f"{name} (exponent {exp:.2f})" if exp is not None else name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs sequence length (log-log; fitted growth exponent in legend)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        buffer = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        paths[metric] = write_bytes_atomic(directory / filename, buffer.getvalue())
    return paths


def run_bench(registry, names, results_dir: Path, *, seq_lens=None, causal: str = "off", repeats: int = 5,
              backward: bool = False, quick: bool = False, config: BenchConfig | None = None) -> dict:
    """Sweep, print a table per sequence length, write results/bench/bench.json and the plots."""
    directory = check_writable(Path(results_dir) / "bench", "--results")
    config = config or BenchConfig()
    backends = [registry.get(n).backend for n in names if registry.get(n).available]
    causal_modes = {"off": (False,), "on": (True,), "both": (False, True)}[causal]
    seq_lens = list(seq_lens or DEFAULT_SEQ_LENS)
    print(f"benchmark: {len(backends)} backends x T in {seq_lens}, batch {config.batch}, d_model {config.d_model}, "
          f"{config.num_heads} heads, {config.dtype}, {repeats} interleaved repeats", flush=True)
    start = time.perf_counter()
    peak = gemm_peak_gflops()
    points = sweep(backends, seq_lens, causal_modes=causal_modes, repeats=repeats, backward=backward, config=config)
    for p in points:
        if p.gflops is not None:
            p.fraction_of_gemm_peak = round(p.gflops / peak, 4)
    exponents = fits(points)
    print(table(points, peak))
    print(f"\nfloat32 GEMM peak of this machine (NumPy BLAS, 2048^3): {peak:.1f} GFLOP/s")
    for key, value in exponents.items():
        print(f"  growth exponent {key}: time {value['time_exponent']}, memory {value['memory_exponent']}")
    doc = {"schema": "mha-harness/bench", "schema_version": SCHEMA_VERSION,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "python": platform.python_version(), "gemm_peak_gflops_float32": round(peak, 2)},
           "config": asdict(config), "seq_lens": seq_lens, "repeats": repeats, "quick": quick,
           "flops_formula": "4*B*h*Tq*Tk*d_head (x0.5 causal; x3.5 forward+backward)",
           "seconds": round(time.perf_counter() - start, 1),
           "fits": exponents, "points": [asdict(p) for p in points]}
    write_json_atomic(directory / "bench.json", doc)
    try:
        paths = plot(points, exponents, directory)
        print(f"  plots: {', '.join(str(p) for p in paths.values())}")
    except ImportError:
        print("  plots skipped: matplotlib is not installed (pip install 'mha-harness[bench]')")
    print(f"  json: {directory / 'bench.json'}  ({doc['seconds']} s)")
    return doc
