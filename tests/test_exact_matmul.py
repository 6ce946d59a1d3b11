"""The float64 reference's projections are the exact affine map rounded once (mha_harness.contract.exact_matmul)."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mha_harness.contract.exact_matmul import exact_affine


def _exact(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x @ w + bias summed in rationals, then rounded once to float64."""
    return np.array([[float(sum((Fraction(float(a)) * Fraction(float(c)) for a, c in zip(row, col)),
                                Fraction(float(bias[j]))))
                      for j, col in enumerate(w.T)] for row in x])


def _cancelling(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of terms about 30 whose first output sums to about 2^-10 of them: a projection that cancels."""
    rng = np.random.default_rng(seed)
    x = 30 * rng.standard_normal((12, n))
    w = rng.standard_normal((n, 3))
    bias = rng.standard_normal(3)
    terms = np.abs(x[:, :-1]) @ np.abs(w[:-1, 0])
    x[:, -1] = (-(x[:, :-1] @ w[:-1, 0] + bias[0]) + rng.standard_normal(12) * terms * 2.0 ** -10) / w[-1, 0]
    return x, w, bias


@pytest.mark.parametrize("n", [2, 4, 33, 512])
def test_each_entry_is_within_one_unit_in_the_last_place_of_the_exact_value_where_the_terms_cancel(n):
    """Every entry is within one unit in the last place of the rationals' sum (most equal it rounded once), where
    float64's own matmul is many units off (so the test fails on the plain matmul)."""
    x, w, bias = _cancelling(n, seed=n)
    exact = _exact(x, w, bias)
    got = exact_affine(x, w, bias)
    assert (np.abs(got - exact) <= np.spacing(np.abs(exact))).all()
    assert (got == exact).mean() > 0.9
    ulps = np.abs(x @ w + bias - exact)[:, 0] / np.spacing(np.abs(exact[:, 0]))
    assert ulps.max() > 8, ulps


def test_batched_inputs_keep_their_shape_and_equal_the_flat_map():
    """(batch, T, n) inputs map row by row, as the reference's (batch, T, d_model) inputs do."""
    x, w, bias = _cancelling(16, seed=3)
    batched = x.reshape(3, 4, 16)
    assert np.array_equal(exact_affine(batched, w, bias), exact_affine(x, w, bias).reshape(3, 4, 3))
    assert exact_affine(batched, w).shape == (3, 4, 3)


def test_rows_with_nan_or_infinity_propagate_it_and_leave_the_other_rows_exact():
    """A poisoned row (NaN, an infinity) gets the ordinary matmul, whose NaN or infinity it propagates; the other
    rows are still within one unit in the last place."""
    x, w, bias = _cancelling(8, seed=5)
    x[2, 0], x[4, 1] = np.nan, np.inf
    got = exact_affine(x, w, bias)
    assert np.isnan(got[2]).all() and not np.isfinite(got[4]).any()
    clean = np.delete(np.arange(12), [2, 4])
    assert (np.abs(got[clean] - _exact(x[clean], w, bias)) <= np.spacing(np.abs(got[clean]))).all()
    w[0, 0] = np.nan
    assert np.isnan(exact_affine(x, w)[:, 0]).all()


def test_zero_and_tiny_rows_and_empty_inputs():
    """A row of zeros maps to the bias, rows near float64's smallest normals stay within one unit in the last
    place, and empty inputs keep their shape."""
    x, w, bias = _cancelling(8, seed=7)
    x[0] = 0.0
    x[1] *= 2.0 ** -1000
    got = exact_affine(x, w, bias)
    assert np.array_equal(got[0], bias)
    assert (np.abs(got - _exact(x, w, bias)) <= np.spacing(np.abs(got))).all()
    assert exact_affine(np.zeros((0, 8)), w, bias).shape == (0, 3)


def test_a_fit_over_many_score_scales_projects_the_call_once(monkeypatch):
    """The exact projections are memoised by content and the output projection is float64's own: a score-scale fit
    (about 40 references of one call, each with other scores) computes each exact projection once, where it had
    computed one per reference (an outside user's wrong-output bench point took 117 s, 30 s of it here)."""
    from mha_harness.contract import reference
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_inputs, make_params
    from mha_harness.contract.scores_fit import fitted_score_scale

    calls = []
    real = reference.exact_affine
    monkeypatch.setattr(reference, "exact_affine", lambda *a: calls.append(1) or real(*a))
    reference.clear_reference_cache()
    config = AttentionConfig(64, 4)
    params, inputs = make_params(config, seed=1), make_inputs(config, 2, 12, seed=2)
    with reference.score_scale_as(0.05):
        got = reference.reference_attention(params, inputs).output
    fit = fitted_score_scale(got, params, inputs, 1e-6)
    assert fit is not None and abs(fit.scale - 0.05) < 1e-3, fit
    computed = reference.reference_cache_info()["misses"]
    assert computed > 20 and len(calls) <= 6, (computed, len(calls))  # q (all rows, the fit's rows), k, v
