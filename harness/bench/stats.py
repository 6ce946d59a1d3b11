"""Statistics that say how sure they are: calibrated samples, the median's confidence interval, fits with errors.

* :func:`calls_per_sample`: like torch.utils.benchmark's blocked_autorange and pyperf, one *sample* repeats the
  call until it lasts at least ``min_sample_s`` (timer resolution and scheduler ticks become small next to it);
  a sample's value is its time divided by its number of calls.
* :func:`median_ci`: the distribution-free 95% confidence interval of the median from the binomial order
  statistics (scipy.stats.quantile_test); it exists from 6 samples on.
* :func:`converged`: the stopping rule, the CI within +-``rel`` of the median.
* :func:`fit_exponent`: slope of log(y) on log(x) with its standard error (scipy.stats.linregress), over the
  largest points above a resolution; a memory exponent outside [0, 2.2] is a measurement error, not a result
  (attention's memory grows at most like T^2), and so is a time exponent outside [0, 3] by more than two stderr
  or with a stderr above 0.5 (:func:`time_fit`).
"""
from __future__ import annotations

import math

import numpy as np

CONFIDENCE = 0.95
MIN_SAMPLES = 6  # the smallest n whose binomial order-statistic interval reaches 95% coverage ([min, max])
MEMORY_EXPONENT_RANGE = (0.0, 2.2)
#: a time exponent whose whole 2-stderr interval lies outside this range is noise: attention's time does not fall
#: as T grows, and grows at most as T^2 (3 leaves room for cache effects)
TIME_EXPONENT_RANGE = (0.0, 3.0)
#: a time exponent with a larger stderr says nothing about growth (three points scattered by a loaded machine)
TIME_EXPONENT_MAX_STDERR = 0.5


def calls_per_sample(call_s: float, min_sample_s: float) -> int:
    """How many calls one sample needs to last ``min_sample_s``, given one call's time."""
    if call_s <= 0:
        return 1000
    return max(1, math.ceil(min_sample_s / call_s))


def median_ci(samples, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """(low, high) of the median's confidence interval, or None with too few samples for that confidence."""
    if len(samples) < 2:
        return None
    from scipy.stats import quantile_test
    x = np.asarray(samples, dtype=float)
    ci = quantile_test(x, q=float(np.median(x)), p=0.5).confidence_interval(confidence)
    if not (np.isfinite(ci.low) and np.isfinite(ci.high)):
        return None
    return float(ci.low), float(ci.high)


def relative_halfwidth(samples) -> float | None:
    """The CI's larger distance from the median, as a fraction of the median."""
    ci = median_ci(samples)
    if ci is None:
        return None
    median = float(np.median(samples))
    return max(median - ci[0], ci[1] - median) / median if median > 0 else None


def converged(samples, rel: float) -> bool:
    width = relative_halfwidth(samples)
    return width is not None and width <= rel


def summary(samples, calls: int, budget_exhausted: bool, target_rel: float) -> dict:
    """The JSON of one timed point: every sample, median, 95% CI, calls per sample, stopping flag."""
    ci = median_ci(samples)
    median = float(np.median(samples)) if samples else None
    return {"samples_s": [float(s) for s in samples], "n_samples": len(samples), "calls_per_sample": calls,
            "median_s": median, "ci95_s": list(ci) if ci else None,
            "ci95_rel_halfwidth": round(relative_halfwidth(samples), 5) if ci else None,
            "ci_target_rel": target_rel, "budget_exhausted": budget_exhausted,
            "min_s": float(min(samples)) if samples else None, "max_s": float(max(samples)) if samples else None}


def fit_exponent(xs, ys, *, largest: int = 3, floor: float = 0.0, rel_ci95=None) -> dict | None:
    """Growth exponent: slope of log(y) on log(x) over the ``largest`` points with y > ``floor``, with its stderr.

    Small T is dominated by fixed costs (dispatch, projections), so only the largest points are fitted; points at
    or below ``floor`` (the measuring method's resolution) carry no information and are left out. ``rel_ci95``:
    each y's 95 % CI half-width relative to y; the stderr then also carries that uncertainty of the points (three
    points on a line have a regression stderr of 0 however wide their CIs), added in quadrature.
    """
    rel = [None] * len(xs) if rel_ci95 is None else list(rel_ci95)
    pts = sorted((x, y, r) for x, y, r in zip(xs, ys, rel) if y is not None and y > floor and y > 0)[-largest:]
    if len(pts) < 3:
        return None
    from scipy.stats import linregress
    logx = np.log([p[0] for p in pts])
    logy = np.log([p[1] for p in pts])
    fit = linregress(logx, logy)
    # points that all have the same y lie on the flat line exactly: scipy's stderr is then 0/0 (NaN, invalid JSON)
    stderr = 0.0 if np.ptp(logy) == 0 else float(fit.stderr)
    sigma = np.array([(p[2] or 0.0) / 1.96 for p in pts])  # a relative half-width is the log's: sigma ~ r / 1.96
    if sigma.any():
        d = logx - logx.mean()
        stderr = float(np.hypot(stderr, np.sqrt(np.sum(d ** 2 * sigma ** 2)) / np.sum(d ** 2)))
    return {"exponent": round(float(fit.slope), 3), "stderr": round(stderr, 3), "points": [p[0] for p in pts]}


def time_fit(xs, ys, rel_ci95=None) -> dict | None:
    """:func:`fit_exponent` for time, with a slope that time cannot have (below 0 or above 3 by more than two
    stderr) or cannot pin down (stderr above 0.5) reported as a measurement error, never printed as a result."""
    fit = fit_exponent(xs, ys, rel_ci95=rel_ci95)
    if fit is None:
        return None
    low, high = TIME_EXPONENT_RANGE
    slope, err = fit["exponent"], fit["stderr"]
    if slope + 2 * err < low or slope - 2 * err > high:
        why = f"fitted slope {slope} +- {err} is outside [{low}, {high}] by more than two stderr"
    elif err > TIME_EXPONENT_MAX_STDERR:
        why = f"fitted slope {slope} +- {err} is undetermined (stderr above {TIME_EXPONENT_MAX_STDERR})"
    else:
        return fit
    return {"measurement_error": f"{why}: the medians are noise (a loaded machine, a budget too small), not the "
                                 "backend's growth", "points": fit["points"]}


def memory_fit(xs, ys, floor: float) -> dict | None:
    """:func:`fit_exponent` for memory, with a physically impossible slope reported as a measurement error."""
    fit = fit_exponent(xs, ys, floor=floor)
    if fit is None:
        return None
    low, high = MEMORY_EXPONENT_RANGE
    if not low <= fit["exponent"] <= high:
        return {"measurement_error": f"fitted slope {fit['exponent']} is outside [{low}, {high}], impossible for "
                                     "attention's memory: the measurement is wrong, not the backend",
                "points": fit["points"]}
    return fit
