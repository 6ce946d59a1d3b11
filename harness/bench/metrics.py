"""One home for the throughput metrics that ``bench``, asv and pytest-benchmark report.

For one call of an attention layer of shape :class:`Shape` taking ``seconds``, :func:`metrics` gives

* ``gflops``: the attention core with the flash-attention formula 4*B*h*Tq*Tk*d_head (x0.5 causal;
  forward+backward counts 3.5x forward, backward being 2.5x), and ``fraction_of_gemm_peak``;
* ``layer_gflops``: the core plus the four projections (2*B*d_model*(Tq*d_model + 2*Tk*kv_width + Tq*d_model)),
  which dominate the decode shape because the harness's layer projects its Tk key/value inputs on every call;
* ``gbytes_per_s``: the compulsory traffic of one call (query, key and value inputs, the four weight matrices
  and the output, each read or written once, in the benchmark's dtype) per second, and
  ``fraction_of_memory_bandwidth``.

The machine's roofs are measured the same way: :func:`gemm_peak_gflops` times a float32 GEMM and
:func:`memory_bandwidth_gbs` a float32 GEMV over a 256 MiB matrix (each byte of the matrix read once),
both with NumPy's BLAS under the benchmark's thread count, best of a few runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
FLOPS_FORMULA = "core: 4*B*h*Tq*Tk*d_head (x0.5 causal; x3.5 forward+backward); layer: core + projections"
BYTES_FORMULA = "compulsory traffic: query + key + value + 4 weight matrices + output, once each, in dtype"


@dataclass(frozen=True)
class Shape:
    """One benchmarked call: batch, query and key lengths, layer size, dtype, causal, backward."""

    batch: int
    tq: int
    tk: int
    d_model: int
    num_heads: int
    dtype: str = "float32"
    causal: bool = False
    backward: bool = False

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads


def core_flops(s: Shape) -> float:
    """4*B*h*Tq*Tk*d_head, halved for causal; forward+backward is 3.5x the forward count."""
    flops = 4.0 * s.batch * s.num_heads * s.tq * s.tk * s.d_head
    if s.causal:
        flops /= 2
    return flops * (3.5 if s.backward else 1.0)


def projection_flops(s: Shape) -> float:
    """The four x @ W projections (W_k, W_v of width d_model here: the benchmarks use full heads)."""
    flops = 2.0 * s.batch * s.d_model * (2 * s.tq * s.d_model + 2 * s.tk * s.d_model)
    return flops * (3.0 if s.backward else 1.0)


def compulsory_bytes(s: Shape) -> float:
    """query + key + value + output + 4 weight matrices, each moved once, in the dtype (self-attention reads x once)."""
    size = ITEMSIZE.get(s.dtype, 4)
    inputs = s.batch * s.tq * s.d_model if s.tq == s.tk else s.batch * (s.tq + 2 * s.tk) * s.d_model
    moved = (inputs + s.batch * s.tq * s.d_model + 4 * s.d_model * s.d_model) * size
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


def best_time(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``fn``, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """NumPy's float32 GEMM throughput (best of ``repeats``), what ``fraction_of_gemm_peak`` is of; the compute roof
    is the fastest installed library's (:mod:`~mha_harness.bench.gemm_roof`)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    return 2.0 * n ** 3 / best_time(lambda: a @ b, repeats) / 1e9


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """This machine's read bandwidth: a float32 GEMV over a ``mib`` MiB matrix (NumPy's BLAS), the memory roof."""
    n = int((mib * 2 ** 20 / 4) ** 0.5)
    a = np.ones((n, n), np.float32)
    x = np.ones(n, np.float32)
    return a.nbytes / best_time(lambda: a @ x, repeats) / 1e9
