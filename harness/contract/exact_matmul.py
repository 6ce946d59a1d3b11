"""Affine maps ``x @ w + b`` in float64, within one unit in the last place of the exact sum: the reference's
projections.

A float64 matmul rounds each of its partial sums, so an entry whose terms cancel (0.08 summed from terms of about
30) carries an error of float64's unit roundoff times the terms, not times the entry. The float64 reference's q and
k projections feed every score of a row; at large logits that error moves the row's weights as much as a correct
float64 kernel's own rounding does, and the reference stops being a reference (docs/cases.md, the tolerance rule).

The error-free splitting of Ozaki, Ogita, Oishi and Rump (Numerical Algorithms 59, 2012) makes the products exact:
each row of ``x`` and each column of ``w`` is cut into :data:`SLICES` slices whose entries share that row's
(column's) power of two and carry few enough bits (53 - beta, beta = ceil((53 + ceil(log2 n)) / 2)) that a product
of two slices, summed over ``n`` terms in any order, is exact in float64. The first slices' product and the bias are
added error-free (Knuth's TwoSum); the products of later slices, each 2^-(53 - beta) smaller than the one before, are
added to that error in float64, and the two are added: each entry is the exact sum rounded once, or one unit in
the last place beside it where the later products' float64 sum rounds too.
"""
from __future__ import annotations

import math

import numpy as np

#: slices per row of ``x`` and column of ``w``; products of slices i and j with i + j >= SLICES are left out, as is
#: what the slices leave of each entry: together below n * 2^-(SLICES * (53 - beta)) * max|x_row| * max|w_col|
#: (2^-79 of it at n = 512, 2^-91 at n = 32), float64's own rounding of the terms being 2^-53 of their size
SLICES = 4


def _beta(n: int) -> int:
    return math.ceil((53 + math.ceil(math.log2(max(n, 2)))) / 2)


def _slices(a: np.ndarray, axis: int, n: int) -> list[np.ndarray]:
    """``a``'s leading :data:`SLICES` slices along the summed axis: in each, every entry of a row (``axis`` = 1) or
    column (``axis`` = 0) is a multiple of 2^(tau + beta - 52) below 2^(tau + 1), tau = ceil(log2 max |row|), where
    tau is the remainder's, so that two slices' products summed over ``n`` terms are exact."""
    beta, out, rest = _beta(n), [], a
    for _ in range(SLICES):
        top = np.max(np.abs(rest), axis=axis, keepdims=True)
        tau = np.ceil(np.log2(np.where(top > 0, top, 1.0))).astype(np.int64)
        sigma = np.ldexp(1.0, tau + beta)
        part = (rest + sigma) - sigma
        out.append(part)
        rest = rest - part
    return out


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``s, e`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _representable(x: np.ndarray, axis: int) -> np.ndarray:
    """Rows (``axis`` = 1) or columns (``axis`` = 0) that are finite and small enough for their slices' scale."""
    return np.all(np.isfinite(x) & (np.abs(x) < 2.0 ** 900), axis=axis)


def exact_affine(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ w + bias`` for float64 ``x`` (..., n), ``w`` (n, m) and ``bias`` (m,): each entry within one unit in
    the last place of the exact value (unless the terms cancel to within 2^20 of the bound in :data:`SLICES`).
    Rows of ``x`` holding NaN, an infinity or values beyond 2^900 (every row, if ``w`` does) get the ordinary
    matmul, whose NaN or infinity is what they propagate."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    lead, n = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, n)
    b = 0.0 if bias is None else np.asarray(bias, np.float64)
    if flat.size == 0 or w.size == 0 or not _representable(w, 0).all():
        return (flat @ w + b).reshape(*lead, w.shape[-1])
    ok = _representable(flat, 1)
    left, right = _slices(np.where(ok[:, None], flat, 0.0), 1, n), _slices(w, 0, n)
    head, error = _two_sum(left[0] @ right[0], np.broadcast_to(b, (flat.shape[0], w.shape[-1])))
    for i in range(SLICES):
        for j in range(SLICES - i):
            if i + j:
                error = error + left[i] @ right[j]
    out = head + error
    if not ok.all():  # the ordinary matmul only for the rows it is kept for
        out = np.where(ok[:, None], out, flat @ w + b)
    return out.reshape(*lead, w.shape[-1])
