"""Mask construction in NumPy, for the built-in backends and for plugin authors.

Harness convention (see :mod:`mha_harness.contract.api`): ``attn_mask`` bool True = *may attend*, float = added
to the scaled scores (``-inf`` = masked); ``key_padding_mask`` True = *padding key to ignore*; ``causal``
``"top-left"`` (query i sees keys j <= i) or ``"bottom-right"`` (keys j <= i + Tk - Tq).

Public builders (re-exported as ``mha_harness.masks``):

* :func:`causal_mask` (Tq, Tk) in either alignment; :func:`padding_mask` (batch, Tk) from lengths;
  :func:`sliding_window_mask` (Tq, Tk) of a layer's sliding window;
* :func:`combined_mask` one boolean mask (batch|1, heads|1, Tq, Tk) for every mask of an
  :class:`~mha_harness.AttentionInputs` call, in the ``"attend"`` polarity (True = may attend) or the
  ``"ignore"`` polarity (True = masked out, e.g. ``torch.nn.MultiheadAttention``'s attn_mask);
* :func:`additive_mask` the same as a float mask (0 where allowed, ``masked_value`` where not, plus the finite
  values of a float attn_mask), for kernels that only take an additive bias.

The built-in backends build their masks with :func:`block_mask` / :func:`full_mask` (allowed, additive).
"""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionInputs
from mha_harness.contract.conventions import CAUSAL_ALIGNMENTS, causal_offset, window_allows, window_offset

POLARITIES = ("attend", "ignore")


def _polarity(allowed: np.ndarray, polarity: str) -> np.ndarray:
    if polarity not in POLARITIES:
        raise ValueError(f"polarity: got {polarity!r}; accepted: 'attend' (True = may attend) or "
                         "'ignore' (True = masked out)")
    return allowed if polarity == "attend" else ~allowed


def causal_mask(tq: int, tk: int, alignment: str = "top-left", *, polarity: str = "attend") -> np.ndarray:
    """(Tq, Tk) bool causal mask: ``top-left`` lets query i see keys j <= i, ``bottom-right`` keys j <= i + Tk - Tq."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"alignment: got {alignment!r}; accepted: 'top-left' or 'bottom-right'")
    offset = causal_offset(alignment, tq, tk)
    return _polarity(np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset, polarity)


def padding_mask(lengths, tk: int, *, polarity: str = "ignore") -> np.ndarray:
    """(batch, Tk) bool mask for sequences of the given real ``lengths``; by default True marks padding (the
    harness's ``key_padding_mask`` convention); ``polarity="attend"`` gives True for real keys instead."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or np.any(lengths < 0) or np.any(lengths > tk):
        raise ValueError(f"lengths: got {lengths.tolist()}; accepted: a 1-D sequence of integers in 0..Tk={tk}")
    real = np.arange(tk)[None, :] < lengths[:, None]
    return _polarity(real, polarity)  # "attend": True = real key; "ignore": True = padding


def _check_window(window) -> None:
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window: got {window!r}; accepted: an integer >= 1, the number of keys each query sees")


def sliding_window_mask(tq: int, tk: int, window: int, alignment: str | None = None, *,
                        polarity: str = "attend") -> np.ndarray:
    """(Tq, Tk) bool mask of a sliding window of ``window`` keys (``AttentionConfig.sliding_window``): query i, at
    position i + offset (the causal mask's diagonal in ``alignment``, bottom-right when None), sees key j only when
    j > i + offset - window: its own position and the window - 1 before it. It hides only the keys behind the
    window; combine it with :func:`causal_mask` for the keys after the query."""
    _check_window(window)
    if alignment is not None and alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"alignment: got {alignment!r}; accepted: None (bottom-right), 'top-left' or 'bottom-right'")
    return _polarity(window_allows(window, alignment, tq, tk), polarity)


def block_mask(inputs: AttentionInputs, q0: int, q1: int, k0: int, k1: int, *, sliding_window: int | None = None):
    """Allowed (bool, True = may attend) and additive (float or None) masks for queries q0:q1 and keys k0:k1, with
    the keys behind a layer's ``sliding_window`` (``config.sliding_window``; None: none) hidden too.

    Shapes broadcast to (batch, heads, q1 - q0, k1 - k0); ``allowed`` is None when nothing is masked.
    """
    tq, tk = inputs.tq, inputs.tk
    if (inputs.causal is None and inputs.key_padding_mask is None and inputs.attn_mask is None
            and sliding_window is None):
        return None, None
    allowed = np.ones((1, 1, q1 - q0, k1 - k0), dtype=bool)
    if inputs.causal:
        offset = causal_offset(inputs.causal, tq, tk)
        allowed = allowed & (np.arange(k0, k1)[None, :] <= np.arange(q0, q1)[:, None] + offset)
    if sliding_window is not None:  # the block's part of sliding_window_mask, built for the block alone
        _check_window(sliding_window)
        allowed = allowed & window_allows(sliding_window, inputs.causal, tq, tk, np.arange(q0, q1),
                                          np.arange(k0, k1))
    if inputs.key_padding_mask is not None:
        allowed = allowed & ~inputs.key_padding_mask[:, None, None, k0:k1]
    additive = None
    if inputs.attn_mask is not None:
        m = inputs.attn_mask
        m = (m.reshape((1, 1) + m.shape) if m.ndim == 2 else m)[:, :, q0:q1, k0:k1]
        if m.dtype == np.bool_:
            allowed = allowed & m
        else:
            allowed = allowed & ~np.isneginf(m)
            additive = np.where(np.isneginf(m), 0.0, m)
    return allowed, additive


def full_mask(inputs: AttentionInputs, *, sliding_window: int | None = None):
    """:func:`block_mask` over all queries and keys: (allowed or None, additive or None)."""
    return block_mask(inputs, 0, inputs.tq, 0, inputs.tk, sliding_window=sliding_window)


def _without_causal(inputs: AttentionInputs, causal: bool) -> AttentionInputs:
    """``inputs`` as the mask helpers read them: ``causal=False`` leaves the call's causal mask out, for a layer that
    applies causal masking itself (its own flag); passing it in the mask too would hide a bug in the layer's own
    causal path, since the harness's mask would then do the masking the leak cases check."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: got {causal!r}; accepted: True (the call's causal mask included) or False (left "
                        "out, for a layer that masks causally through its own flag)")
    return inputs if causal or not inputs.causal else inputs.replace(causal=None)


def _windowed_full_mask(inputs: AttentionInputs, causal: bool, sliding_window: int | None):
    """:func:`full_mask` of ``inputs`` without the causal mask when ``causal`` is False, with the window's diagonal
    still the call's alignment (a window is the layer's, whatever route its causal mask takes)."""
    allowed, additive = full_mask(_without_causal(inputs, causal))
    if sliding_window is None:
        return allowed, additive
    window = sliding_window_mask(inputs.tq, inputs.tk, sliding_window, inputs.causal)[None, None]
    return (window if allowed is None else allowed & window), additive


def combined_mask(inputs: AttentionInputs, *, polarity: str = "attend", causal: bool = True,
                  sliding_window: int | None = None) -> np.ndarray | None:
    """Every mask of the call (causal, key padding, attn_mask) as ONE bool array (batch|1, heads|1, Tq, Tk), or
    None when nothing is masked. ``polarity="attend"``: True = may attend (SDPA, jax); ``"ignore"``: True = masked
    out (``nn.MultiheadAttention``). ``causal=False``: without the causal mask, for a layer given ``inputs.causal``
    through its own causal flag. ``sliding_window``: the layer's ``config.sliding_window`` (None: none), whose
    keys behind the window are masked too (:func:`sliding_window_mask`; the window's diagonal is the call's causal
    alignment even with ``causal=False``). The finite values of a float attn_mask are not in it: see
    :func:`additive_mask`."""
    allowed, _ = _windowed_full_mask(inputs, causal, sliding_window)
    return None if allowed is None else _polarity(allowed, polarity)


def additive_mask(inputs: AttentionInputs, *, masked_value: float = -np.inf, dtype=np.float64,
                  causal: bool = True, sliding_window: int | None = None) -> np.ndarray | None:
    """Every mask of the call as ONE float array (batch|1, heads|1, Tq, Tk) to add to the scaled scores: the
    finite values of a float attn_mask where allowed, ``masked_value`` where not (a library that cannot take
    -inf may pass a large finite negative value; rows with every key masked then differ). None when unmasked.
    ``causal=False`` leaves the causal mask out and ``sliding_window`` adds the layer's window, as in
    :func:`combined_mask`."""
    allowed, additive = _windowed_full_mask(inputs, causal, sliding_window)
    if allowed is None:
        return None
    base = np.zeros(allowed.shape) if additive is None else np.broadcast_to(additive, np.broadcast_shapes(
        additive.shape, allowed.shape))
    return np.where(allowed, base, masked_value).astype(dtype)


def window_key_start(inputs: AttentionInputs, q0: int, sliding_window: int | None) -> int:
    """Inclusive lower bound of the keys any query from q0 on may see under a sliding window of ``sliding_window``
    keys (0 without one): the query at position p sees only keys j > p - w (:func:`window_allows`), and the first
    query, q0, has the smallest position, so a tiled kernel can skip every key before it."""
    if sliding_window is None:
        return 0
    _check_window(sliding_window)
    offset = window_offset(inputs.causal, inputs.tq, inputs.tk)
    return int(min(inputs.tk, max(0, q0 + offset - sliding_window + 1)))


def causal_key_limit(inputs: AttentionInputs, q1: int) -> int:
    """Exclusive upper bound of keys any query below q1 may see under the causal mask."""
    if not inputs.causal:
        return inputs.tk
    offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
    return int(min(inputs.tk, max(0, q1 + offset)))
