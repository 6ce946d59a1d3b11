"""Which soft cap, if any, a failed output was computed with: scores replaced by ``c * tanh(s / c)`` before the
mask (Gemma 2's ``attn_logit_softcapping``) bend every score a little, an error that looks like rounding by its
size alone; fitting ``c`` against the reference tells the two apart. The same fit finds the score scale a failed
output was computed with when it is none of the common ones (a Gemma layer's ``query_pre_attn_scalar`` set to
another value than declared). Used by the conformance diagnoses and by ``mha-harness bench``'s check of a
benchmarked call."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.mistakes import distance, wrong_scales
from mha_harness.contract.reference import (
    logit_softcap,
    logit_softcap_as,
    reference_attention,
    score_scale,
    score_scale_as,
    score_scale_declared,
    score_scale_named,
)

#: the caps tried first (log-spaced, each about 1.26x the last), the best then refined between its neighbours
SOFTCAP_GRID = tuple(float(c) for c in np.geomspace(1.0, 1000.0, 31))
#: the score scales tried first (log-spaced over 1/1000 .. 10, each about 1.26x the last)
SCALE_GRID = tuple(float(c) for c in np.geomspace(1e-3, 10.0, 41))
#: rows of a whole output the fit compares (evenly spaced); the cap found is then confirmed on every row
FIT_ROWS = 16


@dataclass(frozen=True)
class SoftcapFit:
    """The cap under which the reference reproduces a failed output (None: no cap) and the error there."""

    cap: float | None
    error: float


@dataclass(frozen=True)
class ScaleFit:
    """The score scale under which the reference reproduces a failed output and the error there."""

    scale: float
    error: float


def mismatch(fit: SoftcapFit) -> str:
    """The message suffix of a wrong output the reference reproduces under ``fit``'s cap and not under the one it
    holds now (:func:`logit_softcap`): no cap where one is declared, another cap, or an undeclared cap."""
    held = logit_softcap()
    if fit.cap is None:
        return (f"; the output matches scores that are not soft-capped: the layer does not apply its declared "
                f"logit_softcap {held:g} ({held:g} * tanh(s / {held:g}) on the scaled scores, before the mask)")
    if held is not None:
        return f"; the output matches scores soft-capped at {fit.cap:g}, not at the declared logit_softcap {held:g}"
    return (f"; the output matches scores soft-capped at {fit.cap:g} (c * tanh(s / c) on the scaled scores before "
            "the mask, as Gemma 2's attn_logit_softcapping or flash-attn's softcap do), not a rounding error: if "
            "the layer caps its scores by design, declare its configured cap, "
            f"Capabilities(logit_softcap={fit.cap:g}), and every case compares it with the reference capped so; if "
            "not, look for a tanh on the scores")


def scores_mismatch(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                    rows=None, compare: np.ndarray | None = None) -> str:
    """The message suffix naming the soft cap (:func:`fitted_softcap`) or the score scale (:func:`fitted_score_scale`)
    under which the reference reproduces ``got``, whichever fits closer; "" when neither does."""
    found = scores_mismatch_fit(got, params, inputs, bound, rows=rows, compare=compare)
    return "" if found is None else found[0]


def scores_mismatch_fit(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                        rows=None, compare: np.ndarray | None = None) -> tuple[str, float] | None:
    """:func:`scores_mismatch`'s suffix and the fit's error (:func:`~mha_harness.contract.mistakes.distance` on the
    compared rows), for choosing between it and another diagnosis; None when neither fits."""
    cap = fitted_softcap(got, params, inputs, bound, rows=rows, compare=compare)
    scale = fitted_score_scale(got, params, inputs, bound, rows=rows, compare=compare)
    if scale is not None and (cap is None or scale.error < cap.error):
        return scale_mismatch(scale, params), scale.error
    return None if cap is None else (mismatch(cap), cap.error)


def fitted_softcap(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                   rows=None, compare: np.ndarray | None = None) -> SoftcapFit | None:
    """The soft cap under which the float64 reference gives ``got`` (the output, or its ``rows`` when given) within
    ``2 * bound``, other than the one the reference holds now (:func:`logit_softcap`): no cap at all, when one is
    held and that fits, else the cap with the fewest significant digits that fits (50, not 49.93); None when none
    fits. ``compare``: a (batch, Tq) bool array of the whole output's rows that are specified (a padded query's
    output is not): only those are compared."""
    got = np.asarray(got, np.float64)
    held, margin = logit_softcap(), 2 * bound
    compare_at = _specified_rows if compare is not None else _sampled_rows
    error, confirmed = compare_at(got, params, inputs, margin, rows if compare is None else compare, logit_softcap_as)
    fit = _fitted(error, confirmed, SOFTCAP_GRID, held, margin, none_fits=held is not None)
    return None if fit is None else SoftcapFit(*fit)


def fitted_score_scale(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                       rows=None, compare: np.ndarray | None = None) -> ScaleFit | None:
    """The score scale (one number, at this layer's d_head) under which the float64 reference gives ``got`` (the
    output, or its ``rows``) within ``2 * bound``, other than the one the reference holds now
    (:func:`~mha_harness.contract.reference.score_scale`): the one with the fewest significant digits that fits
    (0.1, not 0.09998); None when none fits. ``compare``: as for :func:`fitted_softcap`."""
    got = np.asarray(got, np.float64)
    held, margin = score_scale(params.config.d_head), 2 * bound
    compare_at = _specified_rows if compare is not None else _sampled_rows
    error, confirmed = compare_at(got, params, inputs, margin, rows if compare is None else compare, score_scale_as)
    # the held scale fits (a near pass), or so do weights all but uniform (scale -> 0) or all but one-hot (scale ->
    # 10 x the grid's top): no scale tells this output apart
    if error(held) <= margin or error(1e-9) <= margin or error(SCALE_GRID[-1] * 10) <= margin:
        return None
    fit = _fitted(error, confirmed, SCALE_GRID, held, margin, none_fits=False)
    return None if fit is None else ScaleFit(*fit)


def scale_mismatch(fit: ScaleFit, params: AttentionParams) -> str:
    """The message suffix of a wrong output the reference reproduces with its scores scaled by ``fit``'s scale (none
    of the common scales) instead of the scale it holds now: the declared one, or 1/sqrt(d_head)."""
    d, scale = params.config.d_head, fit.scale
    held, declared = score_scale(d), score_scale_declared()
    if declared is not None:
        at = f" (= {held:.4g} at d_head {d})" if isinstance(declared, str) else ""
        return (f"; the output matches scores scaled by {scale:g}, not by the declared score_scale "
                f"{score_scale_named()}{at}")
    common = next((label for factor, label in wrong_scales(params.config).items()
                   if np.isclose(scale / held, factor, rtol=1e-2)), None)
    if common is not None:  # a common scale fitted where the wrong-scale diagnosis could not compare (padded rows):
        return scale_sentence(common, scale / held, params)  # its sentence (an outside user got two for one bug)
    what = f"{scale * np.sqrt(d):.4g}/sqrt(d_head) at d_head {d}"
    return (f"; the output matches scores scaled by {scale:g} ({what}) "
            f"instead of 1/sqrt(d_head) = {held:.4g}, not a rounding error: a layer built with a scale of its own "
            "declares it, Capabilities(score_scale=...) (\"A layer with a score scale of its own\" in docs/plugins.md)")


#: a scale other than 1/sqrt(d_head) is a bug, unless the layer is built with it (T5's unscaled scores, muP's
#: 1/d_head): how to declare that one
SCALE_BY_DESIGN = (" (a layer built with this scale by design, as T5 leaves its scores unscaled and muP scales them "
                   "by 1/d_head, declares it: Capabilities(score_scale={value}), and every case compares it with the "
                   "reference scaled so: \"A layer with a score scale of its own\" in docs/plugins.md)")


def scale_sentence(label: str, factor: float, params: AttentionParams) -> str:
    """The diagnosis of another common score scale ``label`` (``factor`` times the scale the reference holds), the
    same sentence whether the wrong-scale diagnosis matched it on a whole output or a fit found it on some rows."""
    if score_scale_declared() is not None:  # the value too: a fixed declared scale is matched by another rule at
        d = params.config.d_head            # each head width
        return (f"; the output matches scores scaled by {label} (= {factor * score_scale(d):.4g} at d_head {d}), not "
                f"by the declared score_scale {score_scale_named()}")
    hint = f"; the output matches scores scaled by {label} instead of 1/sqrt(d_head)"
    if "1 (no scaling)" in label:
        hint += SCALE_BY_DESIGN.format(value="1.0")
    elif "1/d_head" in label:
        hint += TWICE + SCALE_BY_DESIGN.format(value="'1/d_head'")
    return hint


#: 1/d_head is 1/sqrt(d_head) applied twice: the likelier cause in a wrapper around a layer that scales its scores
TWICE = (" (= 1/sqrt(d_head) applied twice: a wrapper that scales q, or folds the scale into W_q, around a layer "
         "that scales its scores again)")


def _specified_rows(got, params, inputs, margin, compare, setting):
    """(error(value), confirmed(value)) comparing the whole output on its specified rows (``compare``, (batch, Tq)),
    the others zeroed on both sides, the reference computed within ``setting(value)`` (a cap or a scale)."""
    keep = np.asarray(compare, bool)[..., None]
    part = np.where(keep, got, 0.0)

    @functools.cache
    def error(value) -> float:
        with setting(value):
            return distance(part, np.where(keep, reference_attention(params, inputs).output, 0.0))

    def confirmed(value) -> tuple | None:
        return (value, error(value)) if error(value) <= margin else None
    return error, confirmed


def _sampled_rows(got, params, inputs, margin, rows, setting):
    """(error(value), confirmed(value)): ``got`` holds the query ``rows`` (all of them for None), compared at up to
    :data:`FIT_ROWS` of them while fitting and at every one to confirm, the reference within ``setting(value)``."""
    if rows is None:
        sample = np.unique(np.linspace(0, inputs.tq - 1, min(inputs.tq, FIT_ROWS)).round().astype(int))
        part = got[:, sample]
    else:
        sample, part = np.asarray(rows), got

    def distance_at(value, at, against) -> float:
        with setting(value):
            return distance(against, reference_attention(params, inputs, rows=at).output)

    @functools.cache
    def error(value) -> float:
        return distance_at(value, sample, part)

    def confirmed(value) -> tuple | None:
        whole = distance_at(value, None, got) if rows is None else error(value)
        return (value, whole) if whole <= margin else None
    return error, confirmed


def _fitted(error, confirmed, grid, held, margin: float, none_fits: bool) -> tuple | None:
    """The fit itself: the ``grid``, the golden-section refinement, the simplest value that fits, None (no cap) when
    ``none_fits`` and that fits best; ``error(value)`` (memoised) on the compared part, ``confirmed(value)`` on the
    whole: (value, error) or None."""
    errors = [error(c) for c in grid]
    best = int(np.argmin(errors))
    low, high = np.log(grid[max(best - 1, 0)]), np.log(grid[min(best + 1, len(grid) - 1)])
    ratio = (np.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    error_a, error_b = error(float(np.exp(a))), error(float(np.exp(b)))
    for _ in range(24):  # golden-section search in log(c), one new point a step: the bracket shrinks to ~1e-5 of c
        if error_a <= error_b:
            high, b, error_b = b, a, error_a
            a = high - ratio * (high - low)
            error_a = error(float(np.exp(a)))
        else:
            low, a, error_a = a, b, error_b
            b = low + ratio * (high - low)
            error_b = error(float(np.exp(b)))
    value = float(np.exp((low + high) / 2))
    # the simplest value that fits: 50 rather than 49.9931 (a float64 layer capped at 50 fits 50 alone)
    simple = next((c for c in (float(f"{value:.{d}g}") for d in range(1, 7)) if error(c) <= margin), value)
    if none_fits and error(None) <= min(margin, error(simple)):  # no cap fits better than any cap
        return confirmed(None)
    if simple == held or error(simple) > margin:  # within twice the bound of the held value: not another one
        return None
    return confirmed(simple)
