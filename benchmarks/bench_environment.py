"""asv: the thread settings every benchmark ran with, recorded in the results next to the figures.

The parameter is what threadpoolctl reports (BLAS library, version, kernel, threading layer, and the OpenMP
runtime) after the same thread limit ``mha-harness bench --threads`` applies; the tracked value is the thread
count. A box forcing an older BLAS kernel (e.g. OPENBLAS_CORETYPE) shows up here as a different parameter.
"""
from ._common import THREADS


def _description() -> str:
    try:
        import numpy  # noqa: F401 - loads the BLAS threadpoolctl inspects
        from threadpoolctl import threadpool_info

        from mha_harness.bench.threads import apply_threads
        apply_threads(THREADS)
        pools = threadpool_info()
    except ImportError:
        return "threadpoolctl not installed"
    # sorted: threadpoolctl lists the pools in the order their libraries were loaded, which varies between runs,
    # and a different parameter string would start a new series in asv
    return "; ".join(sorted(f"{p.get('internal_api')} {p.get('version') or ''} {p.get('architecture') or ''} "
                            f"{p.get('threading_layer') or ''} x{p.get('num_threads')}".replace("  ", " ").strip()
                            for p in pools))


class ThreadSettings:
    params = [[_description()]]
    param_names = ["blas_and_openmp"]

    def track_threads(self, blas_and_openmp):
        return THREADS

    track_threads.unit = "threads"
