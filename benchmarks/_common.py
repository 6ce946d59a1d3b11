"""Shared set-up for the asv benchmarks: parameters generated from the registry.

Every registered backend is a parameter value, so a new plugin is benchmarked with no new
benchmark code. Unavailable backends, and combinations a backend cannot run, raise
NotImplementedError in setup (asv records them as skipped); nothing here fails at import.

Environment knobs (for quick runs and tests): MHA_ASV_BACKENDS (comma-separated names),
MHA_ASV_SEQ_LENS (comma-separated lengths), MHA_ASV_MAX_CPU_SEQ (default 8192).
"""
from __future__ import annotations

import os

CPU_SEQ_LENS = (128, 256, 512, 1024, 2048, 4096, 8192)
GPU_SEQ_LENS = (16384, 32768, 65536)


def _backend_names() -> list[str]:
    wanted = [n for n in os.environ.get("MHA_ASV_BACKENDS", "").split(",") if n]
    if wanted:
        return wanted
    try:
        from mha_harness.registry import load_registry
        return [e.name for e in load_registry().entries.values() if e.backend is not None]
    except Exception:  # noqa: BLE001 - asv must still import this file
        return []


def _seq_lens() -> list[int]:
    text = os.environ.get("MHA_ASV_SEQ_LENS", "")
    if text:
        return [int(v) for v in text.split(",") if v]
    return list(CPU_SEQ_LENS + GPU_SEQ_LENS)


BACKENDS = _backend_names()
SEQ_LENS = _seq_lens()
CAUSAL = [False, True]
PARAMS = [BACKENDS, SEQ_LENS, CAUSAL]
PARAM_NAMES = ["backend", "seq_len", "causal"]
MAX_CPU_SEQ = int(os.environ.get("MHA_ASV_MAX_CPU_SEQ", "8192"))
_REGISTRY = None


def registry():
    global _REGISTRY
    if _REGISTRY is None:
        from mha_harness.registry import load_registry
        _REGISTRY = load_registry()
    return _REGISTRY


def half_dtype(backend) -> str:
    """float32 on CPU; on GPU the first declared half precision (bfloat16, else float16)."""
    if backend.device == "cpu":
        return "float32"
    return next((d for d in ("bfloat16", "float16") if d in backend.capabilities.dtypes), "float32")


def prepared(backend_name: str, seq_len: int, causal: bool, backward: bool = False):
    """(backend, prepared callable, BenchConfig) or NotImplementedError with the reason."""
    from mha_harness.bench.sweep import BenchConfig, _prepare
    from mha_harness.contract.api import Unsupported
    try:
        entry = registry().get(backend_name)
    except ValueError as exc:
        raise NotImplementedError(str(exc)) from None
    reason = entry.reason_unavailable
    if reason:
        raise NotImplementedError(reason)
    backend = entry.backend
    from mha_harness.bench.memory import pin_mmap_threshold
    pin_mmap_threshold()
    if backend.device == "cpu" and seq_len > MAX_CPU_SEQ:
        raise NotImplementedError(f"T={seq_len} is a GPU-only length (CPU sweep stops at {MAX_CPU_SEQ})")
    config = BenchConfig(dtype=half_dtype(backend))
    try:
        fn, why = _prepare(backend, config, seq_len, causal, backward)
    except Unsupported as exc:
        raise NotImplementedError(str(exc)) from None
    if fn is None:
        raise NotImplementedError(why)
    return backend, fn, config


class PreparedBenchmark:
    """Base of the asv benchmark classes: backend x sequence length x causal, prepared callable in setup."""

    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 600
    backward = False

    def setup(self, backend, seq_len, causal):
        self.backend, self.fn, self.config = prepared(backend, seq_len, causal, backward=self.backward)
