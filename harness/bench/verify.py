"""Bench times only calls it has seen compute the layer: one call's output, at a few query rows, or a forward +
backward call's gradients, a few rows of each, against the float64 reference under the tolerance the conformance
cases use (``mha_harness.contract.expected``).

A backend's prepared callable is its own code path, which conformance never runs (a jitted fast path, a fused
kernel, a decode step): a fast wrong answer would otherwise be benchmarked as a figure. In ``mha-harness bench``
the rows come from the backend's worker and the verdict is computed here, in the parent, where the plugin cannot
reach it."""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from mha_harness.bench.calls import backend_arguments, checked_rows, gradient_part
from mha_harness.bench.metrics import Shape
from mha_harness.contract.alibi_diagnoses import alibi_hint
from mha_harness.contract.conventions import EPS
from mha_harness.contract.expected import gradient_names, gradient_tolerances, input_gradients, tolerance_for
from mha_harness.contract.mistakes import (
    ATTENDS_BEFORE_WRITING,
    KV_HEADS_TILED,
    OFFSET_NEGATED,
    QUERY_CHUNKS,
    WRITTEN_ONE_SLOT_LATE,
    alignment_mistake,
    causal_mask_mistakes,
    chunk_relative,
    chunk_relative_words,
    explains,
    explains_as_a_scale,
    frozen_parameters_hint,
    with_kv_heads_tiled,
    with_score_scale,
    without_output_projection,
    written_one_slot_late,
    wrong_input_calls,
    wrong_scales,
)
from mha_harness.contract.qk_norm_diagnoses import qk_norm_hint
from mha_harness.contract.reference import (
    reference_attention,
    reference_vjp,
    score_scale_declared,
    score_scale_named,
    scores_as_declared,
)
from mha_harness.contract.rotary_diagnoses import rotary_hint
from mha_harness.contract.scores_fit import scores_mismatch
from mha_harness.contract.tolerance import bound_of
from mha_harness.contract.window_diagnoses import window_hint

#: a point whose call returned something other than the layer's output, or a wrong one: it is not timed
WRONG_OUTPUT = "wrong-output"
#: the conformance case whose claim a benchmarked forward call repeats (a precision declared there applies here)
OUTPUT_CASE = "check_output_matches_reference"
#: the conformance case whose claim a benchmarked forward + backward call repeats
GRADIENT_CASE = "check_gradients_match_reference"
#: the largest batch x heads x Tq x Tk whose gradients bench checks: the float64 reference backward and the four
#: same-dtype backwards of its tolerance hold several arrays of this many scores (about 3 GiB and 35 s of the
#: harness's own time at 2**25, T = 2048 with 8 heads, on a 2-core box); larger points are timed unchecked, saying so
GRADIENT_CHECK_SCORES = 2 ** 25


class WrongOutput(Exception):
    """A benchmarked call's output is not the layer's output (None, another shape) or differs from the reference."""


def declared_precision(backend, dtype: str, case: str = OUTPUT_CASE) -> str | None:
    """The dtype whose bound the backend's calls in ``dtype`` are held to, when it declares a ``precision:<bound>``
    divergence for ``dtype`` on ``case`` (verified by conformance): the loosest such bound, else None."""
    bounds = [d.behaviour.split(":", 1)[1] for d in backend.divergences
              if d.case == case and d.behaviour.startswith("precision:") and d.when.get("dtype") == dtype]
    return max(bounds, key=lambda b: EPS[b]) if bounds else None


def known_mistake(got: np.ndarray, params, inputs, rows: list[int], bound: float) -> str:
    """The known mistake whose float64 output the checked ``rows`` of a wrong output ``got`` match, within ``max(10 *
    bound, 1e-3)`` (the conformance diagnoses' margin), as a message suffix; "" when none: the causal mask not applied,
    the other causal alignment (Tq != Tk), a causal mask one key too wide, reversed or without its diagonal, a common
    wrong score scale, W_o left out, grouped-query key/value heads tiled, a decode step's new keys and values written
    one slot too far, a cross-attention call's keys or values projected from the wrong input
    (:func:`~mha_harness.contract.mistakes.wrong_input_calls`); every one that matches and explains ``got`` better than
    the correct layer (:func:`~mha_harness.contract.mistakes.explains`; a decode step's one query against a long cache
    can match two), a wrong scale also better than uniform weights
    (:func:`~mha_harness.contract.mistakes.explains_as_a_scale`); when none does, a mistake of the layer's sliding
    window, rotary embeddings or q/k norm, or a norm kept on in a layer without one (the diagnoses ``check`` names:
    :mod:`~mha_harness.contract.window_diagnoses`, :mod:`~mha_harness.contract.rotary_diagnoses`,
    :mod:`~mha_harness.contract.qk_norm_diagnoses`), then scores soft-capped or scaled otherwise than declared
    (:func:`~mha_harness.contract.scores_fit.scores_mismatch`, within twice the bound)."""
    margin = max(10 * bound, 1e-3)
    truth = reference_attention(params, inputs, rows=rows).output

    uniform = functools.cache(lambda: reference_attention(with_score_scale(params, 0.0), inputs, rows=rows).output)

    def matches(p, call, scale: bool) -> bool:
        wrong = reference_attention(p, call, rows=rows).output
        if float(np.max(np.abs(got - wrong))) > margin:
            return False
        return explains_as_a_scale(got, wrong, truth, uniform()) if scale else explains(got, wrong, truth)
    candidates = [(params, call, what, False) for call, what in _causal_mask_mistakes(inputs, "call")]
    declared = score_scale_declared()
    true = (" instead of 1/sqrt(d_head)" if declared is None
            else f", not by the declared score_scale {score_scale_named()}")
    candidates += [(with_score_scale(params, factor), inputs, f"scores scaled by {label}{true}", True)
                   for factor, label in wrong_scales(params.config, declared).items()]
    candidates.append((without_output_projection(params), inputs, "the heads' concatenation: W_o is not applied",
                       False))
    tiled = with_kv_heads_tiled(params)
    if tiled is not None:
        candidates.append((tiled, inputs, KV_HEADS_TILED, False))
    late = written_one_slot_late(params, inputs)
    if late is not None:
        candidates.append((params, late, WRITTEN_ONE_SLOT_LATE, False))
    # a cross-attention layer's keys or values from the wrong input (the cross workload's most typical bug)
    candidates += [(params, call, what, False) for what, call in wrong_input_calls(inputs)]
    found = [what for p, call, what, scale in candidates if matches(p, call, scale)]
    if not found:  # the layer's features: a window, rotary embeddings or a q/k norm dropped, turned or counted
        feature = (window_hint(got, params, inputs, bound, rows) if params.config.sliding_window is not None else "") \
            or (rotary_hint(got, params, inputs, bound, rows=rows) if params.config.rotary else "") \
            or alibi_hint(got, params, inputs, bound, rows) \
            or qk_norm_hint(got, params, inputs, bound, rows=rows)  # otherwise: a norm kept on
        if feature:
            return feature
        fitted = scores_mismatch(got, params, inputs, bound, rows=rows)
        if fitted:
            return fitted
    if len(found) > 1:  # at some shapes (one query, a long cache) two mistakes give outputs alike at these rows
        return (f"; the checked rows cannot tell {len(found)} mistakes apart, the output matches each: "
                + "; or ".join(found))
    return f"; the output matches {found[0]}" if found else ""


def _causal_mask_mistakes(inputs, what: str) -> list[tuple]:
    """(call, description) of the causal-mask mistakes a wrong ``what`` ("call": its output; "backward": its
    gradients) of the causal call ``inputs`` is compared against: the mask not applied, the other alignment
    (Tq != Tk), and without other masks one key too wide, reversed, without its diagonal, inverted or (bottom-right,
    Tq != Tk) with its offset negated (in a KV-cache step a mask without its diagonal also named as attending before
    writing, as check names it); none without a causal mask."""
    if inputs.causal is None:
        return []
    words = {"not_applied": f"the same call without its causal mask ({inputs.causal}): the {what} does not apply it",
             "other_alignment": f"the causal mask's {alignment_mistake(inputs.causal, inputs.form)}",
             "one_key_too_wide": "a causal mask one key too wide (query i also sees key i + 1: tril(1) where tril "
                                 "belongs)",
             "reversed": "a reversed causal mask (query i sees key i and every later key: triu where tril belongs)",
             "no_diagonal": "a causal mask that excludes the diagonal (query i cannot see its own key)"
                            + (f" ({ATTENDS_BEFORE_WRITING})" if inputs.form == "kv_cache" else ""),
             "inverted": "the causal mask inverted (query i sees only the keys after i: the mask's polarity "
                         "flipped)",
             "offset_negated": OFFSET_NEGATED,
             **{chunk_relative(chunk): chunk_relative_words(chunk) for chunk in QUERY_CHUNKS}}
    return [(call, words[name]) for name, call in causal_mask_mistakes(inputs).items()]


def _where_to_look(shape: Shape) -> str:
    """What the user can run or compare to find the bug behind a wrong benchmarked output: the places a mistake
    hides in this layer, its features (rotary embeddings, q/k norm, sliding window) among them."""
    features = "".join(f", {what}" for what, present in (("the rotary positions", shape.rotary),
                                                         ("the q/k norm", shape.qk_norm),
                                                         ("the sliding window", shape.sliding_window is not None),
                                                         ("the ALiBi bias", shape.alibi))
                       if present)
    if shape.cached:
        return ("`mha-harness check` runs this decode step (prepare_decode_step) on a small cache and names known "
                f"mistakes (attending before writing, writing one slot too far, the cache's keys and values "
                f"swapped, the causal alignment{features} ...)")
    return ("`mha-harness check` runs your compute(), never prepare()'s call: if check passes, the mistake is in the "
            f"call's own path, so compare it with compute() on the same inputs (the mask, the scale, W_o{features}); "
            "if check fails too, its diagnosis names more")


def check_output(backend, shape: Shape, got: np.ndarray) -> dict:
    """:func:`_check_output` against the reference of the scores the backend declares (its ``logit_softcap`` and
    ``score_scale``)."""
    with scores_as_declared(backend.capabilities):
        return _check_output(backend, shape, got)


def _check_output(backend, shape: Shape, got: np.ndarray) -> dict:
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
    err, wrong = _mismatch(got, expected, tol.bound, lambda at: f"batch {at[0]}, position {rows[at[1]]}, feature "
                           f"{at[2]}")
    if wrong and not np.isfinite(err):
        raise WrongOutput(f"output {wrong} ({checked})")
    if wrong:
        raise WrongOutput(f"output {wrong}; max error {err:.3g} ({err / tol.bound:.3g} x the bound) exceeds "
                          f"{tol.describe()} ({checked}){_float32_level(err, tol, shape.dtype, OUTPUT_CASE)}"
                          f"{known_mistake(got, params, inputs, rows, tol.bound)}; {_where_to_look(shape)}")
    return {"rows": len(rows), "max_error": err, "bound": tol.bound, "bound_dtype": tol.dtype,
            **({"declared_precision": precision} if precision else {})}


def check_gradients(backend, shape: Shape, got: dict) -> dict:
    """:func:`_check_gradients` against the reference of the scores the backend declares (its ``logit_softcap`` and
    ``score_scale``)."""
    with scores_as_declared(backend.capabilities):
        return _check_gradients(backend, shape, got)


def _check_gradients(backend, shape: Shape, got: dict) -> dict:
    """Compare the gradients of one forward + backward call for ``shape`` (as
    :meth:`~mha_harness.bench.calls.PreparedPoint.checked_values` sends them: each name's full shape and its
    :func:`~mha_harness.bench.calls.gradient_part`) with the float64 reference's gradients of ``output.sum()`` in the
    backend's declared input form, under the conformance gradient case's tolerance
    (:func:`~mha_harness.contract.expected.gradient_tolerances`). Returns the record bench keeps with the point
    (the worst gradient's error and bound); raises :class:`WrongOutput` when a gradient is missing, of another
    shape, not finite or past its bound. Past :data:`GRADIENT_CHECK_SCORES` the record says the point is
    unchecked."""
    params, inputs = backend_arguments(backend, shape)
    scores = inputs.batch * params.config.num_heads * inputs.tq * inputs.tk
    if scores > GRADIENT_CHECK_SCORES:
        return {"rows": 0, "unchecked": f"forward + backward with batch x heads x Tq x Tk = {scores:,} scores: "
                f"bench checks gradients up to {GRADIENT_CHECK_SCORES:,} (the float64 reference backward's memory "
                "and time); check's gradient case verifies the layer's vjp"}
    rows = checked_rows(inputs.tq)
    cotangent = np.ones((inputs.batch, inputs.tq, params.config.d_model))
    checked = (f"gradients of output.sum() at {len(rows)} of its {inputs.tq} positions and weight rows, against the "
               "float64 reference")
    missing = [name for name in gradient_names(params, inputs, backend.capabilities.inputs) if name not in got]
    if missing:  # before the reference's cost
        raise WrongOutput(f"native_gradients returned no gradient for {', '.join(missing)} (returned "
                          f"{', '.join(sorted(got)) or 'none'}): the call's backward must reach every input and "
                          f"parameter, as a training step's does ({checked})")
    precision = declared_precision(backend, shape.dtype, GRADIENT_CASE)
    with bound_of(precision) if precision else contextlib.nullcontext():
        expected = gradient_tolerances(params, inputs, cotangent, shape.dtype, backend.capabilities.inputs,
                                       select=lambda name, array: gradient_part(array))
    worst = None
    for name, (want, tol) in expected.items():
        full = tuple(got[name]["shape"])
        reference_shape = _full_shape(name, params, inputs, backend.capabilities.inputs)
        if full != reference_shape:
            raise WrongOutput(f"gradient of {name} has shape {full}, expected {reference_shape} ({checked})")
        part = np.asarray(got[name]["part"], np.float64)
        err, wrong = _mismatch(part, want, tol.bound, lambda at, n=full: _gradient_entry(at, n))
        if wrong and not np.isfinite(err):
            raise WrongOutput(f"gradient of {name} {wrong} ({checked})")
        if wrong:
            raise WrongOutput(f"gradient of {name} {wrong}; max error {err:.3g} ({err / tol.bound:.3g} x the bound) "
                              f"exceeds {tol.describe()} ({checked})"
                              f"{_float32_level(err, tol, shape.dtype, GRADIENT_CASE)}"
                              f"{_gradient_mistake(got, expected, params, inputs, backend.capabilities.inputs)}; "
                              "`mha-harness check` runs the layer's vjp, never prepare()'s call: if its gradient case "
                              "passes, compare the call's backward with your compute_vjp on the same inputs; if it "
                              "fails too, its diagnosis names more")
        if worst is None or err / tol.bound > worst[0]:
            worst = (err / tol.bound, name, err, tol)
    _, name, err, tol = worst
    return {"rows": len(rows), "gradients": sorted(expected), "worst": name, "max_error": err, "bound": tol.bound,
            "bound_dtype": tol.dtype, **({"declared_precision": precision} if precision else {})}


def _mismatch(got: np.ndarray, expected: np.ndarray, bound: float, locate) -> tuple[float, str | None]:
    """The largest |got - expected| (inf when an entry of ``got`` is not finite) and, when that passes ``bound``,
    what is wrong at the entry ``locate(index)`` names; None when nothing is."""
    if not np.all(np.isfinite(got)):
        at = tuple(int(i) for i in np.argwhere(~np.isfinite(got))[0])
        return float("inf"), f"{got[at]} at {locate(at)}: expected finite values"
    diff = np.abs(got - expected)
    err = float(diff.max()) if diff.size else 0.0
    if err <= bound:
        return err, None
    at = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), diff.shape))
    want, have = _distinct(float(expected[at]), float(got[at]))
    return err, f"differs from the float64 reference: expected {want}, got {have} at {locate(at)}"


def _distinct(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` printed with 6 significant digits, or as many more as it takes to tell them apart (a float64
    error of 1e-7 prints as the same 6 digits)."""
    for digits in (6, 9, 12, 17):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


def _float32_level(err: float, tol, dtype: str, case: str) -> str:
    """A message suffix when a float64 call's error passes the float64 bound but not the float32 one (the float64
    bound is the float32 one scaled by the ratio of the unit roundoffs, both from the same estimates): it computes
    in float32 somewhere."""
    if dtype != "float64" or tol.dtype != "float64":
        return ""
    bound32 = tol.bound * EPS["float32"] / EPS["float64"]
    if err > bound32:
        return ""
    return (f"; the error is within the float32 bound ({bound32:.3g}): the float64 call computes in float32 somewhere "
            "(a cast of the inputs or weights, a float32 softmax or scale, a float32 table the layer builds itself "
            "such as rotary cos/sin); compute in float64, or declare it: "
            f"precision_divergences(\"float64\", \"float32\", \"why\", cases=[\"{case}\"]) from "
            "mha_harness.toolkit.divergences")


def _gradient_entry(at: tuple, full: tuple) -> str:
    """Where an entry of a :func:`~mha_harness.bench.calls.gradient_part` lies in the whole gradient of shape
    ``full``: an input's batch, position and feature, a weight's row and column, a bias's entry."""
    if len(at) == 3:
        return f"batch {at[0]}, position {checked_rows(full[1])[at[1]]}, feature {at[2]}"
    if len(at) == 2:
        return f"row {checked_rows(full[0])[at[0]]}, column {at[1]}"
    return f"entry {at[0]}"


def _full_shape(name: str, params, inputs, form: str) -> tuple:
    """The shape of the reference's gradient ``name`` (an input's in ``form``, or a parameter's)."""
    if name in params.arrays():
        return tuple(np.shape(params.arrays()[name]))
    if form == "kv_cache" and name == "key":
        return (inputs.batch, inputs.tk - inputs.tq, params.config.d_model)
    return tuple(np.shape(inputs.query if name == "query" else inputs.key))


def _gradient_mistake(got: dict, expected: dict, params, inputs, form: str) -> str:
    """A message suffix naming the known mistake the wrong gradients show: every gradient a whole multiple of the
    reference's (accumulated over calls, never zeroed), the parameters' all zero (they do not require grad), or, for
    a causal call, the gradients of another mask (:func:`_gradient_mask_mistake`; ``form``: the backend's declared
    input form, in which its gradients come)."""
    ratios = []
    for name, (want, _) in expected.items():
        part = np.asarray(got[name]["part"], np.float64)
        scale = float(np.vdot(want, want))
        if scale > 0:
            ratios.append(float(np.vdot(part, want)) / scale)
    if ratios and min(ratios) > 1.5 and max(ratios) - min(ratios) < 0.01 * max(ratios):
        return (f"; every gradient is {np.median(ratios):.3g} x the reference's: gradients accumulated over calls "
                "(a torch leaf's .grad is summed into unless set to None before each backward)")
    frozen = frozen_parameters_hint({name: got[name]["part"] for name in expected}, params)
    return frozen or _gradient_mask_mistake(got, expected, params, inputs, form)


def _gradient_mask_mistake(got: dict, expected: dict, params, inputs, form: str) -> str:
    """For a causal call: the causal-mask mistake (:func:`_causal_mask_mistakes`, as the output check's
    :func:`known_mistake` names them) whose float64 gradients of output.sum() every checked gradient matches within
    ``max(10 * bound, 1e-3)``. Each candidate costs one float64 backward, on a failure only."""
    cotangent = np.ones((inputs.batch, inputs.tq, params.config.d_model))
    for call, what in _causal_mask_mistakes(inputs, "backward"):
        grads = input_gradients(reference_vjp(params, call, cotangent), form)
        if all(name in grads and np.max(np.abs(np.asarray(got[name]["part"], np.float64)
                                               - gradient_part(grads[name])), initial=0.0)
               <= max(10 * tol.bound, 1e-3) for name, (_, tol) in expected.items()):
            return f"; the gradients match those of {what}"
    return ""


def check_point(backend, shape: Shape, values) -> dict:
    """Check what :meth:`~mha_harness.bench.calls.PreparedPoint.checked_values` took from one call: a forward's
    output rows (:func:`check_output`), a forward + backward call's gradients (:func:`check_gradients`), or None (a
    forward + backward call whose gradients the layer does not read): the record bench keeps with the point."""
    if values is None:
        return {"rows": 0, "unchecked": "forward + backward: the layer has no native_gradients to read its call's "
                "gradients, so its return value is not read"}
    if isinstance(values, dict):
        return check_gradients(backend, shape, values)
    return check_output(backend, shape, values)
