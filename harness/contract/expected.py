"""What a backend's output and gradients for one call are compared against: the float64 reference and the tolerance
of a backend in a given dtype, from the largest error of several valid same-dtype algorithms (:func:`naive_forwards`,
:func:`naive_gradients`). The conformance cases and ``mha-harness bench``'s check of each benchmarked call share it."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionOutput, AttentionParams
from mha_harness.contract.reference import hashed_once, reference_attention, reference_vjp, reference_vjp_magnitudes
from mha_harness.contract.tolerance import (
    Tolerance,
    farthest,
    naive_dtype,
    score_error_dtype,
    textbook_score_error_dtype,
    tolerance_from,
)


def naive_forwards(params: AttentionParams, inputs: AttentionInputs, dtype: str, rows=None,
                   need_weights: bool = False) -> list[AttentionOutput]:
    """The same-dtype results whose largest error against the float64 reference sets the tolerance of a backend in
    ``dtype``: two valid algorithms rounding in :func:`naive_dtype`, the textbook one (the product of queries and
    keys scaled) and the fused kernels' (the queries scaled first, by the scale rounded to the dtype), and the
    float64 one whose scores each carry the rounding of :func:`score_error_dtype` at the size of their terms, with
    a pseudo-random sign (``reference_attention(..., score_error_of=)``; at large logits the softmax makes the
    scores' rounding the largest error, and which way each score happens to round decides one algorithm's error: it
    can be several times below another correct kernel's); in half precision also the float64 one whose scores carry
    that dtype's rounding (:func:`~mha_harness.contract.tolerance.textbook_score_error_dtype`: a textbook kernel in
    it rounds q, k and the scores to it). Each score-error estimate's q and k projections carry their own rounding
    (``projection_error_of``: in every layer since 2026-12-07, where terms that cancel at large logits made it a
    row's largest error); in a layer with a q/k norm, where it comes before the norm, each is also taken with its
    scores' error the other way round (``score_error_sign=-1``: in one draw the two can cancel, 2026-12-06)."""
    low, half, score = naive_dtype(dtype), textbook_score_error_dtype(dtype), score_error_dtype(dtype)
    out = {"rows": rows, "need_weights": need_weights}
    with hashed_once(params, inputs):
        return [reference_attention(params, inputs, dtype=low, **out),
                reference_attention(params, inputs, dtype=low, scale_first=True, **out)] + \
            [reference_attention(params, inputs, score_error_of=of, projection_error_of=score, score_error_sign=sign,
                                 **out) for of in (score, half) if of is not None for sign in score_error_signs(params)]


def score_error_signs(params: AttentionParams) -> tuple[int, ...]:
    """The signs each score-error estimate is taken with: (1, -1) in a layer with a q/k norm (its projections'
    error and its scores' can cancel in one draw), (1,) otherwise."""
    return (1, -1) if params.config.qk_norm is not None else (1,)


def tolerance_for(params: AttentionParams, inputs: AttentionInputs, dtype: str,
                  rows=None) -> tuple[np.ndarray, Tolerance]:
    """The float64 reference output (only the query ``rows`` when given) and the tolerance for a backend in
    ``dtype``, from the largest error of the estimates of :func:`naive_forwards`."""
    with hashed_once(params, inputs):
        expected = reference_attention(params, inputs, rows=rows).output
        naive = farthest((n.output for n in naive_forwards(params, inputs, dtype, rows)), expected)
    return expected, tolerance_from(expected, naive, dtype, length=inputs.tk)


def naive_gradients(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray, dtype: str,
                    form: str) -> list[dict]:
    """The same-dtype backwards whose errors bound a backend's in ``dtype`` (for :func:`assert_gradients_close`),
    in ``form``: the textbook one and FlashAttention-2's (weights recomputed from the log-sum-exp, the softmax row
    term from the output: torch's SDPA kernels compute it so), rounding in :func:`naive_dtype`, and each of the two
    in float64 with the weights carrying the rounding of the scores in :func:`score_error_dtype` (the textbook
    one's normalised, FlashAttention's ``exp(s - lse)`` not: at large logits the largest error, see
    :func:`naive_forwards` and ``reference_vjp(..., score_error_of=)``); in half precision also the textbook one
    whose weights carry that dtype's rounding of the scores (FlashAttention's keeps its scores and log-sum-exp in
    float32); with both signs of the scores' error in a layer with a q/k norm, as :func:`naive_forwards`'."""
    low, half, score = naive_dtype(dtype), textbook_score_error_dtype(dtype), score_error_dtype(dtype)
    with hashed_once(params, inputs):
        grads = [reference_vjp(params, inputs, cotangent, dtype=low, flash=flash) for flash in (False, True)]
        for sign in score_error_signs(params):
            grads += [reference_vjp(params, inputs, cotangent, flash=flash, score_error_of=score,
                                    score_error_sign=sign) for flash in (False, True)]
            if half is not None:
                grads.append(reference_vjp(params, inputs, cotangent, score_error_of=half, projection_error_of=score,
                                           score_error_sign=sign))
    return [input_gradients(g, form) for g in grads]


def input_gradient_terms(terms: dict, form: str) -> dict:
    """:func:`~mha_harness.contract.reference.reference_vjp_magnitudes` per distinct input of ``form``, as
    :func:`input_gradients` combines the gradients: the uses of one x add their terms, so their root-sum-squares
    combine as the root of the summed squares."""
    squared = input_gradients({name: np.square(t) for name, t in terms.items()}, form)
    return {name: np.sqrt(t) for name, t in squared.items()}


def gradient_reduction_length(params: AttentionParams, inputs: AttentionInputs) -> int:
    """The longest sum a backward takes: a weight gradient over batch x positions, or a projection's over
    d_model (the tolerance floor's ``n``)."""
    return max(inputs.batch * max(inputs.tq, inputs.tk), params.config.d_model)


def input_gradients(grads: dict, form: str) -> dict:
    """The reference's per-array gradients (query, key, value) summed per distinct input of ``form``:
    ``self`` -> ``query`` = d/dx; ``shared_kv`` -> ``query`` and ``key`` = d/dx_kv; ``kv_cache`` -> ``query`` =
    d/dx_new (its query, key and value uses: x_new is also x_kv's last Tq rows) and ``key`` = d/dx_cached, the
    gradient of the cached positions' input (batch, Tk - Tq, d_model), absent when nothing is cached; parameters
    unchanged."""
    out = dict(grads)
    if form == "self":
        out["query"] = grads["query"] + grads["key"] + grads["value"]
        del out["key"], out["value"]
    elif form == "shared_kv":
        out["key"] = grads["key"] + grads["value"]
        del out["value"]
    elif form == "kv_cache":
        kv = grads["key"] + grads["value"]
        tq, tk = grads["query"].shape[1], kv.shape[1]
        out["query"] = grads["query"] + kv[:, tk - tq:]
        out["key"] = kv[:, :tk - tq]
        del out["value"]
        if tk == tq:
            del out["key"]
    return out


def gradient_names(params: AttentionParams, inputs: AttentionInputs, form: str) -> list[str]:
    """The gradients a backward of a layer taking ``form`` returns (:func:`input_gradients`' names: one per distinct
    input, then one per parameter), known before any reference is computed: :func:`input_gradients` applied to
    placeholders of the inputs' lengths."""
    placeholders = {"query": np.zeros((1, inputs.tq, 1)), "key": np.zeros((1, inputs.tk, 1)),
                    "value": np.zeros((1, inputs.tk, 1))}
    return list(input_gradients(placeholders, form)) + list(params.arrays())


def gradient_tolerances(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray, dtype: str,
                        form: str, select=None) -> dict[str, tuple[np.ndarray, Tolerance]]:
    """Per gradient of ``sum(output * cotangent)`` in ``form`` (:func:`input_gradients`): the float64 reference and
    the tolerance for a backend in ``dtype``, from the valid same-dtype backwards (:func:`naive_gradients`), the
    size of the terms each gradient sums (:func:`input_gradient_terms`) and the longest sum
    (:func:`gradient_reduction_length`). ``select(name, array)``: the part of each gradient compared (e.g. a few
    rows), applied to the reference, the estimates and the terms alike; all of it when None."""
    with hashed_once(params, inputs):
        exact = input_gradients(reference_vjp(params, inputs, cotangent), form)
        terms = input_gradient_terms(reference_vjp_magnitudes(params, inputs, cotangent), form)
        naive = naive_gradients(params, inputs, cotangent, dtype, form)
    return gradient_bounds(exact, naive, dtype, gradient_reduction_length(params, inputs), terms, select)


def gradient_bounds(exact: dict, estimates: list[dict], dtype: str, length: int, terms: dict | None = None,
                    select=None) -> dict[str, tuple[np.ndarray, Tolerance]]:
    """Per gradient in ``exact``: (the reference, its tolerance in ``dtype``) from the same-dtype ``estimates`` (the
    one farthest from the reference), reductions of ``length`` terms and the size of the ``terms`` each gradient
    sums (without them, |reference|). ``select(name, array)``: the part compared, applied to all alike."""
    pick = select or (lambda name, array: array)
    out = {}
    for name, full in exact.items():
        expected = pick(name, full)
        honest = farthest((pick(name, e[name]) for e in estimates), expected)
        size = None if terms is None else pick(name, terms[name])
        out[name] = (expected, tolerance_from(expected, honest, dtype, length=length, terms=size))
    return out
