"""Which soft cap, if any, a failed output was computed with: scores replaced by ``c * tanh(s / c)`` before the
mask (Gemma 2's ``attn_logit_softcapping``) bend every score a little, an error that looks like rounding by its
size alone; fitting ``c`` against the reference tells the two apart. Used by the conformance diagnoses and by
``mha-harness bench``'s check of a benchmarked call."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.mistakes import distance
from mha_harness.contract.reference import logit_softcap, logit_softcap_as, reference_attention

#: the caps tried first (log-spaced, each about 1.26x the last), the best then refined between its neighbours
SOFTCAP_GRID = tuple(float(c) for c in np.geomspace(1.0, 1000.0, 31))
#: rows of a whole output the fit compares (evenly spaced); the cap found is then confirmed on every row
FIT_ROWS = 16


@dataclass(frozen=True)
class SoftcapFit:
    """The cap under which the reference reproduces a failed output (None: no cap) and the error there."""

    cap: float | None
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
    error, confirmed = compare_at(got, params, inputs, margin, rows if compare is None else compare)
    return _fitted(error, confirmed, held, margin)


def _specified_rows(got, params, inputs, margin, compare):
    """(error(cap), confirmed(cap)) comparing the whole output on its specified rows (``compare``, (batch, Tq)),
    the others zeroed on both sides."""
    keep = np.asarray(compare, bool)[..., None]
    part = np.where(keep, got, 0.0)

    @functools.cache
    def error(cap) -> float:
        with logit_softcap_as(cap):
            return distance(part, np.where(keep, reference_attention(params, inputs).output, 0.0))

    def confirmed(cap) -> SoftcapFit | None:
        return SoftcapFit(cap, error(cap)) if error(cap) <= margin else None
    return error, confirmed


def _sampled_rows(got, params, inputs, margin, rows):
    """(error(cap), confirmed(cap)): ``got`` holds the query ``rows`` (all of them for None), compared at up to
    :data:`FIT_ROWS` of them while fitting and at every one to confirm."""
    if rows is None:
        sample = np.unique(np.linspace(0, inputs.tq - 1, min(inputs.tq, FIT_ROWS)).round().astype(int))
        part = got[:, sample]
    else:
        sample, part = np.asarray(rows), got

    def distance_at(cap, at, against) -> float:
        with logit_softcap_as(cap):
            return distance(against, reference_attention(params, inputs, rows=at).output)

    @functools.cache
    def error(cap) -> float:
        return distance_at(cap, sample, part)

    def confirmed(cap) -> SoftcapFit | None:
        whole = distance_at(cap, None, got) if rows is None else error(cap)
        return SoftcapFit(cap, whole) if whole <= margin else None
    return error, confirmed


def _fitted(error, confirmed, held: float | None, margin: float) -> SoftcapFit | None:
    """The fit itself: the grid, the golden-section refinement, the simplest cap that fits, no cap when one is
    held and that fits best; ``error(cap)`` (memoised) on the compared part, ``confirmed(cap)`` on the whole."""
    errors = [error(c) for c in SOFTCAP_GRID]
    best = int(np.argmin(errors))
    low, high = np.log(SOFTCAP_GRID[max(best - 1, 0)]), np.log(SOFTCAP_GRID[min(best + 1, len(SOFTCAP_GRID) - 1)])
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
    cap = float(np.exp((low + high) / 2))
    # the simplest cap that fits: 50 rather than 49.9931 (a float64 layer capped at 50 fits 50 alone)
    simple = next((c for c in (float(f"{cap:.{d}g}") for d in range(1, 7)) if error(c) <= margin), cap)
    if held is not None and error(None) <= min(margin, error(simple)):  # no cap fits better than any cap
        return confirmed(None)
    if simple == held or error(simple) > margin:  # within twice the bound of the held cap: not another cap
        return None
    return confirmed(simple)
