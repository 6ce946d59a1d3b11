"""Known wrong algorithms, computed in NumPy, so a failed comparison can name the mistake its output matches: a
reversed, misaligned, missing or one-off causal mask, a mask read with the opposite polarity, one of two masks
dropped, masks applied after the softmax, heads split by tokens instead of features."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams, implicitly_causal
from mha_harness.contract.conventions import causal_offset, other_alignment
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


def causal_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs) -> str:
    """A message suffix naming the causal-mask mistake a causal call's output ``got`` matches: the other alignment
    (Tq != Tk), a mask without the diagonal, no mask at all, a reversed mask (the future instead of the past), or a
    mask one key too wide; "" when none."""
    alignment, tq, tk = inputs.causal, inputs.tq, inputs.tk
    if alignment is None:
        return ""

    def matches(other: AttentionInputs) -> bool:
        return bool(np.allclose(got, reference_attention(params, other).output, atol=1e-3, equal_nan=True))
    offset = causal_offset(alignment, tq, tk)
    with implicitly_causal(None):  # the unmasked call, also for a backend that declares always_causal
        unmasked = inputs.replace(causal=None)
        next_key = unmasked.replace(attn_mask=np.tri(tq, tk, k=offset + 1, dtype=bool))
        reversed_mask = unmasked.replace(attn_mask=~np.tri(tq, tk, k=offset - 1, dtype=bool))
    if unmasked.attn_mask is None and matches(unmasked):
        return "; the output matches attention without a causal mask: the mask is not applied"
    if unmasked.attn_mask is None and matches(reversed_mask):
        return ("; the output matches a reversed causal mask: query i sees key i and every later key (the future) "
                "instead of the keys up to i (torch.triu where torch.tril belongs)")
    if unmasked.attn_mask is None and matches(next_key):
        return "; the output matches a causal mask one key too wide (query i also sees key i + 1)"
    no_diagonal = ~np.eye(tq, tk, k=offset, dtype=bool)
    if tq == tk and inputs.attn_mask is None and matches(inputs.replace(attn_mask=no_diagonal)):
        return "; the output matches a causal mask that excludes the diagonal (query i cannot see key i)"
    other = other_alignment(alignment)
    if tq != tk and matches(inputs.replace(causal=other)):
        return f"; the output matches {other} alignment instead"
    return ""


def dropped_mask_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None) -> str:
    """A message suffix naming the one mask that a call with several masks behaves as if it had dropped: ``got``
    matches the reference of the same call without that mask (on ``rows`` of (batch, Tq) if given); "" when none."""
    candidates = []
    with implicitly_causal(None):  # the call without its causal mask, also for a backend that declares always_causal
        if inputs.causal is not None:
            candidates.append((f"the causal mask ({inputs.causal})", inputs.replace(causal=None)))
        if inputs.key_padding_mask is not None:
            candidates.append(("key_padding_mask", inputs.replace(key_padding_mask=None)))
        if inputs.attn_mask is not None:
            kind = "bool" if inputs.attn_mask.dtype == np.bool_ else "additive"
            candidates.append((f"the {kind} attn_mask", inputs.replace(attn_mask=None)))
    def compared(output: np.ndarray) -> np.ndarray:
        return output if rows is None else output[rows]
    if len(candidates) < 2 or not np.all(np.isfinite(compared(got))):
        return ""
    for label, other in candidates:
        if np.allclose(compared(got), compared(reference_attention(params, other).output), atol=1e-3):
            return f"; the output matches the same call without {label}: that mask is dropped when combined"
    return ""




def token_split_output(params: AttentionParams, inputs: AttentionInputs) -> np.ndarray:
    """The layer with the lesson's wrong head split: each projection (B, T, h * d_head) reshaped to (B, h, T,
    d_head), so a head holds a block of tokens' features instead of its own features of every token, and merged
    back the same way; with the call's biases and masks (a module masks its score matrix by index)."""
    c = params.config

    def split(x, w, bias, n):
        y = np.asarray(x, np.float64) @ w + (0.0 if bias is None else bias)
        return y.reshape(y.shape[0], n, y.shape[1], y.shape[2] // n)
    q = split(inputs.query, params.W_q, params.b_q, c.num_heads)
    k, v = (np.repeat(split(x, w, bias, c.kv_heads), c.group, axis=1)
            for x, w, bias in ((inputs.key, params.W_k, params.b_k), (inputs.value, params.W_v, params.b_v)))
    allowed, additive = allowed_and_bias(params, inputs)
    scores = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / np.sqrt(c.d_head) + (0.0 if additive is None else
                                                                                  additive), -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    weights /= np.maximum(weights.sum(axis=-1, keepdims=True), np.finfo(np.float64).tiny)  # an empty row: zeros
    heads = weights @ v
    out = heads.reshape(inputs.batch, inputs.tq, c.d_model) @ params.W_o
    return out if params.b_o is None else out + params.b_o


def token_split_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float) -> str:
    """The diagnosis of an output that matches :func:`token_split_output` (within ``max(10 * bound, 1e-4)``), or ""."""
    if params.config.num_heads == 1 or not np.all(np.isfinite(got)):  # one head: the split is the identity
        return ""
    if np.max(np.abs(got - token_split_output(params, inputs))) <= max(10 * bound, 1e-4):
        return "; the output matches the 'split tokens instead of features' mistake (reshape(h, T, d_head))"
    return ""


def polarity_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None) -> str:
    """A message suffix when ``got`` matches the call with its key_padding_mask or bool attn_mask inverted (read as
    the opposite convention); on ``rows`` of (batch, Tq) if given; "" when neither."""
    candidates = []
    if inputs.key_padding_mask is not None:
        candidates.append(("key_padding_mask read with the opposite polarity (the harness's True = padding, ignore)",
                           inputs.replace(key_padding_mask=~inputs.key_padding_mask)))
    if inputs.attn_mask is not None and inputs.attn_mask.dtype == np.bool_:
        candidates.append(("INVERTED mask (True read as 'masked out'): mask polarity is reversed",
                           inputs.replace(attn_mask=~inputs.attn_mask)))
    pick = (lambda a: a) if rows is None else (lambda a: a[rows])  # noqa: E731
    if not np.all(np.isfinite(pick(got))):
        return ""
    for label, inverted in candidates:
        if np.allclose(pick(got), pick(reference_attention(params, inverted).output), atol=1e-3):
            return f"; the output matches the {label}"
    return ""


def mask_mistake(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None) -> str:
    """The mask mistake a failing output ``got`` of a masked call matches (on ``rows`` if given; the causal
    diagnoses on whole outputs only): the causal mask's (:func:`causal_hint`), an inverted polarity, one of two
    masks dropped, the masks applied after the softmax; "" when none or when the call has no mask."""
    if inputs.causal is None and inputs.key_padding_mask is None and inputs.attn_mask is None:
        return ""
    return ((causal_hint(got, params, inputs) if rows is None else "") or polarity_hint(got, params, inputs, rows)
            or dropped_mask_hint(got, params, inputs, rows) or normaliser_hint(got, params, inputs, rows))
