"""Same threads for every backend: one count applied to BLAS, OpenMP/torch and XLA, and reported.

:func:`pin_cpus` restricts a benchmark worker to that many CPUs (what XLA's CPU runtime sizes its pools from),
:func:`thread_env` is the environment it starts with (read by OpenBLAS, MKL and OpenMP at
load time); :func:`apply_threads` then pins what can only be set at run
time (threadpoolctl's limit on every BLAS/OpenMP pool, torch.set_num_threads); :func:`thread_report` records
what threadpoolctl sees: each library, its version, thread count and kernel (OpenBLAS's ``architecture``,
which OPENBLAS_CORETYPE can force to an older one), so figures from different boxes compare honestly.
"""
from __future__ import annotations

import os
import sys

#: the default of ``--threads``: fixed, not "all cores", so figures from different boxes are comparable
DEFAULT_THREADS = 2
_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
         "NUMEXPR_NUM_THREADS")


def thread_env(threads: int) -> dict[str, str]:
    """Environment variables that give every library ``threads`` threads (XLA: eigen multi-threading on or off)."""
    env = {var: str(threads) for var in _VARS}
    xla = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_cpu_multi_thread_eigen", "intra_op_parallelism_threads"))]
    xla += [f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}",
            f"intra_op_parallelism_threads={threads}"]
    env["XLA_FLAGS"] = " ".join(xla)
    return env


def pin_cpus(threads: int) -> list[int] | None:
    """Restrict this process's thread and every thread it starts from now on to ``threads`` of the CPUs it may run
    on (the lowest-numbered), where it may run on more: the one limit XLA's CPU runtime obeys, since it sizes its
    thread pools from the affinity mask (``XLA_FLAGS``' ``intra_op_parallelism_threads`` and
    ``--xla_cpu_multi_thread_eigen`` change nothing in jax 0.10: a 1536² matmul used 2 CPU-seconds per second with
    them on this 2-core box, 1 when pinned to one CPU). The other libraries get the same count from
    :func:`thread_env` and :func:`apply_threads`. Returns the CPUs kept, None where nothing was restricted
    (``threads`` at least the CPUs allowed, no ``sched_setaffinity`` on this platform, or not permitted). Threads
    that already run keep their CPUs (e.g. a BLAS pool started at import; threadpoolctl limits those)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        allowed = sorted(os.sched_getaffinity(0))
        if threads >= len(allowed):
            return None
        keep = allowed[:max(1, threads)]
        os.sched_setaffinity(0, keep)
    except OSError:  # a container may forbid it: the other limits still hold
        return None
    return keep


def apply_threads(threads: int) -> None:
    """Pin the run-time thread counts of every loaded pool (BLAS, OpenMP) and of torch, if loaded."""
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(threads)
    except ImportError:
        pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_num_threads(threads)


def thread_report(threads: int) -> dict:
    """The requested count, the environment given, and what threadpoolctl reports for each loaded library."""
    try:
        from threadpoolctl import threadpool_info
        pools = [{k: v for k, v in pool.items() if k in ("user_api", "internal_api", "prefix", "version",
                                                           "num_threads", "threading_layer", "architecture")}
                 for pool in threadpool_info()]
    except ImportError:
        pools = "threadpoolctl is not installed"
    report = {"threads": threads, "env": thread_env(threads), "pools": pools}
    if hasattr(os, "sched_getaffinity"):
        report["cpus"] = sorted(os.sched_getaffinity(0))  # what XLA sizes its pools from (pin_cpus)
    if "torch" in sys.modules:
        report["torch_num_threads"] = sys.modules["torch"].get_num_threads()
    if os.environ.get("OPENBLAS_CORETYPE"):
        report["OPENBLAS_CORETYPE"] = os.environ["OPENBLAS_CORETYPE"]
    return report
