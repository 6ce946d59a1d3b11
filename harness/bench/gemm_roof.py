"""The compute roof: the fastest float32 GEMM any installed library reaches on this machine, under the benchmark's
thread count.

NumPy's BLAS alone is not the machine's peak: an environment may pin OpenBLAS to an older kernel
(``OPENBLAS_CORETYPE=Haswell`` on an AVX-512 machine, as on this project's boxes), where onnxruntime's MLAS and XLA
run a float32 GEMM about twice as fast (2026-12-02, 2 threads, 2048^3: NumPy 242, torch 202, onnxruntime 368, JAX 450
GFLOP/s), and a correct onnxruntime layer at 343 GFLOP/s was flagged as past "the" roof. So each installed library
(NumPy, torch, JAX, onnxruntime) times the same GEMM, in a child process (``python -m
mha_harness.bench.gemm_roof THREADS`` prints JSON), so that no framework's import or thread pool stays in the
benchmark's own process; the roof is the largest figure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

from mha_harness.bench.metrics import best_time
from mha_harness.util.text import clipped

#: the GEMM timed: float32, N x N times N x N, best of REPEATS after one warm-up
N, REPEATS = 2048, 5
LIBRARIES = ("numpy", "torch", "jax", "onnxruntime")


def _gflops(fn) -> float:
    return 2.0 * N ** 3 / best_time(fn, REPEATS) / 1e9


def _numpy(a, b, threads):
    return _gflops(lambda: a @ b)


def _torch(a, b, threads):
    import torch
    torch.set_num_threads(threads)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return _gflops(lambda: ta @ tb)


def _jax(a, b, threads):
    import jax
    import jax.numpy as jnp
    matmul = jax.jit(jnp.matmul)
    ja, jb = jax.device_put(a, jax.devices("cpu")[0]), jax.device_put(b, jax.devices("cpu")[0])
    return _gflops(lambda: matmul(ja, jb).block_until_ready())


def _onnxruntime(a, b, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper
    spec = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [N, N]) for n in "ABC"]
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"])], "gemm",
                                                spec[:2], spec[2:]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return _gflops(lambda: session.run(None, {"A": a, "B": b}))


def measure(threads: int) -> dict:
    """GFLOP/s of each installed library (or why it has none), in this process: run it in a child
    (:func:`gemm_roofs`), after :func:`~mha_harness.bench.threads.pin_cpus` and the thread environment."""
    from mha_harness.bench.threads import apply_threads
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((N, N), np.float32), rng.standard_normal((N, N), np.float32)
    out = {}
    for name in LIBRARIES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            apply_threads(threads)
            out[name] = round(globals()[f"_{name}"](a, b, threads), 1)
        except Exception as exc:  # noqa: BLE001 - one library's failure leaves the others' figures
            out[name] = clipped(f"{type(exc).__name__}: {exc}", 200)
    return out


def gemm_roofs(threads: int, timeout: float = 180.0) -> dict:
    """``{"by_library": {name: GFLOP/s or why not}, "gflops": the largest, "library": its name}``, measured in a
    child process pinned to ``threads`` CPUs with every library's thread count set to ``threads``; NumPy's figure is
    always there (measured in this process when the child could not give it)."""
    from mha_harness.bench.threads import thread_env
    env = {**os.environ, **thread_env(threads), "JAX_PLATFORMS": "cpu"}  # a CPU roof: JAX leaves any GPU alone
    try:
        done = subprocess.run([sys.executable, "-m", "mha_harness.bench.gemm_roof", str(threads)], env=env,
                              capture_output=True, text=True, timeout=timeout, check=True)
        by_library = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        by_library = {"others": f"not measured: the child process failed ({type(exc).__name__})"}
    if not isinstance(by_library.get("numpy"), (int, float)):
        from mha_harness.bench.metrics import gemm_peak_gflops
        by_library["numpy"] = round(gemm_peak_gflops(), 1)
    figures = {k: v for k, v in by_library.items() if isinstance(v, (int, float))}
    library = max(figures, key=figures.get)
    return {"by_library": by_library, "gflops": figures[library], "library": library}


def main(argv=None) -> None:
    from mha_harness.bench.threads import pin_cpus
    threads = int((argv or sys.argv[1:])[0])
    pin_cpus(threads)
    print(json.dumps(measure(threads)))


if __name__ == "__main__":
    main()
