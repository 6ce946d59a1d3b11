"""Figures that show the benchmarks measure what they claim (``mha-harness fidelity``).

1. **Timing against torch.utils.benchmark.** For every CPU backend at T = 512 and 2048: ``mha-harness bench``'s
   engine in a sweep (a turn right after another backend's turn, as every turn of a sweep is), the same engine
   alone (a turn right after its own), and torch.utils.benchmark's ``adaptive_autorange`` on the very same
   prepared callable in the backend's own worker. The three are taken within about a second, backend by backend,
   over several rounds; each ratio is the median of the per-round ratios. First, a fixed CPU loop timed in
   1-s windows shows how much this machine's speed changes between seconds (a shared host switches between
   regimes: up to 2x here), which is why no ratio is taken between figures seconds apart. Targets: sweep within
   +-10% of adaptive_autorange; sweep within +-5% of alone (the interleaving does not slow a backend down).
   A backend that declares ``always_causal`` (it has no full-attention call) is timed with causal calls, in the
   alignment ``bench --causal on`` gives it (top-left, or bottom-right when that is all it declares), and its rows
   say so (``call_mask``).
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

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from mha_harness.bench.calls import mask_in_call
from mha_harness.bench.load import LoadMeter, fewer_threads_advice
from mha_harness.bench.memory import resolution_bytes
from mha_harness.bench.metrics import ITEMSIZE, Shape
from mha_harness.bench.stats import median_ci
from mha_harness.bench.sweep import MEASURED, BenchConfig, BenchPoint, Sweep, rotated, run_bench, shape_of
from mha_harness.bench.worker import BackendWorker, WorkerLost
from mha_harness.contract.api import AttentionBackend
from mha_harness.util.atomic import write_json_atomic
from mha_harness.util.text import clipped

TIMING_SEQ_LENS = (512, 2048)
TIMING_ROUNDS = 12  # rounds per T: in each, every backend's sweep turn, alone turn and adaptive_autorange
TIMING_MAX_ROUNDS = 36  # more rounds, up to this many, for a backend while a ratio's 95% CI is wider than +-5%
RATIO_CI_TARGET = 0.05
#: (the flag, the ratio, the target's text, its tolerance) of the two timing comparisons: the sweep's median against
#: adaptive_autorange alone, and against the same engine alone
AUTORANGE_TARGET = ("within_10pct", "sweep_over_autorange", "+-10%", 0.10)
ALONE_TARGET = ("within_5pct", "sweep_over_alone", "+-5%", 0.05)
TIMING_TARGETS = (AUTORANGE_TARGET, ALONE_TARGET)
AUTORANGE_MAX_RUN_S = 0.5  # adaptive_autorange's max_run_time in one round
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
#: the targets: prepared callable / direct library call, numpy-tiled's memory and throughput against numpy-naive's
OVERHEAD_MAX, TILED_MEMORY_MAX, TILED_THROUGHPUT_MIN = 1.03, 0.1, 1.0
OVERHEAD_BACKENDS = ("torch-sdpa-flash-cpu", "jax-dpa", "torch-sdpa-flash-cuda", "jax-dpa-xla-gpu")
#: the sections of a fidelity run, in the order they run: ``--section`` name -> the JSON key that holds its figures
SECTIONS = {"memory": "memory", "overhead": "overhead", "tiled-vs-naive": "tiled_vs_naive", "timing": "timing"}


def _quiet(*args, **kwargs):
    pass


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 and x == x and x != float("inf")


def ratio(numerator, denominator, digits: int = 4) -> float | None:
    """numerator / denominator, or None when either is missing, zero or not finite (no comparison possible)."""
    if not (_positive(numerator) and _positive(denominator)):
        return None
    return round(numerator / denominator, digits)


def within(value: float | None, tolerance: float, centre: float = 1.0) -> bool | None:
    """True/False when ``value`` is known, None when it is not (a missing reading is neither ok nor outside)."""
    return None if value is None else abs(value - centre) <= tolerance


def ci_past_target(ci, tolerance: float) -> bool:
    """Whether a ratio's 95 % CI reaches outside ``1 +- tolerance``: the rounds do not establish that the ratio is
    within the target, whatever its median."""
    return ci is not None and (ci[0] < 1.0 - tolerance or ci[1] > 1.0 + tolerance)


def _verdict(ok: bool | None, target: str, ci=None, tolerance: float | None = None) -> str:
    """ok, OUTSIDE or n/a; an OUTSIDE whose 95 % CI includes 1.0 says so: the rounds did not establish a
    difference (too few or too noisy), which is not the same as a difference they establish; an ok whose CI
    reaches past the target (``tolerance``) says so too: its median is within, the rounds do not establish it."""
    if ok is None:
        return "n/a"
    if ok:
        past = tolerance is not None and ci_past_target(ci, tolerance)
        return "ok" + (f" (undetermined: the CI reaches past {target})" if past else "")
    undetermined = ci is not None and ci[0] <= 1.0 <= ci[1]
    return f"OUTSIDE {target}" + (" (undetermined: the CI includes 1.0)" if undetermined else "")


def _medians(doc) -> dict:
    return {(p["backend"], p["seq_len"]): p["median_s"] for p in doc["points"] if p["status"] == MEASURED}


def _ask(worker: BackendWorker, message: tuple, timeout: float = 600):
    status, value = worker.request(message, timeout)
    if status != "ok":
        raise RuntimeError(f"{status}: {value}")
    return value


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def speed_stability(seconds: float = 10.0, window_s: float = 1.0) -> dict:
    """How steady this machine's speed is: a fixed single-threaded CPU loop, timed back to back for ``seconds``;
    the median of each ``window_s`` window relative to the median of all windows. A dedicated core gives ~1.0 for
    every window; a shared host (an SMT sibling or an overcommitted core busy with another tenant, which the
    guest's steal time does not show) switches between speed regimes lasting seconds."""
    def probe():
        total = 0
        for i in range(20_000):
            total += i * i
        return total
    windows: dict[int, list[float]] = {}
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        probe()
        windows.setdefault(int((now - start) / window_s), []).append(time.perf_counter() - now)
    medians = [statistics.median(v) for _, v in sorted(windows.items())]
    centre = statistics.median(medians)
    return {"probe": "pure-Python loop, one thread", "window_s": window_s, "windows": len(medians),
            "probe_median_s": centre, "window_over_median": [round(m / centre, 3) for m in medians],
            "max_over_min": round(max(medians) / min(medians), 3)}


def _cycle(sweep: Sweep, point: BenchPoint, call_s: float, autorange_s: float, autorange_first: bool) -> dict:
    """One backend's figures of one round, taken within about a second: an engine turn right after another
    backend's turn (as every turn of a sweep is), an engine turn right after its own ("alone"), and
    adaptive_autorange on the same prepared callable in the same worker (the last two alternate their order)."""
    figure = {"order": "autorange, then alone" if autorange_first else "alone, then autorange",
              "sweep_s": None, "alone_s": None, "autorange_s": None}
    answer = sweep.turn(point, call_s)
    if answer is None:
        figure["error"] = f"sweep: {point.skipped}"
        return figure
    figure["sweep_s"] = statistics.median(answer["samples_s"])
    steps = ["autorange", "alone"] if autorange_first else ["alone", "autorange"]
    for step in steps:
        if step == "alone":
            answer = sweep.turn(point, call_s)
            if answer is None:
                figure["error"] = f"alone: {point.skipped}"
                return figure
            figure["alone_s"] = statistics.median(answer["samples_s"])
        else:
            sweep.settle(point)
            answer = sweep.ask(point, ("autorange", point.key, autorange_s))
            if answer is None:
                figure["error"] = f"adaptive_autorange: {point.skipped}"
                return figure
            figure["autorange_s"], figure["autorange"] = answer["median_s"], answer
    return figure


def _per_round_ratio(per_round: list[dict], a: str, b: str) -> tuple[list, float | None, tuple | None]:
    """The per-round ratios ``a``/``b`` (None where a figure is missing), their median and the median's 95% CI
    (distribution-free: None under 6 rounds)."""
    ratios = [ratio(f.get(a), f.get(b)) for f in per_round]
    present = [x for x in ratios if x is not None]
    return ratios, _median_or_none(present), median_ci(present)


def _followed_only_itself(per_round: list[dict], backend: str | None) -> bool:
    """Whether every recorded sweep turn of ``backend`` followed its own turn (one backend timed: no other to
    interleave with), so sweep/alone compares nothing."""
    followed = {f["after"] for f in per_round if f.get("after")}
    return backend is not None and followed == {backend}


def _ratios_unsure(per_round: list[dict], backend: str | None = None) -> bool:
    """True while the 95% CI of a median ratio (sweep/alone, sweep/autorange) is wider than +-RATIO_CI_TARGET;
    sweep/alone only where a sweep turn followed another backend's (with one backend it compares nothing)."""
    pairs = (("sweep_s", "alone_s"), ("sweep_s", "autorange_s"))
    if _followed_only_itself(per_round, backend):
        pairs = pairs[1:]
    for a, b in pairs:
        _, centre, ci = _per_round_ratio(per_round, a, b)
        if ci is None or max(centre - ci[0], ci[1] - centre) > RATIO_CI_TARGET * centre:
            return True
    return False


def timing_shape_causal(backend) -> bool:
    """Whether ``backend``'s calls in the timing and overhead comparisons are causal: only for an always-causal
    backend, which has no call without its mask (the alignment is then what ``bench --causal on`` gives it)."""
    return bool(backend.capabilities.always_causal)


def _timing_rounds(sweep: Sweep, group: list[BenchPoint], call_s: dict, t: int, rounds: int, max_rounds: int,
                   autorange_s: float, log) -> dict[str, list[dict]]:
    """The rounds of :func:`timing_agreement` at one T: {backend: [figures of each of its rounds]}."""
    ready = [p for p in group if p.backend in call_s]
    figures: dict[str, list] = {p.backend: [] for p in group}
    previous = ready[-1].backend if ready else None  # the last worker to run (its prepare)
    for r in range(max_rounds):
        active = [p for p in ready if p.backend not in sweep.lost_reason
                  and (r < rounds or _ratios_unsure(figures[p.backend], p.backend))]
        if not active:
            break
        log(f"timing: T = {t}, round {r + 1}: {len(active)} backends, each a turn after another backend's (where "
            "there is another), a turn after its own and adaptive_autorange ...", flush=True)
        meter = LoadMeter(sweep.worker_pids)
        started = time.perf_counter()
        in_round = []
        for point in rotated(active, r):
            if previous == point.backend:  # its sweep turn must follow another backend's: one unrecorded turn
                other = next((p for p in rotated(ready, ready.index(point) + 1)
                              if p.backend != point.backend and p.backend not in sweep.lost_reason), None)
                if other is not None and sweep.turn(other, call_s[other.backend]) is not None:
                    previous = other.backend
            figure = {"after": previous, **_cycle(sweep, point, call_s[point.backend], autorange_s,
                                                autorange_first=r % 2 == 1)}
            previous = point.backend
            figures[point.backend].append(figure)
            in_round.append(figure)
        conditions = meter.conditions(time.perf_counter() - started)
        for figure in in_round:
            figure["round_conditions"] = conditions
        log(f"  round {r + 1}: {conditions['seconds']} s; other processes used {conditions['other_cpu_s']} "
            f"CPU-s, steal {conditions['steal_s']} s", flush=True)
    for point in ready:
        if point.backend in sweep.lost_reason and not figures[point.backend]:
            figures[point.backend].append({"error": sweep.lost_reason[point.backend]})
    return figures


def timing_agreement(backends: list, config: BenchConfig, seq_lens=TIMING_SEQ_LENS, *, rounds: int = TIMING_ROUNDS,
                     max_rounds: int = TIMING_MAX_ROUNDS, autorange_s: float = AUTORANGE_MAX_RUN_S,
                     log=print, payloads: dict | None = None) -> list[dict]:
    """The bench engine's turns in a sweep vs the same engine alone vs torch.utils.benchmark's adaptive_autorange,
    per backend and T, each ratio taken within about a second.

    One worker per backend holds its prepared callable (prepared and calibrated as ``bench`` does). For each T,
    ``rounds`` rounds; in each, backend by backend in an order that rotates every round: one engine turn right
    after another backend's turn (every turn of a sweep follows another backend's: its caches, thread pools and
    recycled pages are what the interleaving costs), one engine turn right after its own (alone: no other
    backend in between), and adaptive_autorange on the same callable (these two alternate their order). A backend
    whose ratios' 95% CIs are still wider than +-5% gets more rounds, up to ``max_rounds`` (another backend's
    unrecorded turn precedes its sweep turn where needed). This machine's speed switches between regimes lasting
    seconds (``speed_stability``: up to 2x here), so figures taken tens of seconds apart, like a whole sweep and a
    later run alone, differ by the regimes they met rather than by the method; within one backend's round they
    meet the same one. Reported: the median over rounds of the per-round ratios with its 95% CI; the medians of
    the sweep turns, alone turns and autorange runs; every round.
    """
    sweep = Sweep(backends, replace(config), None, {"machine": {"gemm_peak_gflops_float32": None,
                                                                "memory_bandwidth_gbs": None}}, log=_quiet,
                  payloads=payloads)
    by_name = {b.name: b for b in backends}
    rows = []
    try:
        for t in seq_lens:
            group = [BenchPoint(b.name, "prefill", t, t, t, timing_shape_causal(b), "forward") for b in backends]
            log(f"timing: T = {t}: preparing {len(backends)} backends ...", flush=True)
            call_s = {p.backend: c for p, c in sweep.prepare_group(group)}
            figures = _timing_rounds(sweep, group, call_s, t, rounds, max(rounds, max_rounds), autorange_s, log)
            for point in group:
                if point.backend not in call_s:
                    figures[point.backend] = [{"error": f"prepare: {point.skipped}"}]
                elif point.backend not in sweep.lost_reason:
                    sweep.ask(point, ("drop", point.key))
            masks = {p.backend: p.call_mask or mask_in_call(by_name[p.backend], shape_of(p, config))
                     for p in group}
            for backend in backends:
                rows.append(_timing_row(backend.name, t, figures[backend.name], masks[backend.name]))
                log(_timing_line(rows[-1]), flush=True)
    finally:
        sweep.close()
    return rows


def _timing_row(name: str, t: int, per_round: list[dict], call_mask: str = "none") -> dict:
    """One backend and T: the mask its calls carried (``call_mask``: none, or the causal alignment of an
    always-causal backend), the per-round figures, their medians, and the medians of the per-round ratios."""
    row = {"backend": name, "seq_len": t, "call_mask": call_mask, "causal": call_mask != "none", "rounds": per_round,
           "sweep_median_s": _median_or_none(f.get("sweep_s") for f in per_round),
           "alone_median_s": _median_or_none(f.get("alone_s") for f in per_round),
           "autorange_median_s": _median_or_none(f.get("autorange_s") for f in per_round)}
    errors = [f["error"] for f in per_round if f.get("error")]
    if errors:
        row["errors"] = errors
    for key, a, b in (("sweep_over_autorange", "sweep_s", "autorange_s"), ("sweep_over_alone", "sweep_s", "alone_s"),
                      ("alone_over_autorange", "alone_s", "autorange_s")):
        ratios, median, ci = _per_round_ratio(per_round, a, b)
        row[f"{key}_per_round"] = ratios
        row[key] = None if median is None else round(median, 4)
        row[f"{key}_ci95"] = None if ci is None else [round(ci[0], 4), round(ci[1], 4)]
    for flag, key, _, tolerance in TIMING_TARGETS:
        row[flag] = within(row[key], tolerance)
    if _followed_only_itself(per_round, name):  # every sweep turn followed its own: the ratio would test nothing
        row["sweep_over_alone"] = row["sweep_over_alone_ci95"] = row["within_5pct"] = None
        row["sweep_over_alone_not_compared"] = ONE_BACKEND
    return row


#: why sweep/alone is not compared when the timing section has one backend (a plugin's check of itself)
ONE_BACKEND = ("not compared: every sweep turn followed this backend's own (no other backend to interleave with); "
               "name another, e.g. --backend numpy-tiled, to see whether the interleaving slows it")


def _stability_line(s: dict) -> str:
    if "error" in s:
        return f"  speed_stability: {s['error']}"
    return (f"  {s['windows']} windows: slowest/fastest {s['max_over_min']} (1.0 on a dedicated core); figures "
            "taken seconds apart can differ by that much, so each timing ratio below is taken within one "
            "backend's round, about a second")


def _ms(x):
    return f"{x * 1e3:8.2f}" if _positive(x) else "     n/a"


def _ratio_text(row: dict, key: str) -> str:
    value, ci = row.get(key), row.get(f"{key}_ci95")
    if value is None:
        return "n/a"
    return f"{value:.3f}" + (f" [{ci[0]:.3f}-{ci[1]:.3f}]" if ci else "")


def _compared(row: dict, target: tuple) -> str:
    """A timing ratio with its CI and its verdict against ``target`` (one of TIMING_TARGETS)."""
    flag, key, text, tolerance = target
    return f"{_ratio_text(row, key)} {_verdict(row.get(flag), text, row.get(f'{key}_ci95'), tolerance)}"


def _timing_line(row: dict) -> str:
    mask = row.get("call_mask") or "none"
    label = f"T={row['seq_len']}" + (f" causal {mask}" if mask != "none" else "")
    line = (f"  {row['backend']:<24} {label:<7} sweep {_ms(row.get('sweep_median_s'))} ms  alone "
            f"{_ms(row.get('alone_median_s'))} ms  adaptive_autorange {_ms(row.get('autorange_median_s'))} ms  "
            f"sweep/autorange {_compared(row, AUTORANGE_TARGET)}  sweep/alone "
            + (row["sweep_over_alone_not_compared"] if row.get("sweep_over_alone_not_compared")
               else _compared(row, ALONE_TARGET)))
    apart = _medians_apart(row)
    if apart:
        line += f"  ({apart})"
    if row.get("errors"):
        line += f"  ({'; '.join(dict.fromkeys(row['errors']))})"
    return line


#: the medians of the sweep's and adaptive_autorange's rounds, each over all rounds, whose own ratio differs from the
#: per-round ratio by more than this factor are said to differ (an outside user read 186 ms against 540 ms beside
#: "sweep/autorange 0.962 ok" as a contradiction)
MEDIANS_APART = 1.25


def _medians_apart(row: dict) -> str:
    """Why the printed medians' own ratio differs from ``sweep/autorange``, when it does by more than MEDIANS_APART:
    the ratio pairs the two methods round by round, each median is over all rounds, and a box whose speed changed
    between rounds moves both medians while each round's pair stays alike; "" otherwise."""
    sweep, autorange, ratio = (row.get(k) for k in ("sweep_median_s", "autorange_median_s", "sweep_over_autorange"))
    if not (_positive(sweep) and _positive(autorange) and _positive(ratio)):
        return ""
    medians = sweep / autorange
    if max(medians / ratio, ratio / medians) <= MEDIANS_APART:
        return ""
    return (f"the medians' own ratio, {medians:.3f}, is not the compared one: sweep/autorange is the median of each "
            "round's ratio, its two methods timed back to back; the box's speed changed between rounds, which moves "
            "each method's median over all rounds")


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
            try:
                floor = _ask(worker, ("memory_floor",)) if method == entry.backend.memory_method else None
            except (RuntimeError, WorkerLost):  # no noise floor is no reason to skip the readings
                floor = None
            for t in seq_lens:
                shape = Shape(config.batch, t, t, config.d_model, config.num_heads, config.dtype)
                row = {**base, "seq_len": t, "noise_floor_bytes": floor, "resolution_bytes": resolution_bytes(method)}
                try:
                    readings = [_ask(worker, ("memory", f"m{t}", shape, config.warm_up_s, config.min_sample_s,
                                              method))["peak_extra_bytes"] for _ in range(3)]
                    row["measured_bytes"] = int(statistics.median(readings))
                    row["readings_bytes"] = readings
                    row["predicted_bytes"] = predicted_bytes(a, b, shape)
                    row["below_resolution"] = row["measured_bytes"] < row["resolution_bytes"]
                    # a reading below the method's resolution is no figure: it is shown as such, never compared
                    measured = None if row["below_resolution"] else row["measured_bytes"]
                    error = ratio(measured, row["predicted_bytes"])
                    row["relative_error"] = None if error is None else round(error - 1, 4)
                    row["within_10pct"] = within(error, 0.10)
                    xla = _ask(worker, ("memory_analysis", f"m{t}"))
                    if xla:
                        row["xla_memory_analysis"] = xla
                        row["xla_temp_plus_output_bytes"] = xla.get("temp", 0) + xla.get("output", 0)
                        vs_xla = ratio(measured, row["xla_temp_plus_output_bytes"])
                        row["relative_error_vs_xla"] = None if vs_xla is None else round(vs_xla - 1, 4)
                        row["within_10pct_of_xla"] = within(vs_xla, 0.10)
                except (RuntimeError, WorkerLost) as exc:
                    row["error"] = str(exc)
                rows.append(row)
                log(_memory_line(row), flush=True)
        finally:
            worker.close()
    return rows


def _mib(x):
    return f"{x / 2 ** 20:8.1f}"


def _pct(x) -> str:
    return "  n/a" if x is None else f"{100 * x:+5.1f}%"


def _memory_line(row: dict) -> str:
    head = f"  memory {row['method']:<11} {row['backend']:<18} T={row.get('seq_len', '?')}"
    if "error" in row:
        return f"{head}: error: {row['error']}"
    if row.get("below_resolution"):
        measured = (f"below resolution ({row['measured_bytes'] / 1024:.0f} KiB < "
                    f"{row['resolution_bytes'] / 1024:.0f} KiB), not compared")
    else:
        measured = (f"measured {_mib(row['measured_bytes'])} MiB  {row['formula']} = {_mib(row['predicted_bytes'])} "
                    f"MiB  error {_pct(row.get('relative_error'))} {_verdict(row.get('within_10pct'), '+-10%')}")
    line = f"{head:<48} {measured}"
    if "xla_temp_plus_output_bytes" in row:
        line += (f"  XLA memory_analysis temp+output {_mib(row['xla_temp_plus_output_bytes'])} MiB "
                 f"({_pct(row.get('relative_error_vs_xla'))} {_verdict(row.get('within_10pct_of_xla'), '+-10%')})")
    if row.get("noise_floor_bytes") is not None:
        line += f"  noise floor {row['noise_floor_bytes'] / 1024:.0f} KiB"
    return line


def harness_overhead(registry, config: BenchConfig, seq_len: int = 1024, rounds: int = 30, log=print,
                     names=None, payloads: dict | None = None) -> list[dict]:
    """Prepared callable vs the backend's direct library call (public hook ``direct_callable``), same inputs;
    for ``names`` (those that offer the hook; a plugin's too), by default the built-ins that do."""
    rows = []
    for name in names or OVERHEAD_BACKENDS:
        entry = registry.entries.get(name)
        if entry is None or entry.reason_unavailable:
            continue
        if names and type(entry.backend).direct_callable is AttentionBackend.direct_callable:
            rows.append({"backend": name, "not_runnable": "no direct_callable (the library call written by hand)"})
            log(f"  overhead {name}: not runnable: it offers no direct_callable")
            continue
        worker = BackendWorker(entry.backend, config.threads, max_bytes=config.max_memory_bytes,
                               payload=(payloads or {}).get(name))
        shape = Shape(config.batch, seq_len, seq_len, config.d_model, config.num_heads, config.dtype,
                      timing_shape_causal(entry.backend))
        try:
            _ask(worker, ("prepare", "o", shape, config.warm_up_s, config.min_sample_s))
            medians = _ask(worker, ("overhead", "o", shape, rounds))
            value = ratio(medians["harness"], medians["direct"])
            row = {"backend": name, "seq_len": seq_len, "call_mask": mask_in_call(entry.backend, shape),
                   "rounds": rounds, "harness_median_s": medians["harness"],
                   "direct_median_s": medians["direct"], "ratio": value, "target": f"<= {OVERHEAD_MAX:g}",
                   "within_target": None if value is None else value <= OVERHEAD_MAX}
        except (RuntimeError, WorkerLost) as exc:
            row = {"backend": name, "error": str(exc)}
        finally:
            worker.close()
        rows.append(row)
        if row.get("ratio") is not None:
            causal = f" causal {row['call_mask']}" if row.get("call_mask", "none") != "none" else ""
            log(f"  overhead {name} at T={seq_len}{causal}: prepared {row['harness_median_s'] * 1e3:.2f} ms vs direct "
                f"{row['direct_median_s'] * 1e3:.2f} ms, ratio {row['ratio']:.3f} "
                f"({_verdict(row['within_target'], row['target'])})")
        else:
            log(f"  overhead {name}: {row.get('error')}")
    return rows


def _memory_figure(point: dict | None) -> tuple[int | None, str]:
    """(bytes, how to show them): None with the reason when the point has no usable memory reading."""
    if point is None:
        return None, "no point"
    if point.get("status") != MEASURED:
        return None, f"{point.get('status')}: {point.get('skipped')}"
    if point.get("peak_extra_bytes") is None:
        return None, f"no reading ({point.get('memory_error') or 'not measured'})"
    if point.get("memory_below_resolution"):
        return None, f"below resolution (< {point['memory_resolution_bytes'] / 2 ** 20:g} MiB)"
    return point["peak_extra_bytes"], f"{point['peak_extra_bytes'] / 2 ** 20:.1f} MiB"


def tiled_vs_naive(registry, config: BenchConfig, seq_len: int = 4096, log=print) -> dict:
    """numpy-tiled against numpy-naive through the bench engine: peak memory ratio and throughput ratio. A missing
    or below-resolution reading, or a point that was not measured, is shown as such (ratio None)."""
    names = ("numpy-naive", "numpy-tiled")
    missing = {n: (registry.entries[n].reason_unavailable if n in registry.entries else "not registered")
               for n in names}
    missing = {n: why for n, why in missing.items() if why}
    row = {"seq_len": seq_len, "targets": {"memory_ratio": f"<= {TILED_MEMORY_MAX:g}",
                                           "throughput_ratio": f">= {TILED_THROUGHPUT_MIN:g}"}}
    if missing:
        row["not_runnable"] = "; ".join(f"{n}: {why}" for n, why in missing.items())
        log(f"  numpy-tiled vs numpy-naive: not runnable here: {row['not_runnable']}")
        return row
    backends = [registry.get(n).backend for n in names]
    doc = run_bench(backends, None, seq_lens=[seq_len], config=replace(config, budget_s=4.0), log=_quiet)
    points = {p["backend"]: p for p in doc["points"]}
    naive, tiled = points.get("numpy-naive"), points.get("numpy-tiled")
    (naive_bytes, naive_text), (tiled_bytes, tiled_text) = _memory_figure(naive), _memory_figure(tiled)
    row["peak_extra_bytes"] = {n: p.get("peak_extra_bytes") for n, p in points.items()}
    row["memory_readings"] = {"numpy-naive": naive_text, "numpy-tiled": tiled_text}
    row["median_s"] = {n: p.get("median_s") for n, p in points.items()}
    row["memory_ratio_tiled_over_naive"] = ratio(tiled_bytes, naive_bytes)
    if tiled_bytes is None and naive_bytes and tiled and tiled.get("memory_below_resolution"):
        # below resolution: the ratio is at most resolution / naive, still a figure against the target
        row["memory_ratio_tiled_over_naive_at_most"] = ratio(tiled["memory_resolution_bytes"], naive_bytes)
    row["throughput_ratio_tiled_over_naive"] = ratio((naive or {}).get("median_s"), (tiled or {}).get("median_s"), 3)
    memory = row["memory_ratio_tiled_over_naive"]
    memory_text = (f"{memory:.3f}" if memory is not None else
                   f"<= {row['memory_ratio_tiled_over_naive_at_most']:.3f}"
                   if "memory_ratio_tiled_over_naive_at_most" in row else "n/a")
    throughput = row["throughput_ratio_tiled_over_naive"]
    bound = memory if memory is not None else row.get("memory_ratio_tiled_over_naive_at_most")
    row["memory_within_target"] = None if bound is None else bound <= TILED_MEMORY_MAX
    row["throughput_within_target"] = None if throughput is None else throughput >= TILED_THROUGHPUT_MIN
    targets = row["targets"]
    log(f"  numpy-tiled vs numpy-naive at T={seq_len}: memory {tiled_text} vs {naive_text} (ratio {memory_text}, "
        f"{_verdict(row['memory_within_target'], targets['memory_ratio'])}); time "
        f"{_ms((tiled or {}).get('median_s')).strip()} vs {_ms((naive or {}).get('median_s')).strip()} ms "
        f"(throughput ratio {'n/a' if throughput is None else f'{throughput:.2f}'}, "
        f"{_verdict(row['throughput_within_target'], targets['throughput_ratio'])})")
    return row


def _section(doc: dict, key: str, path: Path, log, fn):
    """Run one section; an unexpected failure is recorded and printed as that section's error, and the others
    still run (the command completes). Ctrl-C still stops it. The JSON is written after every section."""
    try:
        doc[key] = fn()
    except Exception as exc:  # noqa: BLE001 - one broken comparison must not hide the others' figures
        doc[key] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"  {key}: error: {type(exc).__name__}: {exc}")
    write_json_atomic(path, doc)


def _count(rows, flag: str) -> tuple[int, int, list]:
    """(within, compared, rows without a figure) over ``rows`` for a True/False/None ``flag``."""
    compared = [r for r in rows if r.get(flag) is not None]
    return sum(bool(r[flag]) for r in compared), len(compared), [r for r in rows if r.get(flag) is None]


def summary(doc: dict) -> dict:
    """The issue's done-when figures in one place: how many comparisons are within their targets, the worst ratio,
    and what could not be compared (with the reason)."""
    out: dict = {}
    timing = doc.get("timing")
    if isinstance(timing, list):
        for flag, key, target, tolerance in TIMING_TARGETS:
            ok, n, missing = _count(timing, flag)
            worst = max((r for r in timing if r.get(key) is not None), key=lambda r: abs(r[key] - 1), default=None)
            # outside the target, yet the 95% CI of the median ratio includes 1.0: the rounds cannot tell it apart
            # from no difference (too few or too noisy), as opposed to a difference the rounds establish
            unresolved = [r for r in timing if r.get(flag) is False and r.get(f"{key}_ci95")
                          and r[f"{key}_ci95"][0] <= 1.0 <= r[f"{key}_ci95"][1]]
            # within the target by the median, yet the CI reaches past it: the rounds do not establish it
            loose = [r for r in timing if r.get(flag) is True and ci_past_target(r.get(f"{key}_ci95"), tolerance)]
            out[key] = {"target": target, "within": ok, "compared": n, "outside_with_ci_including_1": len(unresolved),
                        "within_with_ci_past_target": len(loose),
                        "worst": None if worst is None else {"backend": worst["backend"], "seq_len": worst["seq_len"],
                                                             "ratio": worst[key]},
                        "not_compared": [f"{r['backend']} T={r['seq_len']}" for r in missing]}
        rounds = {(r["seq_len"], i): f["round_conditions"] for r in timing for i, f in enumerate(r.get("rounds", []))
                  if f.get("round_conditions", {}).get("other_cpu_s") is not None}
        if rounds:  # CPU seconds of other processes per second of measurement: 1.0 is one core kept busy
            load = max(c["other_cpu_s"] / c["seconds"] for c in rounds.values() if c["seconds"])
            out["timing_conditions"] = {"rounds": len(rounds), "max_other_cores": round(load, 2),
                                        "steal_s": round(sum(c["steal_s"] for c in rounds.values()), 2),
                                        "threads": doc.get("threads"), "cores": os.cpu_count()}
    else:
        out["timing"] = timing
    for key in ("memory", "overhead", "tiled_vs_naive"):  # a section not run, or not runnable here: its reason
        if isinstance(doc.get(key), str):
            out[key] = doc[key]
    stability = doc.get("speed_stability")
    if isinstance(stability, dict) and "max_over_min" in stability:
        out["speed_stability_max_over_min"] = stability["max_over_min"]
    memory = doc.get("memory")
    if isinstance(memory, list):
        methods: dict = {}
        for r in memory:
            m = methods.setdefault(r["method"], {"within": 0, "compared": 0, "not_compared": []})
            if r.get("within_10pct") is None:
                why = r.get("not_runnable") or r.get("error") or ("below resolution" if r.get("below_resolution")
                                                                   else "no figure")
                m["not_compared"].append(f"{r['backend']}{' T=' + str(r['seq_len']) if 'seq_len' in r else ''}: {why}")
            else:
                m["compared"] += 1
                m["within"] += bool(r["within_10pct"])
        out["memory_vs_formula"] = {"target": "+-10%", "methods": methods}
        ok, n, _ = _count([r for r in memory if "xla_temp_plus_output_bytes" in r], "within_10pct_of_xla")
        out["memory_vs_xla"] = {"target": "+-10%", "within": ok, "compared": n}
    overhead = doc.get("overhead")
    if isinstance(overhead, list):
        ok, n, missing = _count(overhead, "within_target")
        out["overhead"] = {"target": f"<= {OVERHEAD_MAX:g}", "within": ok, "compared": n,
                           "not_compared": [f"{r['backend']}: {r.get('not_runnable') or r.get('error')}"
                                            for r in missing]}
    pair = doc.get("tiled_vs_naive")
    if isinstance(pair, dict) and "targets" in pair:
        out["tiled_vs_naive"] = {"memory_ratio": pair.get("memory_ratio_tiled_over_naive",
                                                          pair.get("memory_ratio_tiled_over_naive_at_most")),
                                 "memory_within": pair.get("memory_within_target"),
                                 "throughput_ratio": pair.get("throughput_ratio_tiled_over_naive"),
                                 "throughput_within": pair.get("throughput_within_target"),
                                 "targets": pair["targets"], "not_runnable": pair.get("not_runnable")}
    return out


def _why_not(rows: list[dict]) -> str:
    """The first reason a list of rows holds for having no figure."""
    for r in rows:
        for key in ("not_runnable", "error"):
            if r.get(key):
                return clipped(r[key], 300)
        if r.get("errors"):
            return clipped(r["errors"][0], 300)
        if r.get("below_resolution"):
            return "below resolution"
    return "no figure"


def nothing_compared(doc: dict, names, sections, overhead_names=None) -> list[str]:
    """One line per section of ``sections`` (``--section`` names the user asked for) that compared nothing: for
    ``timing``, per requested backend of ``names`` without one comparison (every T without a ratio); for
    ``overhead``, per backend of ``overhead_names`` (when backends were named) without its ratio, or the whole section
    when no row has one; for ``memory`` and ``tiled-vs-naive``, the section when none of its figures was compared.
    A section that did not run (not runnable here, or its error) compared nothing. Empty: each compared something."""
    lines = []
    for name in sections:
        key = SECTIONS[name]
        value = doc.get(key)
        if not isinstance(value, (list, dict)) or (isinstance(value, dict) and "error" in value):
            text = value if isinstance(value, str) else (value or {}).get("error", "no result")
            lines.append(f"{name}: compared nothing ({text})")
            continue
        if name == "timing":
            for backend in names:
                mine = [r for r in value if r.get("backend") == backend]
                if not any(r.get("within_10pct") is not None or r.get("within_5pct") is not None for r in mine):
                    lines.append(f"timing: compared nothing for {backend} ({_why_not(mine)})")
        elif name == "overhead":
            if overhead_names:
                for backend in overhead_names:
                    mine = [r for r in value if r.get("backend") == backend]
                    if not any(r.get("within_target") is not None for r in mine):
                        why = _why_not(mine) if mine else "no row"
                        lines.append(f"overhead: compared nothing for {backend} ({why})")
            elif not any(r.get("within_target") is not None for r in value):
                why = _why_not(value) if value else "no backend offering direct_callable is available here"
                lines.append(f"overhead: compared nothing ({why})")
        elif name == "memory":
            if not any(r.get("within_10pct") is not None for r in value):
                lines.append(f"memory: compared nothing ({_why_not(value)})")
        elif value.get("memory_within_target") is None and value.get("throughput_within_target") is None:
            lines.append(f"tiled-vs-naive: compared nothing ({value.get('not_runnable') or 'no figure'})")
    return lines


def _log_summary(s: dict, log) -> None:
    log("summary (targets: sweep within +-10% of adaptive_autorange, sweep within +-5% of alone, memory within "
        f"+-10% of the formula and of XLA's memory_analysis, overhead <= {OVERHEAD_MAX:g}, numpy-tiled's memory "
        f"<= {TILED_MEMORY_MAX:g}x and throughput >= {TILED_THROUGHPUT_MIN:g}x numpy-naive's):")
    for key, label in (("sweep_over_autorange", "sweep median / adaptive_autorange alone"),
                       ("sweep_over_alone", "sweep median / same engine alone")):
        if key not in s:
            continue
        v = s[key]
        worst = v["worst"]
        worst_text = f"; worst {worst['backend']} T={worst['seq_len']}: {worst['ratio']}" if worst else ""
        missing = f"; not compared: {', '.join(v['not_compared'])}" if v["not_compared"] else ""
        unresolved = v.get("outside_with_ci_including_1")
        unresolved = (f"; of those outside, {unresolved} have a 95% CI that includes 1.0" if unresolved else "")
        loose = v.get("within_with_ci_past_target")
        loose = (f" ({loose} of them with a 95% CI reaching past it: undetermined)" if loose else "")
        log(f"  {label}: {v['within']}/{v['compared']} within {v['target']}{loose}{worst_text}{unresolved}{missing}")
    if "timing_conditions" in s:
        c = s["timing_conditions"]
        log(f"  while timing: other processes kept up to {c['max_other_cores']} cores busy in a round "
            f"({c['rounds']} rounds), steal {c['steal_s']} s in all"
            + fewer_threads_advice(c.get("threads"), c["max_other_cores"], c.get("cores")))
    if "speed_stability_max_over_min" in s:
        log(f"  machine speed: 1-s windows of a fixed CPU loop differed by up to {s['speed_stability_max_over_min']}x")
    for key in ("timing", "memory", "overhead", "tiled_vs_naive"):
        if isinstance(s.get(key), str):
            log(f"  {key}: {s[key]}")
    for method, v in s.get("memory_vs_formula", {}).get("methods", {}).items():
        missing = f"; not compared: {'; '.join(v['not_compared'])}" if v["not_compared"] else ""
        log(f"  memory {method}: {v['within']}/{v['compared']} within +-10% of the formula{missing}")
    if "memory_vs_xla" in s:
        v = s["memory_vs_xla"]
        log(f"  memory vs XLA memory_analysis: {v['within']}/{v['compared']} within +-10%")
    if isinstance(s.get("overhead"), dict):
        v = s["overhead"]
        missing = f"; not compared: {'; '.join(v['not_compared'])}" if v["not_compared"] else ""
        log(f"  harness overhead (prepared / direct library call): {v['within']}/{v['compared']} within "
            f"{v['target']}{missing}")
    if isinstance(s.get("tiled_vs_naive"), dict):
        v = s["tiled_vs_naive"]
        if v.get("not_runnable"):
            log(f"  numpy-tiled vs numpy-naive: not runnable: {v['not_runnable']}")
        else:
            log(f"  numpy-tiled vs numpy-naive: memory ratio {v['memory_ratio']} "
                f"({_verdict(v['memory_within'], v['targets']['memory_ratio'])}), throughput ratio "
                f"{v['throughput_ratio']} ({_verdict(v['throughput_within'], v['targets']['throughput_ratio'])})")


def run_fidelity(registry, names, results_dir: Path, threads: int = 2, *, log=print, overhead_names=None,
                 sections=None, timing_seq_lens=None, timing_rounds=None, payloads: dict | None = None) -> dict:
    """The figures of the chosen ``sections`` (names of :data:`SECTIONS`; None: all four) and their summary;
    written to ``<results>/bench/fidelity.json`` after every section. A section left out holds a "not run" text
    saying so, and the summary names it: a run of some sections validates only what they measure.
    ``timing_seq_lens`` and ``timing_rounds`` (None: :data:`TIMING_SEQ_LENS`, :data:`TIMING_ROUNDS`) shape the
    timing section: ``timing_rounds`` rounds at each length, up to three times as many for an unsure ratio.
    ``payloads``: backend name -> how its worker rebuilds it (:func:`mha_harness.util.rebuild.backend_payload`:
    from its ``module:object`` spec, so a plugin's factory-made classes need not pickle); others are pickled."""
    import importlib.util
    chosen = list(SECTIONS) if sections is None else [n for n in SECTIONS if n in sections]
    unknown = sorted(set(sections or ()) - set(SECTIONS))
    if unknown:
        raise ValueError(f"sections: got {unknown}; accepted: {', '.join(SECTIONS)}")
    config = BenchConfig(threads=threads)
    seq_lens = tuple(timing_seq_lens or TIMING_SEQ_LENS)
    rounds = timing_rounds or TIMING_ROUNDS
    max_rounds = rounds * TIMING_MAX_ROUNDS // TIMING_ROUNDS
    # 3.2: timing and overhead rows carry call_mask (an always-causal backend is timed with causal calls)
    doc = {"schema": "mha-harness/fidelity", "schema_version": "3.2", "complete": False, "threads": threads,
           "sections": chosen,
           "config": {"batch": config.batch, "d_model": config.d_model, "num_heads": config.num_heads,
                      "dtype": config.dtype, "turn_s": config.turn_s, "timing_seq_lens": list(seq_lens),
                      "timing_rounds": rounds, "timing_max_rounds": max_rounds, "ratio_ci_target": RATIO_CI_TARGET,
                      "autorange_max_run_time_s": AUTORANGE_MAX_RUN_S,
                      "timing_calls": "full attention (call_mask none); a backend that declares always_causal is "
                                      "timed with causal calls in the alignment bench --causal on gives it "
                                      "(call_mask top-left or bottom-right)"}}
    path = Path(results_dir) / "bench" / "fidelity.json"
    left_out = f"not run: not among the chosen sections (--section {' --section '.join(chosen)})"
    for name, key in SECTIONS.items():
        if name not in chosen:
            doc[key] = left_out
    if "memory" in chosen:
        log("memory methods against analytical figures (each kernel in its own worker):", flush=True)
        _section(doc, "memory", path, log, lambda: memory_validation(registry, config, log=log))
    if "overhead" in chosen:
        log("harness overhead (prepared callable vs the backend's direct library call):", flush=True)
        _section(doc, "overhead", path, log,
                 lambda: harness_overhead(registry, config, log=log, names=overhead_names, payloads=payloads))
    if "tiled-vs-naive" in chosen:
        log("numpy-tiled vs numpy-naive:", flush=True)
        _section(doc, "tiled_vs_naive", path, log, lambda: tiled_vs_naive(registry, config, log=log))
    if "timing" in chosen and importlib.util.find_spec("torch") is None:
        doc["timing"] = "not runnable: torch (torch.utils.benchmark) is not installed"
        log(f"timing: {doc['timing']}")
    elif "timing" in chosen:
        log("machine speed (a fixed CPU loop in 1-s windows):", flush=True)
        _section(doc, "speed_stability", path, log, speed_stability)
        log(_stability_line(doc["speed_stability"]), flush=True)
        _section(doc, "timing", path, log,
                 lambda: timing_agreement([registry.get(n).backend for n in names], config, seq_lens, rounds=rounds,
                                          max_rounds=max_rounds, log=log, payloads=payloads))
    doc["summary"] = summary(doc)
    doc["complete"] = True
    write_json_atomic(path, doc)
    _log_summary(doc["summary"], log)
    log(f"  json: {path}")
    return doc
