"""Figures that show the benchmarks measure what they claim (``mha-harness fidelity``).

1. Harness overhead: torch-sdpa's prepared callable against the same layer written directly
   (x @ W projections, F.scaled_dot_product_attention under the same sdpa_kernel, x @ W_o) on the
   same tensors, and jax-dpa's against a directly jitted jax.nn.dot_product_attention layer;
   interleaved repeats at T = 1024, ratio of medians (target <= 1.03).
2. Memory accuracy: numpy-naive's measured peak extra memory at T = 2048 and 4096 against the
   bytes its score matrices need: 3 * B * H * T^2 * itemsize (three score-sized arrays are live
   at the softmax's exp: scores, scores - max, exp(...)); target within 10%.
3. numpy-tiled against numpy-naive at T = 4096 (d_model 512, 8 heads, float32): peak extra memory
   ratio (target <= 1/10) and throughput ratio (target >= 1).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from mha_harness.bench.memory import peak_extra_bytes
from mha_harness.bench.sweep import rotated, warm_up
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.util.atomic import write_json_atomic


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median time of each callable over ``repeats`` rounds, the order rotating each round."""
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name in rotated(list(fns), r):
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def torch_overhead(seq_len: int = 1024, repeats: int = 60, kernel: str = "flash") -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from mha_harness.implementations.torch_sdpa import TorchSdpa, _sdp_backend
    config = AttentionConfig(512, 8)
    params, inputs = make_params(config), make_inputs(config, 1, seq_len)
    loaded = TorchSdpa(kernel, "cpu").load(params, dtype="float32")
    harness_fn = warm_up(loaded.prepare(inputs), 0.3)
    w = {name: loaded.w[name] for name in ("W_q", "W_k", "W_v", "W_o")}
    xq, xk, xv = harness_fn.native_inputs

    def direct():
        with torch.no_grad(), sdpa_kernel([_sdp_backend(kernel)]):
            q, k, v = ((x @ w[n]).reshape(1, seq_len, 8, 64).transpose(1, 2)
                       for x, n in ((xq, "W_q"), (xk, "W_k"), (xv, "W_v")))
            out = F.scaled_dot_product_attention(q, k, v)
            return out.transpose(1, 2).reshape(1, seq_len, 512) @ w["W_o"]
    medians = _interleaved({"harness": harness_fn, "direct": warm_up(direct, 0.3)}, repeats)
    return {"backend": f"torch-sdpa-{kernel}-cpu", "seq_len": seq_len, "repeats": repeats,
            "harness_median_s": medians["harness"], "direct_median_s": medians["direct"],
            "ratio": round(medians["harness"] / medians["direct"], 4), "target": "<= 1.03"}


def jax_overhead(seq_len: int = 1024, repeats: int = 60) -> dict:
    import jax

    from mha_harness.implementations.jax_dpa import JaxDpa
    config = AttentionConfig(512, 8)
    params, inputs = make_params(config), make_inputs(config, 1, seq_len)
    loaded = JaxDpa().load(params, dtype="float32")
    harness_fn = warm_up(loaded.prepare(inputs), 0.3)
    w = loaded.params
    x = loaded.array(inputs.query)

    @jax.jit
    def layer(w, x):
        q, k, v = ((x @ w[n]).reshape(1, seq_len, 8, 64) for n in ("W_q", "W_k", "W_v"))
        out = jax.nn.dot_product_attention(q, k, v, implementation="xla")
        return out.reshape(1, seq_len, 512) @ w["W_o"]

    def direct():
        return jax.block_until_ready(layer(w, x))
    medians = _interleaved({"harness": harness_fn, "direct": warm_up(direct, 0.3)}, repeats)
    return {"backend": "jax-dpa", "seq_len": seq_len, "repeats": repeats,
            "harness_median_s": medians["harness"], "direct_median_s": medians["direct"],
            "ratio": round(medians["harness"] / medians["direct"], 4), "target": "<= 1.03"}


def naive_memory_accuracy(seq_lens=(2048, 4096)) -> list[dict]:
    from mha_harness.implementations.numpy_naive import NumpyNaive
    config = AttentionConfig(512, 8)
    out = []
    for t in seq_lens:
        fn = NumpyNaive().load(make_params(config), dtype="float32").prepare(make_inputs(config, 1, t))
        fn()
        measured = peak_extra_bytes(fn, "tracemalloc")
        predicted = 3 * 1 * 8 * t * t * 4
        out.append({"seq_len": t, "measured_bytes": measured, "predicted_bytes": predicted,
                    "formula": "3 * B * H * T^2 * itemsize", "relative_error": round(measured / predicted - 1, 4),
                    "target": "within 10%"})
    return out


def tiled_vs_naive(seq_len: int = 4096, repeats: int = 5) -> dict:
    from mha_harness.implementations.numpy_naive import NumpyNaive
    from mha_harness.implementations.numpy_tiled import NumpyTiled
    config = AttentionConfig(512, 8)
    params, inputs = make_params(config), make_inputs(config, 1, seq_len)
    fns = {b.name: warm_up(b.load(params, dtype="float32").prepare(inputs), 0.0) for b in (NumpyNaive(), NumpyTiled())}
    memory = {name: peak_extra_bytes(fn, "tracemalloc") for name, fn in fns.items()}
    medians = _interleaved(fns, repeats)
    return {"seq_len": seq_len, "d_model": 512, "heads": 8, "dtype": "float32", "repeats": repeats,
            "peak_extra_bytes": memory, "median_s": medians,
            "memory_ratio_tiled_over_naive": round(memory["numpy-tiled"] / memory["numpy-naive"], 4),
            "throughput_ratio_tiled_over_naive": round(medians["numpy-naive"] / medians["numpy-tiled"], 3),
            "targets": {"memory_ratio": "<= 0.1", "throughput_ratio": ">= 1"}}


def run_fidelity(registry, names, results_dir: Path, threads: int = 2, repeats: int = 60) -> dict:
    import importlib.util
    doc = {"schema": "mha-harness/fidelity", "schema_version": "1.0"}
    # overhead first: the NumPy runs leave BLAS threads spinning that would disturb torch's timings
    doc["overhead"] = []
    if importlib.util.find_spec("torch"):
        doc["overhead"].append(torch_overhead(repeats=repeats))
    if importlib.util.find_spec("jax"):
        doc["overhead"].append(jax_overhead(repeats=repeats))
    for row in doc["overhead"]:
        print(f"  harness overhead {row['backend']} at T={row['seq_len']}: "
              f"prepared {row['harness_median_s'] * 1e3:.2f} ms"
              f" vs direct {row['direct_median_s'] * 1e3:.2f} ms, ratio {row['ratio']:.3f} (target <= 1.03)")
    print("numpy-tiled vs numpy-naive at T = 4096 ...", flush=True)
    doc["tiled_vs_naive"] = r = tiled_vs_naive()
    print(f"  peak extra memory: naive {r['peak_extra_bytes']['numpy-naive'] / 2**20:.1f} MiB, tiled "
          f"{r['peak_extra_bytes']['numpy-tiled'] / 2**20:.1f} MiB, ratio {r['memory_ratio_tiled_over_naive']:.3f} "
          f"(target <= 0.1)")
    print(f"  median time: naive {r['median_s']['numpy-naive'] * 1e3:.0f} ms, tiled "
          f"{r['median_s']['numpy-tiled'] * 1e3:.0f} ms, throughput ratio {r['throughput_ratio_tiled_over_naive']:.2f}"
          " (target >= 1)")
    print("numpy-naive memory accuracy ...", flush=True)
    doc["naive_memory_accuracy"] = rows = naive_memory_accuracy()
    for row in rows:
        print(f"  T={row['seq_len']}: measured {row['measured_bytes'] / 2**20:.1f} MiB, 3*B*H*T^2*4 = "
              f"{row['predicted_bytes'] / 2**20:.1f} MiB, error {100 * row['relative_error']:+.1f}% "
              "(target within 10%)")
    path = write_json_atomic(Path(results_dir) / "bench" / "fidelity.json", doc)
    print(f"  json: {path}")
    return doc
