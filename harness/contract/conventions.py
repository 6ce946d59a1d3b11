"""Floating-point formats: rounding NumPy arrays to a named format, and its machine epsilon.

NumPy has no bfloat16, so it is emulated by rounding float32 to 8 mantissa bits
(round-to-nearest-even), which is exactly what a bfloat16 store does.
"""
from __future__ import annotations

import numpy as np

EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
NUMPY_COMPUTE = {"float64": np.float64, "float32": np.float32, "float16": np.float32, "bfloat16": np.float32}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round ``x`` to ``dtype``'s precision, returned in the NumPy dtype used to compute in it."""
    if dtype == "float64":
        return np.asarray(x, np.float64)
    if dtype == "float32":
        return np.asarray(x, np.float32)
    if dtype == "float16":
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        f = np.ascontiguousarray(x, dtype=np.float32)
        bits = f.view(np.uint32)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        out = ((bits + rounding) & np.uint32(0xFFFF0000)).view(np.float32)
        return np.where(np.isfinite(f), out, f)
    raise ValueError(f"dtype: got {dtype!r}; accepted: {', '.join(EPS)}")
