"""What a backend's output for one call is compared against: the float64 reference and the tolerance of a backend
in a given dtype, the largest error of several valid same-dtype algorithms (:func:`naive_forwards`). The
conformance cases and ``mha-harness bench``'s check of each benchmarked call share it."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionOutput, AttentionParams
from mha_harness.contract.reference import hashed_once, reference_attention
from mha_harness.contract.tolerance import Tolerance, farthest, naive_dtype, score_error_dtype, tolerance_from


def naive_forwards(params: AttentionParams, inputs: AttentionInputs, dtype: str, rows=None,
                   need_weights: bool = False) -> list[AttentionOutput]:
    """The same-dtype results whose largest error against the float64 reference sets the tolerance of a backend in
    ``dtype``: two valid algorithms rounding in :func:`naive_dtype`, the textbook one (the product of queries and
    keys scaled) and the fused kernels' (the queries scaled first, by the scale rounded to the dtype), and the
    float64 one whose scores each carry the rounding of :func:`score_error_dtype` at the size of their terms, with
    a pseudo-random sign (``reference_attention(..., score_error_of=)``; at large logits the softmax makes the
    scores' rounding the largest error, and which way each score happens to round decides one algorithm's error: it
    can be several times below another correct kernel's)."""
    low = naive_dtype(dtype)
    with hashed_once(params, inputs):
        return [reference_attention(params, inputs, rows=rows, need_weights=need_weights, dtype=low),
                reference_attention(params, inputs, rows=rows, need_weights=need_weights, dtype=low, scale_first=True),
                reference_attention(params, inputs, rows=rows, need_weights=need_weights,
                                    score_error_of=score_error_dtype(dtype))]


def tolerance_for(params: AttentionParams, inputs: AttentionInputs, dtype: str,
                  rows=None) -> tuple[np.ndarray, Tolerance]:
    """The float64 reference output (only the query ``rows`` when given) and the tolerance for a backend in
    ``dtype``, from the largest error of the estimates of :func:`naive_forwards`."""
    with hashed_once(params, inputs):
        expected = reference_attention(params, inputs, rows=rows).output
        naive = farthest((n.output for n in naive_forwards(params, inputs, dtype, rows)), expected)
    return expected, tolerance_from(expected, naive, dtype, length=inputs.tk)
