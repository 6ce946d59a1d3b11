"""One home for the throughput metrics that ``bench``, asv and pytest-benchmark report.

For one call of an attention layer of shape :class:`Shape` taking ``seconds``, :func:`metrics` gives

* ``gflops``: the attention core with the flash-attention formula 4*B*h*Tq*Tk*d_head times the fraction of
  (query, key) pairs a causal mask leaves visible (0.5 at Tq = Tk, the flash-attention convention; with Tq < Tk,
  bottom-right, 1 - (Tq - 1) / (2 Tk): nearly all for a decode step); a sliding window counts the pairs it leaves
  visible exactly, as flash-attention's benchmarks do (less half the diagonal at causal Tq = Tk, as the causal
  convention); forward+backward counts 3.5x forward,
  backward being 2.5x; and ``fraction_of_gemm_peak``;
* ``layer_gflops``: the core plus the four projections (2*B*d_model*(Tq*d_model + 2*Tk*kv_width + Tq*d_model),
  kv_width = num_kv_heads*d_head: d_model for multi-head, less for grouped-query; a decode step over a filled
  cache, ``Shape.cached``, projects only its Tq new rows' keys and values: Tq in place of Tk);
* ``gbytes_per_s``: the compulsory traffic of one call (query, key and value inputs, the four weight matrices --
  W_k and W_v of d_model x kv_width -- and the output, each read or written once, in the benchmark's dtype; a
  decode step reads x_new, the whole K and V cache, 2*B*Tk*kv_width, writes its Tq new rows of it, and reads the
  weights and writes the output) per second, and ``fraction_of_memory_bandwidth``; a decode step under a sliding
  window of w keys reads only the cache rows its queries can see, min(Tk, Tq + w - 1).

The core count is the same for grouped-query heads: every query head still scores every key it sees. Rotary
embeddings and a q/k norm add elementwise work over q and k (a few FLOPs per feature, under 1 % of the layer's at
d_head 64) that neither count includes.

The machine's roofs are measured the same way: :func:`gemm_peak_gflops` times a float32 GEMM and
:func:`memory_bandwidth_gbs` a float32 GEMV over a 256 MiB matrix (each byte of the matrix read once),
both with NumPy's BLAS under the benchmark's thread count, the best of several timed calls (:func:`best_time`;
the bandwidth's calls spread over at least a second, :func:`bandwidth_roof`). A roof is what this machine reached
in that moment: it moves with the load of the box from run to run, so a fraction of it compares backends within
one run only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from mha_harness.contract.conventions import DEFAULT_QK_NORM_EPS, DEFAULT_ROTARY_BASE

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
FLOPS_FORMULA = ("core: 4*B*h*Tq*Tk*d_head x the causal mask's visible fraction (0.5 at Tq = Tk; 1 - (Tq-1)/(2*Tk) "
                 "bottom-right with Tq < Tk; under a sliding window, the visible pairs counted exactly, less half "
                 "the diagonal at causal Tq = Tk) (x3.5 forward+backward); layer: core + projections "
                 "2*B*d_model*(2*Tq*d_model + 2*Tk*kv_width), kv_width = num_kv_heads*d_head (x3 forward+backward); "
                 "a decode step over a filled cache projects Tq rows of keys and values, not Tk; rotary embeddings "
                 "and a q/k norm (elementwise) are not counted")
BYTES_FORMULA = ("compulsory traffic: query + key + value + 4 weight matrices (W_k, W_v: d_model x kv_width) + "
                 "output, once each, in dtype; a decode step over a filled cache: x_new + the K and V cache "
                 "(2*B*Tk*kv_width; under a sliding window of w keys, the min(Tk, Tq + w - 1) rows its queries see) "
                 "read + its Tq new rows written + weights + output; cross-attention: x_q (B*Tq*d_model) and one "
                 "x_kv (B*Tk*d_model) that makes both K and V")


@dataclass(frozen=True)
class Shape:
    """One benchmarked call: batch, query and key lengths, layer size, dtype, causal, backward, the number of
    key/value heads (None: as many as query heads, multi-head; fewer: grouped-query), and the layer's features
    (biases, rotary embeddings, a q/k norm, a sliding window: :class:`~mha_harness.contract.api.AttentionConfig`'s)."""

    batch: int
    tq: int
    tk: int
    d_model: int
    num_heads: int
    dtype: str = "float32"
    causal: bool = False
    backward: bool = False
    num_kv_heads: int | None = None
    #: a decode step over a filled KV cache (LoadedAttention.prepare_decode_step): the keys and values of the first
    #: Tk - Tq positions were projected before the call; the call projects its Tq new rows only
    cached: bool = False
    #: the layer has biases b_q ... b_o (AttentionConfig.bias); off by default
    bias: bool = False
    #: rotary position embeddings on q and k (AttentionConfig.rotary: "half_split" or "interleaved"); None: none
    rotary: str | None = None
    #: the rotary frequencies' base (AttentionConfig.rotary_base: 10000 Llama 2's, 500000 Llama 3's)
    rotary_base: float = DEFAULT_ROTARY_BASE
    #: a norm of q and k after their projections (AttentionConfig.qk_norm, e.g. "rms_per_head"); None: none
    qk_norm: str | None = None
    #: the q/k norm's epsilon (AttentionConfig.qk_norm_eps)
    qk_norm_eps: float = DEFAULT_QK_NORM_EPS
    #: each query sees only its own position and the w - 1 before it (AttentionConfig.sliding_window); None: all
    sliding_window: int | None = None
    #: an ALiBi bias by distance on the scores (AttentionConfig.alibi: "linear" or "symmetric"); None: none
    alibi: str | None = None
    #: cross-attention: the queries from one sequence, the keys and values from another (an encoder-decoder's
    #: decoder attending to the encoder's states; key = value = x_kv), at any Tq and Tk, Tq = Tk included
    cross: bool = False

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def kv_width(self) -> int:
        """Columns of W_k and W_v: num_kv_heads * d_head (d_model for multi-head)."""
        return self.kv_heads * self.d_head


def window_visible_pairs(s: Shape) -> int:
    """The (query, key) pairs a sliding window of w keys leaves visible, counted exactly: query i, at position
    p = i + Tk - Tq (Tq = Tk in prefill: p = i), sees the keys j > p - w, and with a causal mask only those up to p
    (flash-attention's benchmarks count a local window's pairs the same way)."""
    w = s.sliding_window
    p = np.arange(s.tq, dtype=np.int64) + (s.tk - s.tq)
    low = np.maximum(p - w + 1, 0)
    high = p if s.causal else np.full_like(p, s.tk - 1)
    return int(np.maximum(high - low + 1, 0).sum())


def visible_fraction(s: Shape) -> float:
    """The fraction of the Tq x Tk (query, key) pairs the shape's causal mask leaves visible: 1 without one; 0.5 at
    Tq = Tk (the flash-attention convention, (T + 1) / 2T exactly: half of the diagonal's T pairs left out);
    bottom-right with Tq < Tk (the new queries are the last positions, query i sees Tk - Tq + i + 1 keys)
    1 - (Tq - 1) / (2 Tk). Under a sliding window, :func:`window_visible_pairs` / (Tq Tk), with half the diagonal
    left out at causal Tq = Tk as the convention leaves it: the count falls as the window narrows, and a window of at
    least Tk keys counts as none."""
    if s.sliding_window is not None:
        half_diagonal = s.tq / 2 if s.causal and s.tq == s.tk else 0.0
        return (window_visible_pairs(s) - half_diagonal) / (s.tq * s.tk)
    if not s.causal:
        return 1.0
    if s.tq >= s.tk:
        return 0.5
    return 1.0 - (s.tq - 1) / (2.0 * s.tk)


def core_flops(s: Shape) -> float:
    """4*B*h*Tq*Tk*d_head times the causal mask's :func:`visible_fraction`; forward+backward is 3.5x the forward
    count."""
    flops = 4.0 * s.batch * s.num_heads * s.tq * s.tk * s.d_head * visible_fraction(s)
    return flops * (3.5 if s.backward else 1.0)


def projected_kv_rows(s: Shape) -> int:
    """The key/value rows a call projects: all Tk, or a decode step's Tq new ones (``Shape.cached``)."""
    return s.tq if s.cached else s.tk


def projection_flops(s: Shape) -> float:
    """The four x @ W projections: W_q and W_o of d_model columns over Tq rows, W_k and W_v of ``kv_width`` columns
    (num_kv_heads * d_head: smaller for grouped-query heads) over :func:`projected_kv_rows`; forward+backward is
    3x."""
    flops = 2.0 * s.batch * s.d_model * (2 * s.tq * s.d_model + 2 * projected_kv_rows(s) * s.kv_width)
    return flops * (3.0 if s.backward else 1.0)


def compulsory_bytes(s: Shape) -> float:
    """query + key + value + output + 4 weight matrices, each moved once, in the dtype (self-attention reads x once;
    W_k and W_v are d_model x kv_width, smaller for grouped-query heads). A decode step over a filled cache reads
    x_new and the whole K and V cache, and writes the cache's Tq new rows, in place of the key and value inputs;
    under a sliding window of w keys it needs only the min(Tk, Tq + w - 1) cache rows its queries see. A
    cross-attention call (``Shape.cross``) reads x_q and one x_kv, whose projections make both K and V."""
    size = ITEMSIZE.get(s.dtype, 4)
    if s.cached:
        read = min(s.tk, s.tq + s.sliding_window - 1) if s.sliding_window is not None else s.tk
        inputs = s.batch * s.tq * s.d_model + 2 * s.batch * (read + s.tq) * s.kv_width
    elif s.cross:  # x_q and one x_kv that makes both K and V
        inputs = s.batch * (s.tq + s.tk) * s.d_model
    else:
        inputs = s.batch * s.tq * s.d_model if s.tq == s.tk else s.batch * (s.tq + 2 * s.tk) * s.d_model
    weights = 2 * s.d_model * s.d_model + 2 * s.d_model * s.kv_width
    moved = (inputs + s.batch * s.tq * s.d_model + weights) * size
    return moved * (3.0 if s.backward else 1.0)


def _sig(x: float, digits: int = 5) -> float:
    """``x`` to ``digits`` significant digits (JSON stays readable; small fractions keep their precision)."""
    return float(f"{x:.{digits}g}")


def metrics(s: Shape, seconds: float | None, *, gemm_peak_gflops: float | None = None,
            memory_bandwidth_gbs: float | None = None) -> dict:
    """GFLOP/s (core and whole layer), bytes per second, and their fractions of this machine's measured roofs."""
    if not seconds or seconds <= 0:
        return {}
    gflops = core_flops(s) / seconds / 1e9
    gbytes = compulsory_bytes(s) / seconds / 1e9
    out = {"gflops": _sig(gflops), "layer_gflops": _sig((core_flops(s) + projection_flops(s)) / seconds / 1e9),
           "gbytes_per_s": _sig(gbytes)}
    if gemm_peak_gflops:
        out["fraction_of_gemm_peak"] = _sig(gflops / gemm_peak_gflops)
    if memory_bandwidth_gbs:
        out["fraction_of_memory_bandwidth"] = _sig(gbytes / memory_bandwidth_gbs)
    return out


#: a CPU float32/float64 call whose layer GFLOP/s pass this multiple of the compute roof (the fastest float32 GEMM
#: of the installed libraries, :mod:`~mha_harness.bench.gemm_roof`) did less work than the layer it stands for: the
#: layer is GEMMs and smaller work, and the margin leaves room for a kernel better than every installed library's
COMPUTE_ROOF_SLACK = 1.5


def over_roofs(s: Shape, seconds: float | None, *, compute_roof_gflops: float | None = None,
               memory_bandwidth_gbs: float | None = None) -> dict:
    """What a CPU call's figures say beyond this machine's roofs, as sentences (fields absent when within):
    ``over_compute_roof`` when the layer's FLOPs per second pass :data:`COMPUTE_ROOF_SLACK` x the compute roof, the
    fastest float32 GEMM of the installed libraries (float32/float64 only: half precision may use matrix units the
    float32 GEMM does not): the call cannot
    have done the layer's work, e.g. a plugin whose ``prepare()`` projected the keys and values (a KV cache filled
    untimed) while the others project them in every call; ``over_memory_bandwidth`` when the compulsory bytes per
    second pass the measured bandwidth: the working set stays in the caches, or the call read less than counted."""
    if not seconds or seconds <= 0:
        return {}
    out = {}
    layer = (core_flops(s) + projection_flops(s)) / seconds / 1e9
    if compute_roof_gflops and s.dtype in ("float32", "float64") and layer > COMPUTE_ROOF_SLACK * compute_roof_gflops:
        out["over_compute_roof"] = (
            f"layer {layer:.4g} GFLOP/s is {layer / compute_roof_gflops:.3g}x the fastest float32 GEMM of this "
            f"machine's libraries ({compute_roof_gflops:.4g}): the call did less than the layer's work (K/V "
            "projections or attention computed in prepare(), such as a KV cache filled untimed, or a cached result); "
            "not comparable with backends that compute it in every call")
    gbytes = compulsory_bytes(s) / seconds / 1e9
    if memory_bandwidth_gbs and gbytes > memory_bandwidth_gbs:
        out["over_memory_bandwidth"] = (
            f"{gbytes:.4g} GB/s of compulsory traffic is {gbytes / memory_bandwidth_gbs:.3g}x the measured memory "
            f"bandwidth ({memory_bandwidth_gbs:.4g} GB/s): the working set ({compulsory_bytes(s) / 2 ** 20:.3g} MiB) "
            "stays in the caches, or the call read less than counted")
    return out


def timed_calls(fn, repeats: int, min_seconds: float = 0.0, clock=time.perf_counter) -> list[float]:
    """The times of timed calls of ``fn`` after one untimed warm-up call: at least ``repeats`` of them, and more
    until they span ``min_seconds`` (``clock`` reads the time)."""
    fn()
    times: list[float] = []
    began = clock()
    while len(times) < repeats or clock() - began < min_seconds:
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def best_time(fn, repeats: int, min_seconds: float = 0.0, clock=time.perf_counter) -> float:
    """The shortest of the timed calls of :func:`timed_calls`: the estimator of a roof (what the machine can reach),
    since noise, other processes and a slow moment only ever add time to a call."""
    return min(timed_calls(fn, repeats, min_seconds, clock))


def gemm_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """NumPy's float32 GEMM throughput (best of ``repeats``), what ``fraction_of_gemm_peak`` is of; the compute roof
    is the fastest installed library's (:mod:`~mha_harness.bench.gemm_roof`)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    return 2.0 * n ** 3 / best_time(lambda: a @ b, repeats) / 1e9


#: the bandwidth roof's timed GEMV calls span at least this long: one call takes ~5-10 ms, and on a shared box the
#: speed switches between regimes lasting about a second (mha-harness fidelity's speed_stability), so the best of 5
#: calls back to back (40 ms) gave 22 to 57 GB/s from one minute to the next here, the best over a second 28 to 60
#: (mostly 44-51)
BANDWIDTH_MIN_SECONDS = 1.0


def bandwidth_roof(mib: int = 256, repeats: int = 5, min_seconds: float = BANDWIDTH_MIN_SECONDS) -> dict:
    """This machine's read bandwidth: a float32 GEMV over a ``mib`` MiB matrix (NumPy's BLAS), each byte read once.
    ``gbs`` is the best call (the roof: :func:`best_time`'s estimator) over at least ``repeats`` calls spanning
    ``min_seconds``; ``median_gbs`` and ``calls`` show how much this run's own calls varied."""
    n = int((mib * 2 ** 20 / 4) ** 0.5)
    a = np.ones((n, n), np.float32)
    x = np.ones(n, np.float32)
    times = timed_calls(lambda: a @ x, repeats, min_seconds)
    ordered = sorted(times)
    return {"gbs": a.nbytes / ordered[0] / 1e9, "median_gbs": a.nbytes / ordered[len(ordered) // 2] / 1e9,
            "calls": len(times)}


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5, min_seconds: float = BANDWIDTH_MIN_SECONDS) -> float:
    """This machine's read bandwidth in GB/s, the memory roof: :func:`bandwidth_roof`'s best call."""
    return bandwidth_roof(mib, repeats, min_seconds)["gbs"]
