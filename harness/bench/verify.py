"""Bench times only calls it has seen compute the layer: one call's output, at a few query rows, against the float64
reference under the tolerance the conformance cases use (``mha_harness.contract.expected``).

A backend's prepared callable is its own code path, which conformance never runs (a jitted fast path, a fused
kernel, a decode step): a fast wrong answer would otherwise be benchmarked as a figure. In ``mha-harness bench``
the rows come from the backend's worker and the verdict is computed here, in the parent, where the plugin cannot
reach it."""
from __future__ import annotations

import contextlib

import numpy as np

from mha_harness.bench.calls import backend_arguments, checked_rows
from mha_harness.bench.metrics import Shape
from mha_harness.contract.conventions import EPS, other_alignment
from mha_harness.contract.expected import tolerance_for
from mha_harness.contract.mistakes import with_score_scale, without_output_projection, wrong_scales
from mha_harness.contract.reference import reference_attention
from mha_harness.contract.tolerance import bound_of

#: a point whose call returned something other than the layer's output, or a wrong one: it is not timed
WRONG_OUTPUT = "wrong-output"
#: the conformance case whose claim a benchmarked forward call repeats (a precision declared there applies here)
OUTPUT_CASE = "check_output_matches_reference"


class WrongOutput(Exception):
    """A benchmarked call's output is not the layer's output (None, another shape) or differs from the reference."""


def declared_precision(backend, dtype: str) -> str | None:
    """The dtype whose bound the backend's calls in ``dtype`` are held to, when it declares a ``precision:<bound>``
    divergence for ``dtype`` on the output case (verified by conformance): the loosest such bound, else None."""
    bounds = [d.behaviour.split(":", 1)[1] for d in backend.divergences
              if d.case == OUTPUT_CASE and d.behaviour.startswith("precision:") and d.when.get("dtype") == dtype]
    return max(bounds, key=lambda b: EPS[b]) if bounds else None


def known_mistake(got: np.ndarray, params, inputs, rows: list[int], bound: float) -> str:
    """The known mistake whose float64 output the checked ``rows`` of a wrong output ``got`` match, within
    ``max(10 * bound, 1e-3)`` (the conformance diagnoses' margin), as a message suffix; "" when none: the causal
    mask not applied, the other causal alignment (Tq != Tk), a common wrong score scale, W_o left out."""
    margin = max(10 * bound, 1e-3)

    def matches(p, call) -> bool:
        return float(np.max(np.abs(got - reference_attention(p, call, rows=rows).output))) <= margin
    candidates = []
    if inputs.causal is not None:
        candidates.append((params, inputs.replace(causal=None), f"the same call without its causal mask "
                           f"({inputs.causal}): the call does not apply it"))
        if inputs.tq != inputs.tk:
            other = other_alignment(inputs.causal)
            candidates.append((params, inputs.replace(causal=other), f"the {other} causal alignment instead of "
                               f"{inputs.causal}"))
    candidates += [(with_score_scale(params, factor), inputs, f"scores scaled by {label} instead of 1/sqrt(d_head)")
                   for factor, label in wrong_scales(params.config).items()]
    candidates.append((without_output_projection(params), inputs, "the heads' concatenation: W_o is not applied"))
    for p, call, what in candidates:
        if matches(p, call):
            return f"; the output matches {what}"
    return ""


def _where_to_look(shape: Shape) -> str:
    """What the user can run or compare to find the bug behind a wrong benchmarked output."""
    if shape.cached:
        return ("`mha-harness check` runs this decode step (prepare_decode_step) on a small cache and names known "
                "mistakes (attending before writing, the causal alignment ...)")
    return ("`mha-harness check` never runs prepare()'s call, so it cannot see this: compare the call with your "
            "compute() on the same inputs (the mask, the scale, W_o)")


def check_output(backend, shape: Shape, got: np.ndarray) -> dict:
    """Compare ``got``, the rows :func:`~mha_harness.bench.calls.checked_rows` of one call's output for
    ``shape`` (float64, (batch, rows, d_model)), with the float64 reference of the same call. Returns the record
    bench keeps with the point (rows checked, max error, bound); raises :class:`WrongOutput` when an entry is not
    finite or the error exceeds the bound."""
    params, inputs = backend_arguments(backend, shape)
    rows = checked_rows(inputs.tq)
    precision = declared_precision(backend, shape.dtype)
    with bound_of(precision) if precision else contextlib.nullcontext():
        expected, tol = tolerance_for(params, inputs, shape.dtype, rows=rows)
    got = np.asarray(got, np.float64)
    checked = f"{len(rows)} of its {inputs.tq} query row(s) checked against the float64 reference"
    if got.shape != expected.shape:
        raise WrongOutput(f"output rows of shape {got.shape}, expected {expected.shape} ({checked})")
    if not np.all(np.isfinite(got)):
        b, r, f = (int(i) for i in np.argwhere(~np.isfinite(got))[0])
        raise WrongOutput(f"output {got[b, r, f]} at batch {b}, position {rows[r]}, feature {f}: expected finite "
                          f"values ({checked})")
    diff = np.abs(got - expected)
    err = float(diff.max()) if diff.size else 0.0
    if err > tol.bound:
        b, r, f = (int(i) for i in np.unravel_index(int(diff.argmax()), diff.shape))
        raise WrongOutput(f"output differs from the float64 reference: expected {expected[b, r, f]:.6g}, got "
                          f"{got[b, r, f]:.6g} at batch {b}, position {rows[r]}, feature {f}; max error {err:.3g} "
                          f"({err / tol.bound:.3g} x the bound) exceeds {tol.describe()} ({checked})"
                          f"{known_mistake(got, params, inputs, rows, tol.bound)}; {_where_to_look(shape)}")
    return {"rows": len(rows), "max_error": err, "bound": tol.bound, "bound_dtype": tol.dtype,
            **({"declared_precision": precision} if precision else {})}
