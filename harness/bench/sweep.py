"""The benchmark sweep behind ``mha-harness bench`` and the quick sweep of ``mha-harness run``.

Every backend runs in its own worker process (mha_harness.bench.worker) holding its prepared callables, with
the same thread count (mha_harness.bench.threads). For each point (workload shape) the parent asks each worker
to prepare, warm up and calibrate the call (calls per sample so that a sample lasts ``min_sample_s``), then
interleaves them: round after round, in an order that rotates each round, each backend still open takes one
turn (one untimed call, then its samples) while the others wait idle on a pipe read (the parent first waits until
their thread pools have stopped spin-waiting), until its 95% confidence interval of the median is
within +-``ci_rel`` (mha_harness.bench.stats) or its time budget for the point is spent (``budget_exhausted``).
After the timings, each worker measures the peak extra memory of one call of each of its points with the
backend's own method, in its own process. Throughput comes from mha_harness.bench.metrics.

Workloads: ``prefill`` (Tq = Tk = T, self-attention; causal top-left) and ``decode``: a decode step over a KV
cache filled before it (``LoadedAttention.prepare_decode_step``: the first Tk - Tq positions' keys and values
projected untimed; each timed call projects its Tq new rows, writes their keys and values into the cache, attends
over all Tk and applies W_o), Tq in ``query_lens`` (e.g. 1 and 16 new queries) against Tk = KV length, bottom-right
causal; only for backends with a decode step (the others are skipped, saying so); and ``cross``: cross-attention
(an encoder-decoder's decoder attending to the encoder's states, a diffusion model's image tokens attending to the
text's), Tq in ``query_lens`` queries of one sequence against Tk = ``seq_lens`` keys and values of another (one
x_kv makes both), unmasked, every projection in the call; only for backends that take x_q and x_kv. All take
``BenchConfig.num_kv_heads`` (grouped-query heads; backends without the ``grouped_query`` capability are skipped).
A run in which no backend can run any point stops before the machine's roofs are measured.

The JSON is written atomically after every point with ``"complete": false`` until the end: an interrupted sweep
(Ctrl-C, SIGTERM) keeps every finished point. A backend that hangs, crashes or passes the memory limit is
reported for that point and restarted for the next; after two losses in a row its remaining points are not run.
"""
from __future__ import annotations

import math
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

from mha_harness.bench import stats
from mha_harness.bench.calls import causal_alignment, checked_rows, mask_in_call, unsupported
from mha_harness.bench.gemm_roof import gemm_roofs
from mha_harness.bench.load import LOADED_CORES, LoadMeter, fewer_threads_advice
from mha_harness.bench.memory import resolution_bytes
from mha_harness.bench.metrics import (
    BYTES_FORMULA,
    COMPUTE_ROOF_SLACK,
    FLOPS_FORMULA,
    Shape,
    bandwidth_roof,
    metrics,
    over_roofs,
)
from mha_harness.bench.threads import DEFAULT_THREADS, apply_threads, thread_report
from mha_harness.bench.verify import WRONG_OUTPUT, WrongOutput, check_point
from mha_harness.bench.worker import CRASHED, OUT_OF_MEMORY, TIMEOUT, BackendWorker, WorkerLost, wait_until_idle
from mha_harness.contract.conventions import DEFAULT_QK_NORM_EPS, DEFAULT_ROTARY_BASE
from mha_harness.util.atomic import check_writable, write_bytes_atomic, write_json_atomic
from mha_harness.util.install import install_hint
from mha_harness.util.main_guard import refuse_unguarded_main

DEFAULT_SEQ_LENS = (128, 256, 512, 1024, 2048)
DECODE_KV_LENS = (1024, 4096, 16384, 65536)
DECODE_QUERY_LENS = (1, 16)
#: the cross workload's defaults: key/value lengths (77: a CLIP text encoder's tokens, as a diffusion model's
#: cross-attention sees them) and query lengths (128: a decoder's chunk; 4096: a 64 x 64 latent's image tokens)
CROSS_KV_LENS = (77, 256, 1024, 4096)
CROSS_QUERY_LENS = (128, 4096)
WORKLOADS = ("prefill", "decode", "cross")
#: the workloads whose points pair Tq query lengths with each length of the sweep (the KV length Tk)
QUERY_LENGTH_WORKLOADS = ("decode", "cross")
SCHEMA_VERSION = "2.11"  # 2.1: points record call_mask, other_cores, over_compute_roof, over_memory_bandwidth;
# 2.2: config.num_kv_heads (grouped-query), machine.memory_bandwidth_median_gbs and _calls, roofs_measured;
# 2.3: decode points time a decode step over a filled KV cache (decode_step), not a call projecting all Tk keys; the
# causal FLOPs count the visible (query, key) pairs (nearly all for decode, not half); 2.4: points record
# output_check (the first call's output at a few rows against the float64 reference) and can be "wrong-output";
# 2.5: a forward + backward point's output_check holds its gradients' check (gradients, worst) or why it is unchecked;
# config.bias (--bias: the layer's projections carry biases); 2.6: points record timed_fraction (the share of the
# harness's own clock around the sample requests that the reported samples account for) and can be
# "unaccounted-timing"; 2.7: config.rotary, config.qk_norm and config.sliding_window (--rotary, --qk-norm,
# --sliding-window: the timed layer's features) and the run's causal masking (causal: off, on, both or
# bottom-right); under a sliding window the core FLOPs count the visible pairs exactly (less half the diagonal at
# causal Tq = Tk, as the causal convention) and a decode step's bytes the cache rows its queries see; backends[name]
# records native_causal, native_mask_polarity and what the backend declares (declared_policies); 2.8:
# config.rotary_base and config.qk_norm_eps (--rotary-base, --qk-norm-eps: 10000 and 1e-6 before them); 2.9: points
# record prepare_s (loading the layer and preparing its call, a decode step's cache fill included: untimed); 2.10:
# config.alibi (--alibi: "linear" or "symmetric", the timed layer's ALiBi bias) and declared_policies' alibi; 2.11:
# the cross workload (workload "cross", causal "off", query_lens, cross_call; its points' Tq against Tk = seq_len)
#: preparing a point's call (untimed) this long or longer is said in a progress line
SLOW_PREPARE_S = 10.0
#: what a decode point times, recorded in its document
DECODE_STEP = ("one decode step over a KV cache filled before the timed calls (LoadedAttention.prepare_decode_step): "
               "the keys and values of the first Tk - Tq positions are projected untimed; each call projects its Tq "
               "new rows, writes their keys and values into the cache's last Tq slots, attends over all Tk "
               "(bottom-right causal) and applies W_o")
#: what a cross-attention point times, recorded in its document
CROSS_CALL = ("one cross-attention call: Tq queries projected from x_q, keys and values projected from one x_kv of "
              "Tk positions (another sequence: an encoder's states), unmasked, and W_o; every projection in the call "
              "(a decoder that caches the encoder's keys and values once would time the decode workload's kind of "
              "step instead)")
MAX_CONSECUTIVE_LOSSES = 2  # crashes or out-of-memory in a row before a backend's remaining points are not run
MEASURED, SKIPPED, NOT_RUN = "measured", "skipped", "not-run"
#: a point whose reported samples add up to less than TIMED_FRACTION_MIN of the harness's own clock around the
#: requests that took them, less REQUEST_LATENCY_S per request: the worker's clock or figures were altered (a plugin
#: runs in that worker), not a figure
UNACCOUNTED_TIMING = "unaccounted-timing"
#: an honest worker's samples fill all of a sample request but its round trip: 0.89-0.99 of the clock with the
#: default turns on 2 cores beside another user's load, 0.76 with 20-ms turns (the round trip waiting for a core)
TIMED_FRACTION_MIN = 0.8
#: what one sample request may spend outside its samples on a loaded box (waking the worker and the parent)
REQUEST_LATENCY_S = 0.02


@dataclass
class BenchConfig:
    """What is measured (layer shape, dtype, workload) and how (threads, budgets, limits)."""

    batch: int = 1
    d_model: int = 512
    num_heads: int = 8
    num_kv_heads: int | None = None  # key/value heads; None: num_heads (multi-head); fewer: grouped-query
    bias: bool = False  # the layer's projections carry biases b_q ... b_o
    rotary: str | None = None  # rotary embeddings on q and k: "half_split" or "interleaved" (AttentionConfig.rotary)
    rotary_base: float = DEFAULT_ROTARY_BASE  # their frequencies' base (AttentionConfig.rotary_base; Llama 3's 500000)
    qk_norm: str | None = None  # a norm of q and k after their projections (AttentionConfig.qk_norm)
    qk_norm_eps: float = DEFAULT_QK_NORM_EPS  # its epsilon (AttentionConfig.qk_norm_eps)
    sliding_window: int | None = None  # each query sees its own position and the w - 1 before it
    alibi: str | None = None  # an ALiBi bias by distance on the scores: "linear" or "symmetric" (AttentionConfig.alibi)
    dtype: str = "float32"
    workload: str = "prefill"
    threads: int = DEFAULT_THREADS
    budget_s: float = 2.0  # per backend and point, beyond the minimum samples
    min_sample_s: float = 0.02  # a sample repeats the call until it lasts this long
    turn_s: float = 0.1  # samples per turn add up to about this long
    ci_rel: float = 0.03  # stop when the 95% CI of the median is within +-3%
    warm_up_s: float = 0.2
    timeout_s: float = 120.0  # per request to a worker (prepare, one turn, one memory measurement)
    max_memory_bytes: int | None = None  # a worker above this resident size is killed (default: 80% of MemAvailable)

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def layer_text(self, features: bool = True) -> str:
        """The layer's shape in words, for the printed header and the plots' titles (``features``: with its rotary,
        q/k norm and window named, as the plots' titles need; the header says them in :meth:`features_text`)."""
        kind = "multi-head" if self.kv_heads == self.num_heads else "grouped-query"
        named = "".join(f", {text}" for text in self.feature_names()) if features else ""
        return (f"batch {self.batch}, d_model {self.d_model}, {self.num_heads} heads, num_kv_heads {self.kv_heads} "
                f"({kind}){', biases' if self.bias else ''}{named}, {self.dtype}, {self.threads} "
                f"thread{'' if self.threads == 1 else 's'}")

    def feature_names(self) -> list[str]:
        """The layer's features beyond its shape, in a few words each (the plots' titles)."""
        base = f" base {self.rotary_base:g}" if self.rotary_base != DEFAULT_ROTARY_BASE else ""
        eps = f" eps {self.qk_norm_eps:g}" if self.qk_norm_eps != DEFAULT_QK_NORM_EPS else ""
        return ([f"rotary {self.rotary}{base}"] if self.rotary else []) + \
            ([f"q/k norm {self.qk_norm}{eps}"] if self.qk_norm else []) + \
            ([f"sliding window {self.sliding_window}"] if self.sliding_window is not None else []) + \
            ([f"ALiBi {self.alibi}"] if self.alibi else [])

    def features_text(self) -> str:
        """What the timed layer computes beyond attention's projections and softmax, for the printed header: the
        plain layer (:data:`PLAIN_LAYER`), or its rotary embeddings, q/k norm and sliding window, each with the
        convention the backends are built with, and those it leaves out."""
        if not self.feature_names():
            return PLAIN_LAYER
        has = []
        if self.rotary:
            has.append(f"{self.rotary} rotary embeddings on q and k (base {self.rotary_base:g}; key j at position j, "
                       "query i at i + Tk - Tq)")
        if self.qk_norm:
            has.append(f"a {self.qk_norm} q/k norm (epsilon {self.qk_norm_eps:g}, gains drawn in [0.5, 1.5])")
        if self.sliding_window is not None:
            has.append(f"a sliding window of {self.sliding_window} keys (query at p sees keys j > p - "
                       f"{self.sliding_window})")
        if self.alibi:
            has.append(f"a {self.alibi} ALiBi bias (" + ("-m_h |p - s|" if self.alibi == "symmetric" else
                                                          "-m_h (p - s)") + ", the paper's slopes)")
        missing = [name for name, value in (("rotary embeddings", self.rotary), ("q/k norm", self.qk_norm),
                                            ("sliding window", self.sliding_window), ("ALiBi", self.alibi))
                   if value is None]
        return f"the layer with {', '.join(has)}" + (f"; no {' or '.join(missing)}" if missing else "")

    def features_error(self) -> str | None:
        """Why the layer's features cannot build a layer of this shape (an unknown rotary kind or q/k norm, a
        window that is not a positive integer, rotary embeddings on an odd d_head, a positional feature under the
        cross workload), naming the field and the accepted values; None when they can. A base other than 10000
        without rotary embeddings is refused too (it would time the plain layer under a name that says
        otherwise)."""
        from mha_harness.contract.api import AttentionConfig
        positional = [name for name, value in (("rotary", self.rotary), ("sliding_window", self.sliding_window),
                                               ("alibi", self.alibi)) if value is not None]
        if self.workload == "cross" and positional:
            return (f"{positional[0]}: got {getattr(self, positional[0])!r} with the cross workload; accepted: None "
                    "(a positional feature relates a query's position to a key's in one sequence, and "
                    "cross-attention's keys are another sequence's; --qk-norm times a cross-attention layer's q/k "
                    "norm)")
        if self.rotary is None and self.rotary_base != DEFAULT_ROTARY_BASE:
            return (f"rotary_base: got {self.rotary_base:g} without rotary embeddings; accepted: a base together with "
                    "rotary (--rotary), the base of their frequencies")
        if self.qk_norm is None and self.qk_norm_eps != DEFAULT_QK_NORM_EPS:
            return (f"qk_norm_eps: got {self.qk_norm_eps:g} without a q/k norm; accepted: an epsilon together with "
                    "qk_norm (--qk-norm), the epsilon of that norm")
        try:
            AttentionConfig(self.d_model, self.num_heads, self.num_kv_heads, bias=self.bias, qk_norm=self.qk_norm,
                            qk_norm_eps=self.qk_norm_eps, rotary=self.rotary, rotary_base=self.rotary_base,
                            sliding_window=self.sliding_window, alibi=self.alibi)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return None


#: what the plain timed layer leaves out, in the printed header (an outside user's rotary layer could not tell whether
#: its positions were turned: its plugin gives every token one position where the config has no rotary)
PLAIN_LAYER = ("the plain layer: no rotary embeddings, q/k norm, sliding window or ALiBi (the config's rotary, "
               "qk_norm, sliding_window and alibi are None; --rotary, --qk-norm, --sliding-window and --alibi time "
               "them)")


def kv_heads_error(num_kv_heads, num_heads: int, name: str = "num_kv_heads",
                   heads_name: str = "num_heads") -> str | None:
    """Why ``num_kv_heads`` is not a valid number of key/value heads for ``num_heads`` query heads (None: it is):
    an integer 1 <= N <= num_heads that divides num_heads."""
    divisors = ", ".join(str(k) for k in range(1, num_heads + 1) if num_heads % k == 0)
    accepted = f"accepted: an integer 1 <= N <= {heads_name} ({num_heads}) that divides it: {divisors}"
    if num_kv_heads is None:
        return None
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        return f"{name}: got {num_kv_heads!r}; {accepted}"
    if not 1 <= num_kv_heads <= num_heads:
        return f"{name}: got {num_kv_heads}, outside 1..{num_heads}; {accepted}"
    if num_heads % num_kv_heads:
        return f"{name}: got {num_kv_heads}, which does not divide {heads_name} {num_heads}; {accepted}"
    return None


@dataclass
class BenchPoint:
    backend: str
    workload: str
    seq_len: int  # T for prefill; the KV length Tk for decode and cross
    tq: int
    tk: int
    causal: bool  # the workload's shape: prefill top-left, decode bottom-right
    mode: str  # "forward" or "forward+backward"
    call_mask: str | None = None  # the mask the call carried, or skipped would carry ("top-left", "bottom-right",
    # "none"): calls.mask_in_call
    status: str = NOT_RUN
    skipped: str | None = None  # the reason, when status is not "measured"
    samples_s: list = field(default_factory=list)
    n_samples: int = 0
    calls_per_sample: int | None = None
    median_s: float | None = None
    ci95_s: list | None = None
    ci95_rel_halfwidth: float | None = None
    ci_target_rel: float | None = None
    budget_exhausted: bool | None = None
    min_s: float | None = None
    max_s: float | None = None
    first_call_s: float | None = None
    prepare_s: float | None = None  # untimed: loading the layer and preparing its call (a decode step's cache fill)
    timed_s: float = 0.0  # the reported samples' total: samples_s x calls_per_sample, summed
    wall_s: float = 0.0  # the harness's own clock around the requests that took them
    sample_requests: int = 0
    timed_fraction: float | None = None  # timed_s / wall_s: below TIMED_FRACTION_MIN, UNACCOUNTED_TIMING
    settle_s: float = 0.0  # waited before this point's turns for the other workers' threads to stop spinning
    unsettled_turns: int = 0  # turns that began with another worker still busy after SETTLE_LIMIT_S
    peak_extra_bytes: int | None = None
    memory_method: str | None = None
    memory_resolution_bytes: int | None = None
    memory_below_resolution: bool | None = None
    memory_error: str | None = None
    gflops: float | None = None
    layer_gflops: float | None = None
    gbytes_per_s: float | None = None
    fraction_of_gemm_peak: float | None = None
    fraction_of_memory_bandwidth: float | None = None
    other_cores: float | None = None  # CPU-s of other processes per second while this point's group was timed
    over_compute_roof: str | None = None  # metrics.over_roofs: the figures cannot be the layer's work (CPU)
    over_memory_bandwidth: str | None = None  # above the measured bandwidth: in the caches, or less read
    output_check: dict | None = None  # verify.check_output: the first call's output against the float64 reference

    @property
    def key(self) -> str:
        return f"{self.workload}:{self.tq}x{self.tk}:{'causal' if self.causal else 'full'}:{self.mode}"

    def update(self, values: dict) -> None:
        names = {f.name for f in fields(self)}
        for k, v in values.items():
            if k in names:
                setattr(self, k, v)


def declared_policies(backend) -> dict:
    """How the backend says it does its work, from its declarations (read here, in the parent), recorded with its
    threads and versions in bench.json's ``backends``: its own causal flag and mask polarity (the conformance
    report's policy table, :func:`~mha_harness.contract.api.policy_texts`) and the layer features it declares."""
    from mha_harness.contract.api import policy_texts
    try:
        causal, polarity = policy_texts(backend)
        caps = backend.capabilities
        return {"native_causal": causal, "native_mask_polarity": polarity,
                "declares": {"causal_alignments": list(caps.causal_alignments), "grouped_query": caps.grouped_query,
                             "rotary": list(caps.rotary), "qk_norms": list(caps.qk_norms),
                             "sliding_window": caps.sliding_window, "alibi": list(caps.alibi)}}
    except Exception as exc:  # noqa: BLE001 - a plugin's property that raises costs its record, not the sweep
        return {"declarations_unreadable": f"{type(exc).__name__}: {exc}"}


def _causal_text(causal: str, decode: bool) -> str:
    """The run's causal masking in words, for the printed header."""
    if decode:
        return "causal bottom-right (the new queries are the last positions)"
    return {"off": "no causal mask (--causal off)",
            "on": "causal (--causal on; Tq = Tk, where top-left and bottom-right are one mask)",
            "both": "without and with a causal mask (--causal both)"}[causal]


def shape_of(point: BenchPoint, config: BenchConfig) -> Shape:
    return Shape(config.batch, point.tq, point.tk, config.d_model, config.num_heads, config.dtype, point.causal,
                 point.mode != "forward", config.num_kv_heads, cached=point.workload == "decode",
                 cross=point.workload == "cross", bias=config.bias,
                 rotary=config.rotary, rotary_base=config.rotary_base, qk_norm=config.qk_norm,
                 qk_norm_eps=config.qk_norm_eps, sliding_window=config.sliding_window, alibi=config.alibi)


def plan_points(names, config: BenchConfig, seq_lens, *, causal_modes=(False,), backward=False,
                query_lens=DECODE_QUERY_LENS) -> list[list[BenchPoint]]:
    """Groups of points measured together (one per shape), each with one point per backend, smallest first."""
    modes = ["forward", "forward+backward"] if backward else ["forward"]
    if config.workload == "decode":
        shapes = [(tq, tk, True) for tk in sorted(seq_lens) for tq in query_lens if tq <= tk]
    elif config.workload == "cross":  # more queries than keys too (a diffusion model's image tokens on its text)
        shapes = [(tq, tk, False) for tk in sorted(seq_lens) for tq in query_lens]
    else:
        shapes = [(t, t, c) for t in sorted(seq_lens) for c in causal_modes]
    return [[BenchPoint(n, config.workload, tk, tq, tk, causal, mode) for n in names]
            for tq, tk, causal in shapes for mode in modes]


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Sweep:
    """Runs the planned points over one worker per backend and keeps the JSON document up to date on disk."""

    def __init__(self, backends: list, config: BenchConfig, path: Path | None, doc: dict, *, log=print,
                 payloads: dict | None = None):
        self.config, self.path, self.doc, self.log = config, path, doc, log
        self.backends = {b.name: b for b in backends}
        self.payloads = payloads or {}  # name -> how its worker rebuilds it (mha_harness.util.rebuild)
        if config.max_memory_bytes is None:
            available = _available_bytes()
            config.max_memory_bytes = int(0.8 * available) if available else None
        self.workers: dict[str, BackendWorker] = {}
        self.losses = {name: 0 for name in self.backends}
        self.lost_reason: dict[str, str] = {}
        self.points: list[BenchPoint] = []
        self.infos: dict = {}
        self.wrong_said: dict[tuple, str] = {}  # a wrong output's message, figures aside -> the point that said it

    # -- workers
    def worker(self, name: str) -> BackendWorker:
        if name not in self.workers:
            self.workers[name] = BackendWorker(self.backends[name], self.config.threads,
                                               max_bytes=self.config.max_memory_bytes,
                                               payload=self.payloads.get(name))
        return self.workers[name]

    def ask(self, point: BenchPoint, message: tuple, timeout: float | None = None):
        """One request for ``point``'s backend; the answer's value, or None with the point marked lost/skipped."""
        name = point.backend
        try:
            status, value = self.worker(name).request(message, timeout or self.config.timeout_s)
        except WorkerLost as exc:
            self.losses[name] += 1
            if self.losses[name] >= MAX_CONSECUTIVE_LOSSES or exc.status == "timeout":  # a hang costs a timeout each
                lost = ("timed out" if exc.status == "timeout" and self.losses[name] == 1
                        else f"was lost {self.losses[name]} times in a row (last: {exc.status})")
                self.lost_reason[name] = f"{name}'s worker {lost} at Tq={point.tq} Tk={point.tk} {point.mode}: " \
                                         "its later points are not run"
            point.status, point.skipped = exc.status, str(exc) + _while(message, point)
            self.log(f"  {name} {point.key}: {exc.status}: {point.skipped}")
            return None
        except Exception as exc:  # noqa: BLE001 - e.g. a plugin that cannot be pickled for its worker
            point.status, point.skipped = "error", f"cannot run the backend in a worker: {type(exc).__name__}: {exc}"
            self.lost_reason[name] = point.skipped
            return None
        self.losses[name] = 0
        if status == "ok":
            if name not in self.infos and message[0] == "prepare":
                self.infos[name] = {**(self.ask(point, ("info",)) or {}), **declared_policies(self.backends[name])}
            return value
        point.status = SKIPPED if status == "skip" else status
        point.skipped = value
        if status != "skip":
            self.log(f"  {name} {point.key}: {status}: {value}")
        return None

    def close(self, interrupted: bool = False) -> None:
        for worker in self.workers.values():
            worker.kill() if interrupted else worker.close()

    # -- timing
    def prepare_group(self, group: list[BenchPoint]) -> list[tuple[BenchPoint, float]]:
        """Prepare (load, warm up, calibrate) every point of ``group`` its backend can run, in its worker; the
        others are marked skipped or not run. Returns (point, seconds per call) of the prepared ones."""
        config = self.config
        ready = []
        for point in group:
            if point.backend in self.lost_reason:
                point.status, point.skipped = NOT_RUN, self.lost_reason[point.backend]
                continue
            # a skipped point records the mask this backend's call would carry: a layer that declares only
            # bottom-right showed "top-left" on its skipped fwd+bwd row beside its forward's "bottom-right"
            point.call_mask = mask_in_call(self.backends[point.backend], shape_of(point, config))
            reason = unsupported(self.backends[point.backend], shape_of(point, config))
            if reason:
                point.status, point.skipped = SKIPPED, reason
                continue
            answer = self.ask(point, ("prepare", point.key, shape_of(point, config), config.warm_up_s,
                                      config.min_sample_s))
            if answer is None:
                continue
            point.prepare_s = answer.get("prepare_s")
            self.say_slow_preparation(point)
            if self.output_is_right(point, answer.get("checked")):
                point.first_call_s = answer["first_call_s"]
                point.calls_per_sample = answer["calls_per_sample"]
                ready.append((point, answer["call_s"]))
        return ready

    def say_slow_preparation(self, point: BenchPoint) -> None:
        """A progress line when preparing ``point``'s call (untimed, so in no figure) took SLOW_PREPARE_S or more: an
        outside user's decode step filled its 16,384-position cache with a prefill that also attended the prompt,
        O(Tk^2), for 80 s and 16.6 GB with nothing printed."""
        if point.prepare_s is None or point.prepare_s < SLOW_PREPARE_S:
            return
        what = ("prepare_decode_step's cache fill: a fill that also attends the prompt (its Tk x Tk scores) costs "
                "O(Tk^2) time and memory; projecting the cached positions' keys and values is all a step needs"
                if point.workload == "decode" else "loading the layer and prepare()")
        self.log(f"  {point.backend} {point.key}: preparing the call took {point.prepare_s:.1f} s, untimed ({what})")

    def output_is_right(self, point: BenchPoint, values) -> bool:
        """Check what the point's worker sent of its first call (its output at a few rows, or its gradients) against
        the float64 reference, here in the parent, while every worker waits
        (:func:`~mha_harness.bench.verify.check_point`). A wrong one marks the point ``wrong-output`` (it is not
        timed) and drops its prepared call; a forward + backward point whose gradients the layer does not read is
        timed unchecked, saying so."""
        try:
            point.output_check = check_point(self.backends[point.backend], shape_of(point, self.config), values)
            return True
        except WrongOutput as exc:
            self.mark_wrong(point, exc)
            self.ask(point, ("drop", point.key))
            return False

    def mark_wrong(self, point: BenchPoint, exc: WrongOutput, *, after_timing: bool = False) -> None:
        """Mark ``point`` wrong-output with the check's message: at its first call (``output_check.wrong``), or after
        its timed calls (its samples kept, ``output_check.after_timing.wrong``)."""
        point.status = WRONG_OUTPUT
        if after_timing:
            point.skipped = (f"its first call matched the reference, but the call after its {len(point.samples_s)} "
                             f"timed samples did not: {exc}")
            point.output_check["after_timing"] = {"wrong": str(exc)}
        else:
            point.skipped = str(exc)
            point.output_check = {"rows": len(checked_rows(point.tq)), "wrong": str(exc)}
        first = self.wrong_said.setdefault((point.backend, _without_figures(point.skipped)), point.key)
        if first == point.key:
            self.log(f"  {point.backend} {point.key}: {WRONG_OUTPUT}: {point.skipped}")
        else:  # the same mistake at another length: its figures are in the table's list and bench.json
            self.log(f"  {point.backend} {point.key}: {WRONG_OUTPUT}, the same message as at {first} but for its "
                     "figures")

    def output_still_right(self, point: BenchPoint) -> None:
        """After the point's timed calls, one more call is checked like the first (:meth:`output_is_right`): a call
        that drifts over many calls (state kept between calls, a decode step writing one slot further each time,
        gradients accumulated) turns the point ``wrong-output``, its samples kept but no figure made of them."""
        if not (point.output_check or {}).get("rows"):
            return
        answer = self.ask(point, ("last_output", point.key))
        if answer is None:  # lost on that call: ask() reported it; or a restarted worker, which cannot say
            point.output_check["after_timing"] = "not checked: the worker that timed it is gone"
            return
        try:
            after = check_point(self.backends[point.backend], shape_of(point, self.config), answer["checked"])
            point.output_check["after_timing"] = {"max_error": after["max_error"]}
        except WrongOutput as exc:
            self.mark_wrong(point, exc, after_timing=True)

    def timing_accounted_for(self, point: BenchPoint) -> None:
        """A measured point's samples must account for the harness's own clock around the requests that took them,
        each request's round trip aside (:data:`TIMED_FRACTION_MIN`, :data:`REQUEST_LATENCY_S`): the samples are
        timed in the backend's worker, where the plugin runs and could patch the clock or scale the figures; this
        check runs here, where it cannot (a worker whose figures are half its calls' time or less is caught at the
        default turn length). A point that falls short is :data:`UNACCOUNTED_TIMING`, not a figure."""
        if point.wall_s <= 0:
            return
        point.timed_fraction = round(point.timed_s / point.wall_s, 4)
        allowed = max(point.wall_s - point.sample_requests * REQUEST_LATENCY_S, 0.0)
        if point.timed_s >= TIMED_FRACTION_MIN * allowed:
            return
        point.status = UNACCOUNTED_TIMING
        point.skipped = (f"its worker's {len(point.samples_s)} samples add up to {point.timed_s:.3g} s, "
                         f"{point.timed_fraction:.0%} of the {point.wall_s:.3g} s the harness's own clock measured "
                         f"around the {point.sample_requests} requests that took them (an honest worker's fill all "
                         f"but each request's round trip: at least {TIMED_FRACTION_MIN:.0%} of the clock less "
                         f"{REQUEST_LATENCY_S * 1e3:.0f} ms per request): the clock or the figures were altered in "
                         "the worker, where the plugin runs (time.perf_counter patched, samples scaled); not a figure")
        self.log(f"  {point.backend} {point.key}: {UNACCOUNTED_TIMING}: {point.skipped}")

    def turn(self, point: BenchPoint, call_s: float) -> dict | None:
        """One turn of a prepared point: wait for the other workers to idle, then about ``turn_s`` of samples
        (at least one) in its worker. The worker's answer ({samples_s}) with the harness's own clock around the
        samples (``wall_s``) and around the whole turn (``spent_s``, what the budget counts), or None when the
        point is lost."""
        sample_s = call_s * point.calls_per_sample
        count = max(1, min(stats.MIN_SAMPLES, round(self.config.turn_s / max(sample_s, 1e-9))))
        self.settle(point)
        # each turn starts with one untimed call: after another backend's turn the caches, the thread pools and
        # the kernel's recycled pages are cold; numpy-naive's first call at T = 2048 paid 1.3-2.5x for fresh
        # transparent huge pages (measured by mha-harness fidelity), slower than alone. It is a request of its
        # own, so that the sample request holds the timed calls alone and this clock can hold them to account
        start = time.perf_counter()
        if self.ask(point, ("warm", point.key)) is None:
            return None
        sampling = time.perf_counter()
        answer = self.ask(point, ("sample", point.key, count))
        if answer is not None:
            answer["wall_s"] = time.perf_counter() - sampling
            answer["spent_s"] = time.perf_counter() - start
        return answer

    def run_group(self, group: list[BenchPoint]) -> None:
        """Interleave ``group``'s points turn by turn, in an order that rotates each round, until each point's CI
        reaches the target or its budget is spent."""
        config = self.config
        ready = self.prepare_group(group)
        meter, started = LoadMeter(self.worker_pids), time.perf_counter()
        spent = {p.backend: 0.0 for p, _ in ready}
        open_ = [p for p, _ in ready]
        call_s = {p.backend: c for p, c in ready}
        r = 0
        while open_:
            for point in rotated(open_, r):
                answer = self.turn(point, call_s[point.backend])
                if answer is None:
                    open_.remove(point)
                    continue
                point.samples_s += answer["samples_s"]
                point.timed_s += sum(answer["samples_s"]) * point.calls_per_sample
                point.wall_s += answer["wall_s"]
                point.sample_requests += 1
                spent[point.backend] += answer["spent_s"]
                if answer["samples_s"]:  # calls slower than calibrated (a loaded box): the next turns stay ~turn_s
                    call_s[point.backend] = max(call_s[point.backend], statistics.median(answer["samples_s"]))
                done = stats.converged(point.samples_s, config.ci_rel)
                if len(point.samples_s) >= stats.MIN_SAMPLES and (done or spent[point.backend] >= config.budget_s):
                    point.budget_exhausted = not done
                    point.status = MEASURED
                    open_.remove(point)
            r += 1
        for point in group:
            if point.status == MEASURED:
                self.timing_accounted_for(point)
            if point.status == MEASURED:
                self.output_still_right(point)
        other = meter.conditions(time.perf_counter() - started)["other_cores"]
        roofs = {"gemm_peak_gflops": self.doc["machine"]["gemm_peak_gflops_float32"],
                 "memory_bandwidth_gbs": self.doc["machine"]["memory_bandwidth_gbs"]}
        beyond = {"compute_roof_gflops": self.doc["machine"].get("compute_roof_gflops_float32"),
                  "memory_bandwidth_gbs": roofs["memory_bandwidth_gbs"]}
        for point in group:
            if point.status == MEASURED:
                point.other_cores = other
                point.update(stats.summary(point.samples_s, point.calls_per_sample, point.budget_exhausted,
                                           config.ci_rel))
                shape = shape_of(point, config)
                point.update(metrics(shape, point.median_s, **roofs))
                if getattr(self.backends[point.backend], "device", "cpu") == "cpu":  # the roofs are this CPU's
                    point.update(over_roofs(shape, point.median_s, **beyond))
            elif point.samples_s:  # lost mid-point: keep what was measured, but it is not a result
                point.update({"n_samples": len(point.samples_s)})

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (what a LoadMeter counts as the harness's own CPU)."""
        return [w.pid for w in self.workers.values() if w.pid is not None]

    def settle(self, point: BenchPoint) -> None:
        """Before ``point``'s turn, wait until every other backend's worker is idle: thread pools that spin-wait
        after a call (OpenBLAS ~0.1 s, ONNX Runtime ~0.05 s) would otherwise run next to the one being timed."""
        others = [w.pid for name, w in self.workers.items() if name != point.backend and w.pid is not None]
        waited, settled = wait_until_idle(others)
        point.settle_s = round(point.settle_s + waited, 4)
        if not settled:
            point.unsettled_turns += 1

    # -- memory
    def measure_memory(self, point: BenchPoint) -> bool:
        """Peak extra memory of one call, in the backend's worker; a failure leaves the timing and says why.
        False when the worker was lost (timeout, crash, out of memory)."""
        status, reason = point.status, point.skipped
        answer = self.ask(point, ("memory", point.key, shape_of(point, self.config), self.config.warm_up_s,
                                  self.config.min_sample_s))
        if answer is None:
            lost = point.status in (TIMEOUT, CRASHED, OUT_OF_MEMORY)
            point.memory_error = f"{point.status}: {point.skipped}"
            point.status, point.skipped = status, reason
            return not lost
        point.update(answer)
        point.memory_resolution_bytes = resolution_bytes(point.memory_method)
        point.memory_below_resolution = point.peak_extra_bytes < point.memory_resolution_bytes
        return True

    # -- the whole sweep
    def run(self, groups: list[list[BenchPoint]], progress=None) -> list[BenchPoint]:
        for i, group in enumerate(groups):
            self.run_group(group)
            self.points += group
            self.save()
            if progress:
                progress(i, group)
        for name in self.backends:  # memory after every timing: the RSS method pins glibc's mmap threshold
            if name in self.workers:  # a fresh worker: no heap or allocator cache left by the timing runs
                self.workers[name].close()  # quit, so a plugin's own pools (inductor's compile workers) exit cleanly
            # a backend lost later in the sweep (e.g. a timeout at the longest length) still gets the memory of the
            # points it did measure; its memory pass stops at the first worker lost there
            memory_lost = None
            for point in self.points:
                if point.backend != name or point.status != MEASURED:
                    continue
                if memory_lost:
                    point.memory_error = f"not measured: the memory pass lost {name}'s worker ({memory_lost})"
                elif not self.measure_memory(point):
                    memory_lost = point.memory_error
            self.save()
        return self.points

    def save(self, complete: bool = False) -> None:
        self.doc["complete"] = complete
        self.doc["backends"] = self.infos
        self.doc["points"] = [asdict(p) for p in self.points]
        self.doc["fits"] = fits(self.points)
        if self.path is not None:
            write_json_atomic(self.path, self.doc)


def rotated(items: list, r: int) -> list:
    """``items`` rotated by ``r``: round r starts with a different backend, so drift hits all alike."""
    k = r % max(1, len(items))
    return items[k:] + items[:k]


def warm_up(fn, seconds: float):
    """Call ``fn`` once, then until ``seconds`` have passed: compilation, thread-pool start and first-touch
    allocation stay outside the timings."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < seconds:
        fn()
    return fn


# ---------------------------------------------------------------- fits, table, plots

def series(points: list[BenchPoint]) -> dict[tuple, list[BenchPoint]]:
    """Measured points per (backend, workload, tq for decode and cross, causal, mode), sorted by length."""
    out: dict[tuple, list[BenchPoint]] = {}
    for p in sorted((p for p in points if p.status == MEASURED), key=lambda p: p.seq_len):
        tq = p.tq if p.workload in QUERY_LENGTH_WORKLOADS else None
        out.setdefault((p.backend, p.workload, tq, p.causal, p.mode), []).append(p)
    return dict(sorted(out.items(), key=lambda kv: tuple(str(x) for x in kv[0])))


def series_key(backend: str, workload: str, tq, causal: bool, mode: str) -> str:
    shape = f"{workload} tq={tq}" if workload in QUERY_LENGTH_WORKLOADS else ("causal" if causal else "full")
    return f"{backend}|{shape}|{mode}"


def fits(points: list[BenchPoint]) -> dict:
    """Time and memory growth exponents per series, with stderr; memory only over points above resolution."""
    out = {}
    for key, line in series(points).items():
        lengths = [p.seq_len for p in line]
        memory = [p.peak_extra_bytes if p.peak_extra_bytes is not None and not p.memory_below_resolution else None
                  for p in line]
        floor = max([p.memory_resolution_bytes or 0 for p in line] or [0])
        out[series_key(*key)] = {"time": stats.time_fit(lengths, [p.median_s for p in line],
                                                                 [p.ci95_rel_halfwidth for p in line]),
                                 "memory": stats.memory_fit(lengths, memory, floor)}
    return out


def _fmt_fit(fit: dict | None, lengths: int | None = None, axis: str = "T") -> str:
    """A fit for the console; ``lengths``: how many distinct lengths the series has (names the reason for n/a);
    ``axis``: what the lengths are (T for prefill, the KV length for decode). The stderr keeps three significant
    digits: 0.498 printed as 0.50 read as the 0.5 limit of an undetermined fit."""
    if fit is None:
        if lengths is not None and lengths < 3:
            return f"n/a (fewer than 3 lengths: {lengths} measured)"
        return "n/a (fewer than 3 points above resolution)"
    if "measurement_error" in fit:
        return f"MEASUREMENT ERROR: {fit['measurement_error']}"
    return f"{fit['exponent']:.2f} +- {fit['stderr']:.3g} ({axis} in {fit['points']})"


def _fmt_memory(p: BenchPoint) -> str:
    if p.peak_extra_bytes is None:
        return "n/a"
    if p.memory_below_resolution:
        return f"<{_mib(p.memory_resolution_bytes)}"
    return f"{p.peak_extra_bytes / 2 ** 20:.1f}"


#: the longest skip reason a table row shows whole; a longer one is cut there and printed whole after the table
_ROW_REASON = 90


def _without_figures(reason: str) -> str:
    """``reason`` with its numbers (lengths, errors, times) replaced: two points' reasons alike but for them are one
    reason."""
    return re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "N", reason)


def table(points: list[BenchPoint]) -> str:
    lines = []
    width = max([24, *(len(p.backend) + 2 for p in points)])  # a long plugin name keeps its columns apart
    for key in sorted({(p.workload, p.tq, p.tk) for p in points}, key=lambda k: (k[2], k[1])):
        workload, tq, tk = key
        label = "T" if workload == "prefill" else f"{workload} Tq = {tq}, KV"
        lines.append(f"\n{label} = {tk}")
        lines.append(f"  {'backend':<{width}}{'mode':<9}{'mask':<13}{'median ms':>10}{'95% CI +-':>12}{'n':>5}"
                     f"{'x best':>8}{'calls':>7}{'peak MiB':>9}{'core GFLOP/s':>13} {'core %GEMM':>11}{'GB/s':>9}"
                     f"{'%BW':>9}")
        rows = [q for q in points if (q.workload, q.tq, q.tk) == key]
        best = fastest(rows)
        for p in rows:
            mode = "fwd" if p.mode == "forward" else "fwd+bwd"
            if p.status != MEASURED:
                reason = p.skipped or ""
                shown = reason if len(reason) <= _ROW_REASON else reason[:80].rstrip() + " ... (in full below)"
                lines.append(f"  {p.backend:<{width}}{mode:<9}{_mask_label(p):<13}  {p.status}: {shown}")
                continue
            flag = _flags(p).ljust(2)
            compute = "!" if p.over_compute_roof else " "
            bandwidth = "~" if p.over_memory_bandwidth else " "
            lines.append(f"  {p.backend:<{width}}{mode:<9}{_mask_label(p):<13}{p.median_s * 1e3:>10.3f}{_fmt_ci(p):>11}"
                         f"{flag}{p.n_samples:>4}{_fmt_ratio(p, best):>8}{p.calls_per_sample or 0:>7}"
                         f"{_fmt_memory(p):>9} {_num(p.gflops, 1):>12}"
                         f"{compute} {_num(100 * (p.fraction_of_gemm_peak or 0), 1):>9}% {_num(p.gbytes_per_s, 2):>8}"
                         f" {_num(100 * (p.fraction_of_memory_bandwidth or 0), 1):>7}%{bandwidth}")
    cut: dict[tuple, list] = {}  # reasons too long for a row, grouped when they differ only in their numbers
    for p in points:
        if p.status != MEASURED and len(p.skipped or "") > _ROW_REASON:
            cut.setdefault((p.backend, p.status, _without_figures(p.skipped)), []).append(p)
    if cut:  # each once, whole: a row has room for its start only
        lines.append("\nnot measured, the reasons in full (one per backend and reason, with the figures of its "
                     "first point; each point's own in bench.json):")
        for (backend, status, _), group in cut.items():
            if status == WRONG_OUTPUT:  # a wrong output's figures are that point's own: name the points
                where = "; ".join(f"Tq={p.tq} Tk={p.tk} {p.mode}, mask {_mask_label(p)}" for p in group)
                lines.append(f"  - {backend} ({status} at {where}): {group[0].skipped}")
            else:
                lines.append(f"  - {backend} ({status}, {len(group)} point(s)): {group[0].skipped}")
    if not any(p.status == MEASURED for p in points):  # no figure to explain
        return "\n".join(lines)
    lines.append("\n  x best: the median over the fastest median of the same mode and mask at this length (at "
                 "Tq = Tk top-left and bottom-right are one mask, so a backend of either alignment counts); '?': "
                 "its 95% CI overlaps the fastest's, so this run does not tell them apart (rerun with a larger "
                 "--budget, on an idle machine); 95% CI: +-X% is the larger of the two sides, relative to the "
                 "median; a side beyond 100% is printed as -low/+high%")
    lines.append("  * the time budget ran out before the 95% CI reached the target; '<N' = below the memory "
                 "method's resolution of N MiB; mask: the causal mask the call carried, top-left, bottom-right or "
                 "none (none for full attention, and for the one-query decode step of a backend without bottom-right "
                 "masking: the same attention); for a point not run, the mask its workload asks for")
    lines.append("  core GFLOP/s, core %GEMM: the attention core alone (4*B*h*Tq*Tk*d_head x the pairs a causal mask "
                 "leaves visible, half at Tq = Tk, and those a sliding window leaves, counted exactly; bench.json's "
                 "gflops and fraction_of_gemm_peak, of NumPy's float32 GEMM); the whole layer, its four projections "
                 "included, is bench.json's layer_gflops; GB/s, %BW: the layer's compulsory traffic, the bytes it "
                 "needs (a windowed decode step's: only the cache rows its window sees, whatever a kernel reads) "
                 "(gbytes_per_s, fraction_of_memory_bandwidth, of the bandwidth measured in this run); the '!' flag "
                 "compares the layer's FLOPs with the compute roof (the fastest float32 GEMM of the installed "
                 "libraries), not with NumPy's")
    if any(_loaded(p) for p in points):
        lines.append(f"  L other processes kept more than {LOADED_CORES} cores busy while the point was timed "
                     "(other_cores in bench.json): a loaded machine's figures, slower and noisier than alone")
    methods = {p.backend: (p.memory_method, p.memory_resolution_bytes) for p in points if p.memory_method}
    if methods:
        lines.append("  peak MiB: the call's peak extra memory, measured in the backend's own worker by "
                     + ", ".join(f"{name}: {method} (resolution {_mib(res)} MiB)"
                                 for name, (method, res) in methods.items())
                     + "; memory the backend holds before the call (parameters, prepare()'s buffers such as a "
                       "KV cache) is not counted")
    if any(p.status == MEASURED and p.memory_error for p in points):
        lines.append("  n/a in peak MiB: the memory pass of a timed point failed (bench.json's memory_error says why; "
                     "its timing stands)")
    if any(p.over_compute_roof for p in points):
        lines.append("  ! faster than this machine's compute roof allows for the layer's work: not comparable "
                     "(the reason under 'above a roof' below and in bench.json's over_compute_roof)")
    if any(p.over_memory_bandwidth for p in points):
        lines.append("  ~ above the measured memory bandwidth: the working set stays in the caches, or the call read "
                     "less than counted (bench.json's over_memory_bandwidth)")
    return "\n".join(lines)


def _same_mask(p: BenchPoint) -> str:
    """The mask a point's call carried, as 'x best' compares them: at Tq = Tk top-left and bottom-right are one mask
    ("causal"), so a layer declaring only bottom-right is compared with the top-left ones."""
    label = _mask_label(p)
    return "causal" if p.tq == p.tk and label in ("top-left", "bottom-right") else label


def fastest(points: list[BenchPoint]) -> dict[tuple, BenchPoint]:
    """The measured point with the smallest median per (mode, causal mask): what a row's 'x best' compares with."""
    out: dict[tuple, BenchPoint] = {}
    for p in points:
        if p.status == MEASURED and p.median_s:
            k = (p.mode, _same_mask(p))
            if k not in out or p.median_s < out[k].median_s:
                out[k] = p
    return out


def _fmt_ratio(p: BenchPoint, best: dict[tuple, BenchPoint]) -> str:
    """'2.98' (this median over the fastest's), '1.37?' when the two 95% CIs overlap (not separated by this run)."""
    b = best.get((p.mode, _same_mask(p)))
    if b is None or not b.median_s:
        return "n/a"
    if b is p:
        return "1.00 "
    overlap = bool(p.ci95_s and b.ci95_s and p.ci95_s[0] <= b.ci95_s[1])
    return f"{p.median_s / b.median_s:.2f}{'?' if overlap else ' '}"


def _fmt_ci(p: BenchPoint) -> str:
    """The CI as +-X% of the median (the larger side); when a side exceeds 100% (a noisy, skewed point: its
    interval is far from symmetric), both sides: '-69/+1133%', so it never reads as a negative lower bound."""
    if p.ci95_rel_halfwidth is None:
        return "n/a"
    if p.ci95_rel_halfwidth > 1 and p.ci95_s and p.median_s:
        low, high = (p.median_s - p.ci95_s[0]) / p.median_s, (p.ci95_s[1] - p.median_s) / p.median_s
        return f"-{100 * low:.0f}/+{100 * high:.0f}%"
    return f"{100 * p.ci95_rel_halfwidth:.1f}%"


def _flags(p: BenchPoint) -> str:
    """The table's marks for a measured point: '*' when its budget ran out before the CI target, 'L' when other
    processes loaded the machine while it was timed."""
    return f"{'*' if p.budget_exhausted else ''}{'L' if _loaded(p) else ''}"


def _while(message: tuple, point: BenchPoint) -> str:
    """What the worker was doing when it was lost, for a request other than timed samples: preparing the call (a
    decode step's untimed cache fill among it) or measuring its memory; "" for the samples."""
    if message[0] == "prepare":
        fill = (", prepare_decode_step filling its cache" if point.workload == "decode" else "")
        return f" (while preparing the call: loading the layer{fill}, its first call and warm-up, before any sample)"
    if message[0] == "memory":
        return " (while measuring the call's peak memory)"
    return ""


def _loaded(p: BenchPoint) -> bool:
    return p.other_cores is not None and p.other_cores > LOADED_CORES


def load_warning(points: list[BenchPoint], threads: int | None = None, cores: int | None = None) -> str | None:
    """One line when other processes kept more than LOADED_CORES cores busy while any point was timed; when the
    benchmark's ``threads`` and the others' load together exceed the machine's ``cores``, it says that fewer
    threads leave the others a core (:func:`~mha_harness.bench.load.fewer_threads_advice`)."""
    loaded = [p for p in points if _loaded(p)]
    if not loaded:
        return None
    worst = max(p.other_cores for p in loaded)
    return (f"{len(loaded)} of {sum(p.status == MEASURED for p in points)} point(s) were timed while other "
            f"processes kept up to {worst:.2f} cores busy: compare them with care, or rerun on an idle machine"
            + fewer_threads_advice(threads, worst, cores))


def _mib(nbytes: int | None) -> str:
    return f"{(nbytes or 0) / 2 ** 20:.3g}"


def _num(x: float | None, decimals: int) -> str:
    """A table figure with ``decimals`` decimals, or 4 significant digits when that would not fit its column (a
    figure past a roof can be 10^5 times the others)."""
    x = x or 0.0
    fixed = f"{x:.{decimals}f}"
    return fixed if len(fixed) <= 7 else f"{x:.3g}"


def output_check_line(points: list[BenchPoint]) -> str | None:
    """One line on the measured points' output checks (:mod:`mha_harness.bench.verify`): how many matched the float64
    reference and the largest error as a fraction of its bound; how many went unchecked (forward + backward) and how
    many were refused as wrong-output. None when no point was prepared."""
    measured = [p for p in points if p.status == MEASURED and p.output_check]
    checked = [p for p in measured if p.output_check.get("rows")]
    refused = [p for p in points if p.status == WRONG_OUTPUT]
    drifted = sum(bool(p.samples_s) for p in refused)
    wrong = len(refused) - drifted
    if not measured and not refused:
        return None
    parts = []
    if checked:
        worst = max(p.output_check["max_error"] / p.output_check["bound"] for p in checked)
        by_gradients = sum("gradients" in p.output_check for p in checked)
        rows = max(p.output_check['rows'] for p in checked)
        parts.append(f"{len(checked)} measured point(s) matched the float64 reference at "
                     + ("1 query row" if rows == 1 else f"up to {rows} query rows")
                     + " before they were timed ("
                     + (f"{by_gradients} of them forward+backward, by their gradients; " if by_gradients else "")
                     + f"largest error {worst:.2g} of its bound)")
    if len(measured) > len(checked):
        parts.append(f"{len(measured) - len(checked)} forward+backward point(s) unchecked (each one's reason in "
                     "bench.json's output_check)")
    if wrong:
        parts.append(f"{wrong} point(s) wrong-output at their first call, not timed (each one's error above)")
    if drifted:
        parts.append(f"{drifted} point(s) wrong-output after their timed calls (right at first): no figure made")
    return "; ".join(parts)


def roof_warnings(points: list[BenchPoint]) -> list[str]:
    """One line per backend whose measured points pass this machine's compute roof (their figures cannot be the
    layer's work), with the first such point's reason."""
    lines = []
    for name in dict.fromkeys(p.backend for p in points):
        over = [p for p in points if p.backend == name and p.over_compute_roof]
        if over:
            lines.append(f"{name}: {len(over)} point(s) above the compute roof (first: Tq={over[0].tq} "
                         f"Tk={over[0].tk}: {over[0].over_compute_roof})")
    return lines


def _mask_label(p: BenchPoint) -> str:
    """The mask column, always one of top-left, bottom-right, none: what the call carried or, skipped, would carry
    for its backend, or for a point not run (its backend lost) the mask its workload asks for (prefill causal
    top-left, decode bottom-right)."""
    if p.call_mask:
        return p.call_mask
    shape = Shape(1, p.tq, p.tk, 1, 1, causal=p.causal)
    return causal_alignment(shape) or "none"


def _positive(y) -> bool:
    """A value a log axis can show: a finite number above zero (None, NaN and 0 cannot be log-scaled)."""
    return isinstance(y, (int, float)) and math.isfinite(y) and y > 0


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def _backend_styles(points) -> dict[str, tuple]:
    """One colour and one marker per backend, distinct for up to 20 backends (matplotlib's default cycle repeats
    after 10, which made two backends of a 12-backend sweep look alike); a backend's series (Tq = 1 and 16,
    causal, backward) share its colour and differ by line style."""
    import matplotlib
    pairs = matplotlib.colormaps["tab20"].colors  # (dark, light) pairs: the ten dark shades first, then the light
    palette = pairs[0::2] + pairs[1::2]
    order = list(dict.fromkeys(p.backend for p in points))
    return {b: (palette[i % 20], _MARKERS[i % len(_MARKERS)]) for i, b in enumerate(order)}


def _query_lengths(points) -> list[int]:
    """The query lengths Tq of a decode or cross sweep's points, shortest first ([] for prefill)."""
    return sorted({p.tq for p in points if p.workload in QUERY_LENGTH_WORKLOADS})


def _dashed_query_lengths(points) -> set[int]:
    """The query lengths drawn dashed: every one but the shortest (solid), so that two (decode's Tq = 1 and 16)
    read as solid and dashed."""
    return set(_query_lengths(points)[1:])


def _line_style(workload: str, causal: bool, mode: str, dashed_tq: bool) -> str:
    """A series' line style. Prefill: dashed when causal or forward + backward. Decode and cross: solid for the
    shortest Tq, dashed for the others; their forward + backward lines dotted and dash-dot (a stranger's cross plot
    drew its Tq = 128 fwd+bwd line dashed beside a title saying dashed was the longer Tq)."""
    if workload not in QUERY_LENGTH_WORKLOADS:
        return "--" if causal or mode != "forward" else "-"
    if mode != "forward":
        return "-." if dashed_tq else ":"
    return "--" if dashed_tq else "-"


def _line_styles_text(points) -> str:
    """What the plot's line styles say of its query lengths: 'solid Tq = 1, dashed Tq = 16', and of forward +
    backward where it has such lines."""
    lengths = _query_lengths(points)
    if len(lengths) < 2:
        text = f"Tq = {lengths[0]}" if lengths else ""
        backward = "fwd+bwd dotted"
    else:
        text = f"solid Tq = {lengths[0]}, dashed Tq = {', '.join(map(str, lengths[1:]))}"
        backward = "fwd+bwd dotted, dash-dot"
    if any(p.mode != "forward" for p in points if p.workload in QUERY_LENGTH_WORKLOADS):
        text += f"; {backward}"
    return text


def _figure(points, metric, ylabel, title, directory, filename, *, ci=False, roof=None, first_note=None):
    """One log-log figure. Only positive, finite values are drawn on the log axis; a memory reading below the
    method's resolution is drawn as an open triangle at that resolution (an upper bound) and named in a note;
    a series with no value at all is listed in the note. Never fails on data: with nothing drawable the axis
    stays linear and the figure says so."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 5.8))
    exps = fits(points)
    memory = metric == "peak_extra_bytes"
    drawn, below_notes, empty_notes, roof_notes, loaded_notes, all_xs = False, [], [], [], [], []
    styles = _backend_styles(points)
    dashed_tq = _dashed_query_lengths(points)
    lost: dict[str, list[str]] = {}  # a line that ends early says why: timeout, crash, out of memory, not run
    for p in points:
        if p.status not in (MEASURED, SKIPPED):
            label = p.backend + (f" Tq={p.tq}" if p.workload in QUERY_LENGTH_WORKLOADS else "")
            lost.setdefault(label, []).append(f"{p.seq_len}{' ' + _mask_label(p) if p.causal else ''} {p.status}")
    lost_notes = [f"{label}: {', '.join(items)}" for label, items in lost.items()]
    measured_backends = {p.backend for p in points if p.status == MEASURED}
    unsupported_only = list(dict.fromkeys(p.backend for p in points if p.status == SKIPPED
                                          and p.backend not in measured_backends))
    placed: dict[tuple, int] = {}  # below-resolution triangles drawn at each (T, resolution)
    for key, line in series(points).items():
        backend, workload, tq, causal, mode = key
        name = backend + (f" Tq={tq}" if workload in QUERY_LENGTH_WORKLOADS else "") \
            + (" causal" if causal and workload == "prefill" else "") \
            + (" fwd+bwd" if mode != "forward" else "")
        all_xs += [p.seq_len for p in line]
        over = [p for p in line if p.over_compute_roof]
        if over:
            roof_notes.append(f"{name}: " + ", ".join(str(p.seq_len) for p in over))
        below = [p for p in line if memory and p.memory_below_resolution and _positive(p.memory_resolution_bytes)]
        shown = [(p, getattr(p, metric)) for p in line if p not in below and _positive(getattr(p, metric))]
        if not shown and not below:
            empty_notes.append(name)
            continue
        fit = exps.get(series_key(*key), {}).get("memory" if memory else "time")
        plain = name  # the legend's name below gets the fit appended; notes name the series alone
        if metric in ("median_s", "peak_extra_bytes"):
            if fit and "exponent" in fit:
                name += f" (exp {fit['exponent']:.2f}±{fit['stderr']:.2f})"
            elif fit and "measurement_error" in fit:
                name += " (no exp: measurement error)"
            else:
                name += " (no exp: too few points)"
        style = _line_style(workload, causal, mode, tq in dashed_tq)
        color, marker = styles[backend]
        if shown:
            xs, ys = [p.seq_len for p, _ in shown], [y for _, y in shown]
            if ci:
                low = [max(0.0, y - p.ci95_s[0]) if p.ci95_s else 0 for p, y in shown]
                high = [max(0.0, p.ci95_s[1] - y) if p.ci95_s else 0 for p, y in shown]
                ax.errorbar(xs, ys, yerr=[low, high], marker=marker, markersize=3.5, capsize=3, linestyle=style,
                            color=color, label=name)
            else:
                ax.plot(xs, ys, marker=marker, markersize=3.5, linestyle=style, color=color, label=name)
            # open markers over the filled ones: times of a loaded machine (a peak of memory, measured in its own
            # pass, is no slower under load: an outside user read them as readings below the resolution)
            loaded = [] if memory else [(p.seq_len, y) for p, y in shown if _loaded(p)]
            if loaded:
                ax.plot(*zip(*loaded), marker=marker, markersize=6, linestyle="none", color=color,
                        markerfacecolor="white")
                loaded_notes.append(f"{plain}: {','.join(str(x) for x, _ in loaded)}")
            drawn = True
        if below:
            # several backends below one resolution at one T would draw one triangle: each later one moves right
            xs = []
            for p in below:
                spot = (p.seq_len, p.memory_resolution_bytes)
                xs.append(p.seq_len * 1.05 ** placed.get(spot, 0))
                placed[spot] = placed.get(spot, 0) + 1
            ax.plot(xs, [p.memory_resolution_bytes for p in below], marker="v",
                    markersize=6, linestyle="none", markerfacecolor="none", color=color,
                    label=None if shown else f"{name} (below resolution)")
            below_notes.append(f"{backend}: T={','.join(str(p.seq_len) for p in below)}")
            drawn = True
    if roof and _positive(roof[0]):
        ax.axhline(roof[0], color="black", linewidth=1, linestyle=":", label=roof[1])
        drawn = True
    notes = [first_note] if first_note else []
    if below_notes:
        notes.append("below resolution (open triangle drawn at the method's resolution, an upper bound; several at "
                     "one T side by side): "
                     + "; ".join(below_notes))
    if loaded_notes:
        notes.append("open marker: timed while other processes kept the machine busy (L in the table; slower and "
                     "noisier than alone): " + "; ".join(loaded_notes))
    if empty_notes:
        notes.append("no reading: " + ", ".join(empty_notes))
    if unsupported_only:
        notes.append("every point skipped as unsupported (bench.json and the table say why): "
                     + ", ".join(unsupported_only))
    if lost_notes:
        notes.append("not measured (bench.json says why): " + "; ".join(lost_notes))
    if roof_notes and not memory:
        notes.append("above this machine's compute roof, not comparable (over_compute_roof in bench.json): "
                     + "; ".join(roof_notes))
    if all_xs:
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(all_xs) / 1.3, max(all_xs) * 1.3)
    if drawn:
        ax.set_yscale("log")
        # see-through: where 'best' finds no empty corner (a dozen lines) the points under the legend still show
        # (an outside user's decode plot had its upper-left points hidden)
        ax.legend(fontsize=6, loc="best", framealpha=0.45)
    else:
        ax.text(0.5, 0.5, "nothing to plot: no reading (see the note below)", ha="center", va="center",
                transform=ax.transAxes)
    note_lines = []
    if notes:
        import textwrap
        note_lines = [w for n in notes for w in textwrap.wrap(n, 150)][:8]
        fig.text(0.01, 0.005, "\n".join(note_lines), fontsize=6, va="bottom")
    ax.set_xlabel("KV length Tk" if points and points[0].workload in QUERY_LENGTH_WORKLOADS else "sequence length T")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    buffer = io.BytesIO()
    fig.tight_layout(rect=(0, 0.016 * len(note_lines) + (0.01 if note_lines else 0), 1, 1))
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return write_bytes_atomic(Path(directory) / filename, buffer.getvalue())


def plot(points: list[BenchPoint], directory: Path, machine: dict, config: BenchConfig | None = None, *,
         interrupted: str | None = None) -> list[Path]:
    """Log-log plots; times carry their 95% CI as error bars; memory below resolution is drawn as an open triangle at
    the resolution (left out of the fit); a figure with nothing drawable is still written, saying so. Each title
    ends with the layer's shape (``config``: heads and num_kv_heads, dtype, threads). ``interrupted``: a sweep stopped
    before its end, in words; each figure's first note says so (its lines stop where the sweep did)."""
    layer = f"\n{config.layer_text()}" if config is not None else ""
    if points and points[0].workload == "decode":
        bw = machine.get("memory_bandwidth_gbs")
        return [_figure(points, "median_s", "time per call (s), 95% CI", "decode: time vs KV length "
                        f"({_line_styles_text(points)}; bottom-right causal){layer}", directory,
                        "decode_time_vs_kv_len.png", ci=True, first_note=interrupted),
                _figure(points, "gbytes_per_s", "compulsory bytes moved per second (GB/s)",
                        f"decode: memory throughput vs KV length{layer}", directory, "decode_bandwidth_vs_kv_len.png",
                        first_note=interrupted,
                        roof=(bw, f"memory bandwidth measured in this run {bw:.1f} GB/s") if bw else None),
                # a step that allocates per call (a Tk x Tk bias built every step: an outside user's 1 GiB at 4096
                # keys) showed in the table and the JSON only
                _figure(points, "peak_extra_bytes", "peak extra memory per step (bytes; the filled cache not counted)",
                        f"decode: peak extra memory vs KV length (open triangle: below resolution){layer}", directory,
                        "decode_memory_vs_kv_len.png", first_note=interrupted)]
    if points and points[0].workload == "cross":
        return [_figure(points, "median_s", "time per call (s), 95% CI", "cross-attention: time vs Tk "
                        f"({_line_styles_text(points)}; unmasked){layer}", directory,
                        "cross_time_vs_kv_len.png", ci=True, first_note=interrupted),
                _figure(points, "peak_extra_bytes", "peak extra memory (bytes)",
                        f"cross-attention: peak extra memory vs Tk (open triangle: below resolution){layer}",
                        directory, "cross_memory_vs_kv_len.png", first_note=interrupted)]
    return [_figure(points, "median_s", "time per call (s), 95% CI of the median",
                    f"time vs sequence length (log-log; fitted exponent ± stderr){layer}", directory,
                    "time_vs_seq_len.png", ci=True, first_note=interrupted),
            _figure(points, "peak_extra_bytes", "peak extra memory (bytes)",
                    f"peak extra memory vs T (below the method's resolution: open triangle at the resolution){layer}",
                    directory,
                    "memory_vs_seq_len.png", first_note=interrupted)]


# ---------------------------------------------------------------- entry point

#: machine["roofs_note"]: what a roof fraction compares
ROOFS_NOTE = ("the roofs are measured in each run and move with the load of the box (the bandwidth most: tens of "
              "percent between runs minutes apart on a shared box): fraction_of_gemm_peak and "
              "fraction_of_memory_bandwidth compare backends within one run, not between runs")


def _gemm_by_library(machine: dict) -> str:
    """Each library's float32 GEMM figure of the run, fastest first ('jax 304.6, numpy 198.9, torch: not installed'),
    so a roof held by NumPy reads as measured against the others, not as the others left out."""
    by = machine.get("gemm_gflops_float32_by_library") or {}
    measured = sorted(((k, v) for k, v in by.items() if isinstance(v, (int, float))), key=lambda kv: -kv[1])
    return ", ".join([f"{k} {v:.1f}" for k, v in measured] + [f"{k}: {v}" for k, v in by.items()
                                                                if not isinstance(v, (int, float))])


def machine_info(threads: int, roofs: bool = True) -> dict:
    """The machine and its roofs, measured now under ``threads`` (``roofs=False``: not measured, the roof fields
    None: a run in which no point can run does not wait for them)."""
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "cpu_count": __import__("os").cpu_count(),
            "roofs_measured": roofs}
    if not roofs:
        return {**info, "gemm_peak_gflops_float32": None, "memory_bandwidth_gbs": None,
                "compute_roof_gflops_float32": None, "compute_roof_library": None,
                "roofs": "not measured: no backend can run any point of this run"}
    apply_threads(threads)
    roof = gemm_roofs(threads)
    bandwidth = bandwidth_roof()
    return {**info,
            "gemm_peak_gflops_float32": roof["by_library"]["numpy"],
            "memory_bandwidth_gbs": round(bandwidth["gbs"], 2),
            "memory_bandwidth_median_gbs": round(bandwidth["median_gbs"], 2),
            "memory_bandwidth_calls": bandwidth["calls"],
            "compute_roof_gflops_float32": roof["gflops"], "compute_roof_library": roof["library"],
            "gemm_gflops_float32_by_library": roof["by_library"],
            "roofs": "GEMM: float32 2048^3 matmul, best of 5; bandwidth: float32 GEMV over a 256 MiB matrix, the best "
                     "of its calls over at least 1 s (memory_bandwidth_median_gbs: their median); NumPy BLAS, "
                     "under the benchmark's thread count (fraction_of_gemm_peak is of NumPy's); the "
                     "compute roof that over_compute_roof compares with is the fastest of the same GEMM in NumPy, "
                     "torch, JAX and onnxruntime, those installed, in a child process pinned to the thread count",
            "roofs_note": ROOFS_NOTE}


#: memory_error of a timed point whose memory was never measured: the memory pass runs after every timing
NOT_MEASURED_INTERRUPTED = ("not measured: the sweep was interrupted before this point's memory was measured (the "
                            "memory pass runs after all the timings, one point after another)")


def _interrupted(sweep: Sweep, directory: Path | None, log, planned: int) -> None:
    """After Ctrl-C or SIGTERM: the timed points whose memory pass never came say so, bench.json is saved with
    ``complete: false``, and the plots are redrawn from the finished points, each saying the sweep was interrupted
    (plots left from an earlier run beside the new bench.json would show another run). A second interrupt stops the
    plots; the bench.json saved after the last point stays."""
    try:
        for point in sweep.points:
            if point.status == MEASURED and point.peak_extra_bytes is None and not point.memory_error:
                point.memory_error = NOT_MEASURED_INTERRUPTED
        sweep.save(complete=False)
        if directory is None:
            return
        finished = sum(p.status == MEASURED for p in sweep.points)
        log(f"  interrupted: {finished} finished point(s) in {directory / 'bench.json'} (complete: false)", flush=True)
        words = (f"INTERRUPTED: {len(sweep.points)} of the {planned} planned points run ({finished} measured); "
                 "bench.json says complete: false")
        try:
            paths = plot(sweep.points, directory, sweep.doc.get("machine", {}), sweep.config, interrupted=words)
            log(f"  plots of the finished points: {', '.join(str(p) for p in paths)}", flush=True)
        except ImportError:
            log(f"  plots skipped: matplotlib is not installed ({install_hint('bench')})", flush=True)
    except BaseException:  # noqa: BLE001 - a second interrupt: the file saved after the last point stays
        pass


def results_folder(workload: str) -> str:
    """The folder under a results directory that a ``workload`` sweep writes: bench, bench-decode, bench-cross."""
    return "bench" if workload == "prefill" else f"bench-{workload}"


def run_bench(backends: list, results_dir: Path | None, *, seq_lens=None, causal: str = "off",
              backward: bool = False, quick: bool = False, config: BenchConfig | None = None,
              query_lens=None, log=print, payloads: dict | None = None) -> dict:
    """Sweep ``backends``, print the table, write ``<results>/bench[-decode|-cross]/bench.json`` and the plots.
    ``query_lens``: the decode and cross workloads' query lengths Tq (None: DECODE_QUERY_LENS, CROSS_QUERY_LENS).
    ``payloads``: backend name -> how its worker process rebuilds it (:func:`mha_harness.util.rebuild.
    backend_payload`: from its ``module:object`` spec, so a plugin's factory-made classes need not pickle); a
    backend without one is pickled.

    What can run is checked first: when no backend can run any planned point (each skipped for a declared
    capability, e.g. an always-causal layer at ``causal="off"``), the sweep stops there, with the table of reasons and
    a complete bench.json, without measuring the machine's roofs or starting a worker."""
    config = config or BenchConfig()
    if config.workload not in WORKLOADS:
        raise ValueError(f"workload: got {config.workload!r}; accepted: {', '.join(WORKLOADS)}")
    kv_error = kv_heads_error(config.num_kv_heads, config.num_heads)
    if kv_error:
        raise ValueError(kv_error)
    feature_error = config.features_error()
    if feature_error:
        raise ValueError(feature_error)
    decode, cross = config.workload == "decode", config.workload == "cross"
    paired = config.workload in QUERY_LENGTH_WORKLOADS  # Tq query lengths against each KV length
    if query_lens is None:
        query_lens = CROSS_QUERY_LENS if cross else DECODE_QUERY_LENS
    directory = None
    if results_dir is not None:
        directory = check_writable(Path(results_dir) / results_folder(config.workload), "--results")
    causal_modes = {"off": (False,), "on": (True,), "both": (False, True)}[causal]
    seq_lens = list(seq_lens or (DECODE_KV_LENS if decode else CROSS_KV_LENS if cross else DEFAULT_SEQ_LENS))
    names = [b.name for b in backends]
    log(f"benchmark ({config.workload}): {len(names)} backends x {'KV lengths' if paired else 'T'} in {seq_lens}"
        f"{f', Tq in {list(query_lens)}' if paired else ''}; "
        f"{'unmasked cross-attention (x_q against another x_kv)' if cross else _causal_text(causal, decode)}; "
        f"{config.layer_text(features=False)}; {config.features_text()}; each "
        f"backend in its own worker; per point: 95% CI of the median within +-{100 * config.ci_rel:g}% or "
        f"{config.budget_s:g} s",
        flush=True)
    if decode:
        dropped = [f"Tq={tq} KV={tk}" for tk in sorted(seq_lens) for tq in query_lens if tq > tk]
        if dropped:
            log(f"  left out (more new queries than KV length): {', '.join(dropped)}", flush=True)
    start = time.perf_counter()
    if decode or cross:  # decode: bottom-right causal; cross: unmasked
        causal_modes = (decode,)
    groups = plan_points(names, config, seq_lens, causal_modes=causal_modes,
                         backward=backward, query_lens=query_lens)
    by_name = {b.name: b for b in backends}
    runnable = any(unsupported(by_name[p.backend], shape_of(p, config)) is None for group in groups for p in group)
    if runnable:  # each backend's worker is spawned: it imports the main script again
        refuse_unguarded_main("mha_harness.bench.sweep.run_bench", alternative=None)
    try:
        machine = machine_info(config.threads, roofs=runnable)
    except KeyboardInterrupt:
        log("  interrupted while measuring this machine's roofs, before any point: no bench.json written", flush=True)
        raise
    doc = {"schema": "mha-harness/bench", "schema_version": SCHEMA_VERSION, "complete": False,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
           "threads": thread_report(config.threads), "config": asdict(config), "workload": config.workload,
           "causal": "bottom-right" if decode else "off" if cross else causal,
           "seq_lens": seq_lens, "query_lens": list(query_lens) if paired else None, "quick": quick,
           "flops_formula": FLOPS_FORMULA, "bytes_formula": BYTES_FORMULA,
           **({"decode_step": DECODE_STEP} if decode else {}), **({"cross_call": CROSS_CALL} if cross else {}),
           "statistics": {"sample": f"the call repeated until a sample lasts >= {config.min_sample_s} s (calls "
                                    "per sample from the fastest warm-up call); value = sample time / calls",
                          "load": f"other_cores: CPU-s of other processes per second while the point's group was "
                                  f"timed (/proc/stat less the harness and its workers); above {LOADED_CORES}: 'L'",
                          "roofs": f"over_compute_roof: layer GFLOP/s above {COMPUTE_ROOF_SLACK:g}x the compute roof "
                                   "(machine.compute_roof_gflops_float32: a CPU call cannot do the layer's work that "
                                   "fast); over_memory_bandwidth: "
                                   "compulsory bytes per second above the measured bandwidth (in the caches, or less "
                                   "read)",
                          "settle": "before each turn the parent waits until the other backends' workers use under "
                                    "10% of a core over 20 ms (thread pools that spin-wait after a call have "
                                    "stopped; at most 2 s): settle_s per point, unsettled_turns when the limit hit",
                          "ci": "95% CI of the median, binomial order statistics (scipy.stats.quantile_test)",
                          "stop": f"CI within +-{config.ci_rel:.0%} of the median, or {config.budget_s} s spent "
                                  f"(at least {stats.MIN_SAMPLES} samples)",
                          "fits": "scipy.stats.linregress of log(y) on log(length) over the 3 largest points (memory: "
                                  "above the method's resolution), exponent with its stderr",
                          "memory_exponent_range": list(stats.MEMORY_EXPONENT_RANGE),
                          "memory_exponent_guard": "a memory exponent outside this range is impossible for attention: "
                                                   "fits[...]['memory'] is then {'measurement_error': ...}, never an "
                                                   "exponent",
                          "time_exponent_range": list(stats.TIME_EXPONENT_RANGE),
                          "time_exponent_guard": "a time exponent outside this range by more than two stderr, or "
                                                 f"with a stderr above {stats.TIME_EXPONENT_MAX_STDERR}, is noise: "
                                                 "fits[...]['time'] is then {'measurement_error': ...}"}}
    sweep = Sweep(backends, config, directory / "bench.json" if directory else None, doc, log=log,
                  payloads=payloads)
    if not runnable:  # fail fast: every point is skipped from the declarations alone, no worker, no roofs
        for group in groups:
            sweep.prepare_group(group)
            sweep.points += group
        doc["seconds"] = round(time.perf_counter() - start, 1)
        sweep.save(complete=True)
        log(table(sweep.points))
        log("\n  nothing to measure: no backend can run any point of this run (each one's reason above); the "
            "roofs were not measured")
        _write_plots(sweep.points, directory, machine, config, doc, log)
        return doc

    def progress(i, group):
        p = group[0]
        label = f"Tq={p.tq} Tk={p.tk}" if paired else f"T={p.tk}{' causal' if p.causal else ''}"
        done = ", ".join(f"{q.backend} {q.median_s * 1e3:.2f} ms{_flags(q)}" if q.status == MEASURED
                         else f"{q.backend} {q.status}" for q in group)
        log(f"  [{i + 1}/{len(groups)}] {label} {p.mode}: {done}", flush=True)
    try:
        points = sweep.run(groups, progress)
    except BaseException:  # Ctrl-C, SIGTERM: every finished point is already on disk; kill the workers now
        sweep.close(interrupted=True)
        _interrupted(sweep, directory, log, planned=sum(len(group) for group in groups))
        raise
    sweep.close()
    doc["seconds"] = round(time.perf_counter() - start, 1)
    sweep.save(complete=True)
    log(table(points))
    roof = machine.get("compute_roof_gflops_float32")
    log(f"\nroofs of this machine ({config.threads} thread{'' if config.threads == 1 else 's'}), measured in this "
        "run: float32 GEMM "
        f"{machine['gemm_peak_gflops_float32']:.1f} GFLOP/s (NumPy)"
        + (f", compute roof {roof:.1f} (the fastest library's: {_gemm_by_library(machine)})" if roof else "")
        + f", memory bandwidth {machine['memory_bandwidth_gbs']:.1f} GB/s (best of {machine['memory_bandwidth_calls']} "
          f"calls, median {machine['memory_bandwidth_median_gbs']:.1f}); they move with the box's load from run to "
          "run: %GEMM and %BW compare backends within this run only")
    for line in roof_warnings(points):
        log(f"  above a roof: {line}")
    checked = output_check_line(points)
    if checked:
        log(f"  outputs: {checked}")
    loaded = load_warning(points, doc["config"].get("threads"), os.cpu_count())
    if loaded:
        log(f"  loaded machine: {loaded}")
    lengths = {series_key(*key): len({p.seq_len for p in line}) for key, line in series(points).items()}
    axis = "KV length" if paired else "T"
    short = [key for key in doc["fits"] if lengths.get(key, 0) < 3]
    for key, value in doc["fits"].items():
        if key not in short:
            log(f"  growth exponent {key}: time {_fmt_fit(value['time'], lengths.get(key), axis)}; "
                f"memory {_fmt_fit(value['memory'], lengths.get(key), axis)}")
    if short:  # one line, not one per series: a run at one or two lengths is a side-by-side, not a scaling study
        log(f"  growth exponents: n/a for {len(short)} series measured at fewer than 3 lengths (--seq-lens with 3 or "
            "more fits them)")
    _write_plots(points, directory, machine, config, doc, log)
    return doc


def _write_plots(points, directory, machine, config, doc, log) -> None:
    """The plots next to bench.json (each run redraws them, so none is left from an earlier run), and where."""
    if directory is None:
        return
    try:
        paths = plot(points, directory, machine, config)
        log(f"  plots: {', '.join(str(p) for p in paths)}")
    except ImportError:
        log(f"  plots skipped: matplotlib is not installed ({install_hint('bench')})")
    log(f"  json: {directory / 'bench.json'}  ({doc['seconds']} s)")
