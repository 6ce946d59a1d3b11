"""Peak extra memory of one call, measured per kind of backend rather than the process as a whole.

* ``tracemalloc`` (NumPy): NumPy reports its buffers to tracemalloc; peak minus the traced size before.
* ``rss`` (torch CPU, JAX CPU, plugins): Linux's peak resident size, reset just before the call by
  writing 5 to /proc/self/clear_refs, read from VmHWM; minus VmRSS before. Freed memory that the
  allocator kept would hide new allocations, so glibc's malloc_trim(0) returns it to the system
  first, and :func:`pin_mmap_threshold` (called once by the benchmarks) stops glibc from serving
  large buffers out of recycled heap, which would never raise the resident size. Page-granular,
  and it counts every thread of the process: keep other work out of it.
* ``cuda`` (torch CUDA): torch.cuda.reset_peak_memory_stats, then max_memory_allocated minus
  memory_allocated before.
* ``jax-device`` (JAX GPU): the device's memory_stats() peak_bytes_in_use minus bytes_in_use before
  (XLA has no reset, so the figure is exact only when this call sets a new peak).
"""
from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

METHODS = ("tracemalloc", "rss", "cuda", "jax-device")
#: the smallest figure each method resolves; below it a reading is shown as "below resolution", never fitted.
#: tracemalloc counts bytes but Python's own bookkeeping moves by kilobytes; RSS moves by pages, and a call's
#: thread stacks, allocator arenas and runtime state add up to about a MiB (``mha-harness fidelity`` measures
#: each method's noise floor on an empty call); the CUDA caching allocator rounds to 512 B blocks.
RESOLUTION_BYTES = {"tracemalloc": 16 * 1024, "rss": 2 * 2 ** 20, "cuda": 512, "jax-device": 4096}


def resolution_bytes(method: str) -> int:
    if method not in RESOLUTION_BYTES:
        raise ValueError(f"memory method: got {method!r}; accepted: {', '.join(METHODS)}")
    return RESOLUTION_BYTES[method]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _malloc_trim() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass


def pin_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold (its initial default, 128 KiB) so buffers above it are always fresh
    mappings whose pages count in VmHWM. glibc otherwise raises the threshold after the first large
    free, up to 32 MiB, and serves later buffers from already-resident heap, invisible to VmHWM."""
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def peak_extra_bytes(fn: Callable[[], object], method: str) -> int:
    """Run ``fn`` once and return the peak memory it needed beyond what was in use before."""
    gc.collect()
    if method == "tracemalloc":
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            result = fn()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        del result
        return max(0, peak - before)
    if method == "rss":
        _malloc_trim()
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current resident size
        before = _status_kib("VmRSS")
        result = fn()
        peak = _status_kib("VmHWM")
        del result
        return max(0, peak - before) * 1024
    if method == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del result
        return max(0, peak - before)
    if method == "jax-device":
        import jax
        device = jax.devices()[0]
        before = device.memory_stats()["bytes_in_use"]
        result = fn()
        peak = device.memory_stats()["peak_bytes_in_use"]
        del result
        return max(0, peak - before)
    raise ValueError(f"memory method: got {method!r}; accepted: {', '.join(METHODS)}")
