"""Known wrong algorithms, computed in NumPy, so a failing case can name the mistake its output matches."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.reference import allowed_and_bias, reference_attention


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    b, t, w = x.shape
    return x.reshape(b, t, n, w // n).transpose(0, 2, 1, 3)


def _project(x, w, b):
    return x @ w + (0 if b is None else b)


def mask_after_softmax_output(params: AttentionParams, inputs: AttentionInputs) -> np.ndarray:
    """Output when the masks are applied AFTER the softmax without renormalising: masked keys get weight 0
    but still enter every row's normaliser (denominator), so the kept weights sum to less than 1."""
    c = params.config
    q = _heads(_project(inputs.query, params.W_q, params.b_q), c.num_heads)
    k = np.repeat(_heads(_project(inputs.key, params.W_k, params.b_k), c.kv_heads), c.group, axis=1)
    v = np.repeat(_heads(_project(inputs.value, params.W_v, params.b_v), c.kv_heads), c.group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(c.d_head)
    allowed, additive = allowed_and_bias(params, inputs)
    if additive is not None:
        scores = scores + additive
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = np.where(allowed, e / e.sum(axis=-1, keepdims=True), 0.0)
    heads = weights @ np.where(np.isfinite(v), v, 0.0)
    b, h, t, dh = heads.shape
    return _project(heads.transpose(0, 2, 1, 3).reshape(b, t, h * dh), params.W_o, params.b_o)


def normaliser_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None) -> str:
    """A message suffix when ``got`` matches the mask-after-softmax mistake (on ``rows`` of (batch, Tq) if given)."""
    wrong = mask_after_softmax_output(params, inputs)
    if rows is not None:
        got, wrong = got[rows], wrong[rows]
    if np.all(np.isfinite(got)) and np.allclose(got, wrong, atol=1e-4, rtol=1e-4):
        return ("; the output matches the mask applied after the softmax without renormalising (masked keys still "
                "enter the softmax denominator)")
    return ""


def _with_score_scale(params: AttentionParams, factor: float) -> AttentionParams:
    """Parameters whose reference output equals the true layer with scores multiplied by ``factor``."""
    b_q = None if params.b_q is None else params.b_q * factor
    return params.replace(W_q=params.W_q * factor, b_q=b_q)


def wrong_scale(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float) -> str | None:
    """The common wrong score scale (1/sqrt(d_model), none, 1/d_head) whose float64 output ``got`` matches within
    ``max(10 * bound, 1e-3)``, or None when it matches none of them."""
    c = params.config
    candidates = {"1/sqrt(d_model)": np.sqrt(c.d_head / c.d_model), "no scaling (1)": np.sqrt(c.d_head),
                  "1/d_head": 1 / np.sqrt(c.d_head)}
    if not np.all(np.isfinite(got)):
        return None
    errors = {label: float(np.max(np.abs(got - reference_attention(_with_score_scale(params, f), inputs).output)))
              for label, f in candidates.items() if f != 1.0}
    label, err = min(errors.items(), key=lambda item: item[1])
    return label if err <= max(bound * 10, 1e-3) else None
