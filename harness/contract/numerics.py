"""Numerical building blocks shared by the reference and the NumPy backends."""
from __future__ import annotations

import numpy as np


def weighted_values(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``weights @ values`` where a zero weight contributes exactly nothing, even if the value is NaN or inf.

    A dense matmul computes 0 * NaN = NaN, so a masked (zero-weight) key holding NaN would
    poison every query. Here non-finite values are zeroed for the product and re-introduced
    only into the rows that give them non-zero weight.
    """
    finite = np.isfinite(values)
    if finite.all():
        return weights @ values
    out = weights @ np.where(finite, values, 0)
    for bad_value in (np.nan, np.inf, -np.inf):
        hit = np.isnan(values) if np.isnan(bad_value) else (values == bad_value)
        if hit.any():
            touched = (weights != 0).astype(weights.dtype) @ hit.astype(weights.dtype) > 0
            out = np.where(touched, bad_value if not np.isinf(bad_value) else out + bad_value, out)
    return out
