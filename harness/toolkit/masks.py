"""Mask construction on the host, in NumPy, for every backend: per block of queries and keys (numpy-tiled)
or over the whole (Tq, Tk) range (everyone else, through :func:`full_mask`). Framework backends convert the
result to their own tensors and polarity."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionInputs
from mha_harness.contract.conventions import causal_offset


def block_mask(inputs: AttentionInputs, q0: int, q1: int, k0: int, k1: int, invert_attn_mask: bool = False):
    """Allowed (bool) and additive (float or None) masks for queries q0:q1 and keys k0:k1.

    Shapes broadcast to (batch, heads, q1 - q0, k1 - k0); ``allowed`` is None when nothing is masked.
    """
    tq, tk = inputs.tq, inputs.tk
    if inputs.causal is None and inputs.key_padding_mask is None and inputs.attn_mask is None:
        return None, None
    allowed = np.ones((1, 1, q1 - q0, k1 - k0), dtype=bool)
    if inputs.causal:
        offset = causal_offset(inputs.causal, tq, tk)
        allowed = allowed & (np.arange(k0, k1)[None, :] <= np.arange(q0, q1)[:, None] + offset)
    if inputs.key_padding_mask is not None:
        allowed = allowed & ~inputs.key_padding_mask[:, None, None, k0:k1]
    additive = None
    if inputs.attn_mask is not None:
        m = inputs.attn_mask
        m = (m.reshape((1, 1) + m.shape) if m.ndim == 2 else m)[:, :, q0:q1, k0:k1]
        if m.dtype == np.bool_:
            allowed = allowed & (~m if invert_attn_mask else m)
        else:
            allowed = allowed & ~np.isneginf(m)
            additive = np.where(np.isneginf(m), 0.0, m)
    return allowed, additive


def full_mask(inputs: AttentionInputs, invert_attn_mask: bool = False):
    """:func:`block_mask` over all queries and keys: (allowed or None, additive or None)."""
    return block_mask(inputs, 0, inputs.tq, 0, inputs.tk, invert_attn_mask)


def causal_key_limit(inputs: AttentionInputs, q1: int) -> int:
    """Exclusive upper bound of keys any query below q1 may see under the causal mask."""
    if not inputs.causal:
        return inputs.tk
    offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
    return int(min(inputs.tk, max(0, q1 + offset)))
