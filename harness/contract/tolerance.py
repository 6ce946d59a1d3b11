"""The one tolerance rule every case uses (the flash-attention method).

A backend computing in ``dtype`` may differ from the float64 reference by at most

    FACTOR * naive_error + FLOOR_ULPS * eps(dtype) * magnitude * sqrt(n)

where ``naive_error`` is the max error that the naive algorithm *in the same dtype* makes
against that reference (the largest of several estimates: the textbook algorithm, the fused kernels' with the
queries scaled first or FlashAttention's backward, the float64 one whose scores carry float32's rounding,
``score_error_dtype``, and in half precision the float64 one whose scores carry that dtype's,
``textbook_score_error_dtype``; ``mha_harness.contract.expected.naive_forwards`` and
``mha_harness.contract.expected.naive_gradients`` list them), ``magnitude`` is max(1, max |reference|) and ``n``
the length of the longest reduction (the number of keys). For gradients ``magnitude`` is max(1, max |reference|,
the largest root-sum-square of the terms each gradient sums; see ``reference_vjp_magnitudes``),
so the floor covers the softmax backward's cancellation. The floor is the typical rounding error
of an n-term accumulation in *some* order: the naive estimate uses NumPy's pairwise sums, and a
backend summing in another valid order (sequential, blocked) is not wrong for it; one sample of
the naive error can also be accidentally tiny where terms cancel. So a
float16 backend is held to float16's own honest error, not to a fixed atol that is loose
for float64 and impossible for bfloat16; real bugs (a leaked key, a wrong scale) are
orders of magnitude above the bound.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import numpy as np

from mha_harness.contract.conventions import EPS
from mha_harness.contract.scoped import scoped

FACTOR = 3.0
FLOOR_ULPS = 1.0
#: set while a declared ``precision:<dtype>`` divergence is verified: bounds are those of that dtype
_BOUND_DTYPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("bound_dtype", default=None)


@contextlib.contextmanager
def bound_of(dtype: str):
    """Within this block every tolerance is the bound of ``dtype``, whatever dtype the backend ran in."""
    with scoped(_BOUND_DTYPE, dtype):
        yield


def bound_dtype(dtype: str) -> str:
    """The dtype whose bound applies to a run in ``dtype`` (itself, unless a precision declaration is verified)."""
    return _BOUND_DTYPE.get() or dtype


@dataclass(frozen=True)
class Tolerance:
    """The bound and the naive same-dtype error it was derived from."""

    bound: float
    naive_error: float
    dtype: str

    def describe(self) -> str:
        return (f"tolerance {self.bound:.3g} = {FACTOR:g} x naive {self.dtype} error {self.naive_error:.3g}"
                f" + eps*sqrt(n) floor")


def max_abs_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """The largest absolute difference, NaN entries left out (0 when every entry is NaN, as where a declared NaN
    convention makes a whole gradient NaN)."""
    diff = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    finite = diff[~np.isnan(diff)]
    return float(finite.max()) if finite.size else 0.0


def farthest(estimates, expected: np.ndarray) -> np.ndarray:
    """Of several valid same-dtype results (one per algorithm), the one farthest from ``expected``: the honest
    error the tolerance rule starts from is the largest of theirs."""
    return max(estimates, key=lambda a: max_abs_error(a, expected))


def tolerance_from(expected64: np.ndarray, naive_same_dtype: np.ndarray, dtype: str, length: int = 1,
                   terms: np.ndarray | None = None) -> Tolerance:
    """Bound for a backend in ``dtype`` given the reference and the naive algorithm in ``dtype``.

    For float64 the reference *is* the naive algorithm, so its own error cannot be measured
    against itself: pass the naive float32 result instead, and its error is scaled by the
    ratio of the unit roundoffs (2^-52 / 2^-23), rounding error being linear in it.

    ``terms``: the size of the terms the computation of each entry sums (their root-sum-square, e.g.
    :func:`~mha_harness.contract.reference.reference_vjp_magnitudes`); the floor's magnitude is then the largest
    of it and |reference|. Rounding error grows with the terms, not with their (possibly cancelled) sum, and one
    sample of the naive error can be accidentally tiny there.
    """
    dtype = bound_dtype(dtype)
    naive_error = max_abs_error(naive_same_dtype, expected64)
    if dtype == "float64":
        naive_error *= EPS["float64"] / EPS["float32"]
    size = np.abs(expected64) if terms is None else np.fmax(np.abs(expected64), np.asarray(terms, np.float64))
    magnitude = max(1.0, float(np.nanmax(size))) if np.isfinite(size).any() else 1.0
    floor = FLOOR_ULPS * EPS[dtype] * magnitude * float(np.sqrt(max(1, length)))
    return Tolerance(FACTOR * naive_error + floor, naive_error, dtype)


def naive_dtype(dtype: str) -> str:
    """The dtype to run the naive algorithm in, to estimate a backend's honest error in ``dtype``."""
    dtype = bound_dtype(dtype)
    return "float32" if dtype == "float64" else dtype


def score_error_dtype(dtype: str) -> str:
    """The dtype whose rounding the scores and softmax statistics get in the tolerance's score-error estimate
    (``score_error_of`` of the reference) for a backend in ``dtype``: float32, since kernels in half precision
    still accumulate scores and keep the row maximum and log-sum-exp in float32 (their half-precision rounding of
    inputs and weights is what the textbook estimate in that dtype makes); for float64, float32 scaled by the ratio
    of the unit roundoffs, as every naive estimate of float64."""
    return "float32"


def textbook_score_error_dtype(dtype: str) -> str | None:
    """For a backend in half precision, that dtype: the dtype whose rounding the scores get in the estimate of a
    textbook kernel in it (``score_error_of`` of the reference, the projections' still at
    :func:`score_error_dtype`). Such a kernel (torch's ops on half tensors, attention written out) rounds its
    normed or rotated q and k and each score's product to the half dtype: at large scores (a q/k norm's gains,
    large logits) which way each of those rounds moves the weights by the half dtype's unit roundoff times the
    score, and the textbook estimate in that dtype is one draw of those signs, several times below another's
    (torch-eager's bfloat16 gradients at 1.03-1.7 x the bound without it, 2026-12-06). None for float32 and
    float64, whose kernels :func:`score_error_dtype` already describes."""
    dtype = bound_dtype(dtype)
    return dtype if dtype in ("bfloat16", "float16") else None
