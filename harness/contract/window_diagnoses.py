"""Known mistakes of a sliding window (``AttentionConfig.sliding_window``), computed by the reference, so a failed
comparison can name the one its output matches: the window not applied, one key too wide (the query's own key not
counted among its w: flash-attn's ``window_size=(w, 0)`` where ``(w - 1, 0)`` belongs, as transformers' flash
path once had against its eager one) or one key too narrow, measured from each query's index in the call instead of
its position (a KV-cache step's window that does not count the cached positions), alone or with the causal mask
counted so too (jax.nn.dot_product_attention's ``local_window_size=(w - 1, 0)`` in such a call); and, for a layer
built without a window, the window a layer with one fixed inside it applies."""
from __future__ import annotations

import dataclasses

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.conventions import TOP_LEFT, window_allows, window_offset
from mha_harness.contract.mistakes import closest_mistake, diagnosis_margin, folded_into_attn_mask
from mha_harness.contract.reference import WINDOW_FIELD, allowed_and_bias, reference_attention, without_masks

#: the longest call at whose every window width a windowed layer's output is compared (one reference each)
MAX_WIDTHS_TRIED = 128


def _with_allowed(params: AttentionParams, inputs: AttentionInputs, allowed: np.ndarray):
    """(params, inputs) whose reference is the layer without its window, with ``allowed`` (Tq, Tk) as one more mask:
    a window the reference does not apply itself, folded into the call's attn_mask."""
    unwindowed = without_masks(params, inputs, (WINDOW_FIELD,))[0]
    return unwindowed, inputs.replace(attn_mask=folded_into_attn_mask(inputs.attn_mask, allowed))


def _widths_that_can_differ(got: np.ndarray, truth: np.ndarray, inputs: AttentionInputs, margin: float
                            ) -> list[int]:
    """The window widths that can explain an output of a layer without a window: a window of w keys leaves the
    queries at positions below w as they are (no key lies behind their window) and changes the one at position w, so
    where the first rows are right w is the position of the first query row that differs by more than ``margin``;
    where every row differs (the queries are the last of many positions, a KV-cache step) any width below that
    position may, and each is tried up to :data:`MAX_WIDTHS_TRIED` keys."""
    rows = np.flatnonzero(np.max(np.abs(got - truth), axis=(0, 2)) > margin)
    if not len(rows):
        return []
    first = int(rows[0]) + window_offset(inputs.causal, inputs.tq, inputs.tk)
    if rows[0] > 0:
        return [first] if 1 <= first < inputs.tk else []
    return list(range(1, min(first, inputs.tk - 1) + 1)) if inputs.tk <= MAX_WIDTHS_TRIED else []


def _empties_a_row(params: AttentionParams, inputs: AttentionInputs, width: int, rows_with_keys: np.ndarray) -> bool:
    """Whether a window of ``width`` keys, joined to the call's masks, leaves a query row (in some head) without a
    key that the call without it does not: that row's output is then the empty-row convention's (under the uniform
    average, the plain average of V, within a small margin of any softmax over nearly equal scores), so a match
    there tells nothing of a window (an outside user's layer that never masked its one padded key, at Tq = 1 and
    Tk = 2, was named "a sliding window of 1 keys" in a layer built without one). ``rows_with_keys``: which rows
    see a key in the call without the window (computed once for all the widths tried)."""
    after, _ = allowed_and_bias(params.replace(config=dataclasses.replace(params.config, sliding_window=width)), inputs)
    return bool(np.any(~np.any(after, axis=-1) & rows_with_keys))


def _candidates(params: AttentionParams, inputs: AttentionInputs, got: np.ndarray, truth: np.ndarray,
                margin: float):
    """(label, wrong parameters, wrong inputs) for each window mistake of this layer and call, the more specific
    first (a window counted from the query's index equals, at one call, a wider one: the first is named first)."""
    c, w = params.config, params.config.sliding_window
    tq, tk, offset = inputs.tq, inputs.tk, window_offset(inputs.causal, inputs.tq, inputs.tk)
    if w is None:
        rows_with_keys = None
        for width in _widths_that_can_differ(got, truth, inputs, margin):
            if rows_with_keys is None:
                rows_with_keys = np.any(allowed_and_bias(params, inputs)[0], axis=-1)
            if _empties_a_row(params, inputs, width, rows_with_keys):
                continue
            yield (f"; the output matches a sliding window of {width} keys (each query sees its own position and the "
                   f"{width - 1} before it) in a layer built without one (config.sliding_window is None): a window "
                   "fixed in the layer (Mistral's config.sliding_window, Gemma's local layers) applies where the "
                   "harness's layer has none: build the window from config.sliding_window (None: no window) and "
                   "declare Capabilities(sliding_window=True)",
                   params.replace(config=dataclasses.replace(c, sliding_window=width)), inputs)
        return
    yield (f"; the output matches attention without its sliding window: config.sliding_window = {w} is not applied "
           "(every key up to the query's position is seen)", *without_masks(params, inputs, (WINDOW_FIELD,)))
    yield (f"; the output matches a sliding window one key too wide: each query sees {w + 1} keys, its own position "
           f"and the {w} before it, where config.sliding_window = {w} counts its own among the {w} (key j seen when "
           f"j >= p - {w} where j > p - {w} belongs: flash-attn's window_size=({w}, 0) where ({w - 1}, 0) belongs)",
           params.replace(config=dataclasses.replace(c, sliding_window=w + 1)), inputs)
    if w > 1:
        yield (f"; the output matches a sliding window one key too narrow: each query sees {w - 1} keys where "
               f"config.sliding_window = {w} lets it see {w}, its own position and the {w - 1} before it (key j seen "
               f"when j > p - {w - 1} where j > p - {w} belongs)",
               params.replace(config=dataclasses.replace(c, sliding_window=w - 1)), inputs)
    if offset != 0:  # queries not at 0 .. Tq - 1: a window from their index differs
        from_index = window_allows(w, TOP_LEFT, tq, tk)
        yield (f"; the output matches a sliding window measured from each query's index in the call, i, where the "
               f"query is at position i + {offset} (the last Tq of the Tk positions): "
               "a KV-cache step whose window does not count the cached positions (key j seen when j > i - "
               f"{w}; count the window back from the query's position, cache length + i)",
               *_with_allowed(params, inputs, from_index))
        if inputs.causal:  # and its right side too: the causal mask from the index as well (top-left)
            yield (f"; the output matches a sliding window and a causal mask both counted from each query's index in "
                   f"the call, i, where the query is at position i + {offset}: key j "
                   f"seen when i - {w} < j <= i (jax.nn.dot_product_attention's local_window_size=({w - 1}, 0) is "
                   "top-left, as its is_causal is: in a call with fewer queries than keys, a KV-cache step, pass "
                   "the window in the mask)",
                   *_with_allowed(params, inputs, from_index & (np.arange(tk)[None, :] <= np.arange(tq)[:, None])))
    # any other width that changes this call: a window fixed in the layer, whatever the config says (one wider than
    # the last query's position hides nothing: that is no window, named above)
    if tk <= MAX_WIDTHS_TRIED:
        for width in range(1, tq + offset):
            if abs(width - w) > 1:
                yield (f"; the output matches a sliding window of {width} keys where config.sliding_window = {w}: a "
                       "window fixed in the layer (a config built once, Mistral's 4096), not built from "
                       "config.sliding_window", params.replace(config=dataclasses.replace(c, sliding_window=width)),
                       inputs)


def window_match(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                 rows: list[int] | None = None) -> tuple[str, float] | None:
    """The sliding-window mistake a failing whole output ``got`` matches within ``diagnosis_margin(bound)`` and explains
    better than the correct layer (:func:`~mha_harness.contract.mistakes.explains`), the closest of those that match,
    as (sentence to append, its distance from ``got``); None when none matches. Mistakes that give this call the same
    output are named together. ``rows``: ``got`` holds only these query rows (a benchmarked call's checked rows),
    and each reference is computed at them; then only a layer built with a window is diagnosed (the widths a layer
    without one may fix are read from which rows differ)."""
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)) or (rows is not None and params.config.sliding_window is None):
        return None
    truth = np.asarray(reference_attention(params, inputs, rows=rows).output, np.float64)
    outputs = ((label, np.asarray(reference_attention(wrong_params, wrong_inputs, rows=rows).output, np.float64))
               for label, wrong_params, wrong_inputs in _candidates(params, inputs, got, truth,
                                                                    diagnosis_margin(bound)))
    return closest_mistake(got, truth, outputs, bound, name_ties=True)


def window_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                rows: list[int] | None = None) -> str:
    """:func:`window_match`'s sentence, or ""."""
    found = window_match(got, params, inputs, bound, rows)
    return "" if found is None else found[0]
