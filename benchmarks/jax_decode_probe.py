"""Is JAX's decode step slow on CPU because of the harness's step code, or because of XLA's CPU attention itself?

    python benchmarks/jax_decode_probe.py

Times in one process, median of 30 calls: a bare jitted ``jax.nn.dot_product_attention(q, k, v)`` with one query
against (1, 16384, 8, 64) float32 keys and values, then jax-dpa's and numpy-naive's decode steps at that shape
(projections, the cache write, attention over the cache, W_o).
"""
import statistics
import time

import numpy as np


def median_ms(fn, n=30):
    fn()
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    import jax
    import jax.numpy as jnp

    from mha_harness.bench.calls import prepared_call
    from mha_harness.bench.metrics import Shape
    from mha_harness.registry import load_registry
    T = 16384
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 8, 64), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((1, T, 8, 64), np.float32)) for _ in range(2))
    bare = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
    bare_ms = median_ms(lambda: bare(q, k, v).block_until_ready())
    print(f"bare jax.nn.dot_product_attention, Tq=1, Tk={T}: {bare_ms:.1f} ms")
    reg = load_registry()
    for name in ("jax-dpa", "numpy-naive"):
        step = prepared_call(reg.get(name).backend, Shape(1, 1, T, 512, 8, causal=True, cached=True))
        print(f"{name} decode step, Tq=1, Tk={T}: {median_ms(step):.1f} ms")


if __name__ == "__main__":  # asv imports this folder's modules: nothing runs on import
    main()
