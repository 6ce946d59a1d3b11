"""Known mistakes of an ALiBi layer (``AttentionConfig.alibi``), computed by the reference, so a failed comparison can
name the one its output matches: the bias not applied; the slopes in reverse head order; ``2 ** (-8 h / n)`` at a head
count that is not a power of two (where the paper interleaves the slopes of the next power of two); the slopes of the
key/value heads, repeated for each group (grouped-query heads); the bias's sign flipped (distant keys favoured); the
queries' positions taken from their index in the call instead of the last Tq of the Tk positions (a KV-cache step
or a cross-attention call whose bias ignores the keys before the queries); and the other kind of bias
(:data:`~mha_harness.contract.conventions.ALIBI_KINDS`: ``-m |p - s|`` where ``-m (p - s)`` is built, or the other
way, which differ only where a key after the query's position is visible); and, in a layer built without ALiBi, a
bias applied anyway (one always on in the layer, as BLOOM's and MPT's are). Each wrong bias is the layer without
ALiBi given that bias as one more float attn_mask, one slope per head."""
from __future__ import annotations

import dataclasses

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.conventions import (
    ALIBI_KINDS,
    alibi_bias,
    alibi_bias_from,
    alibi_slopes,
    rotary_positions,
)
from mha_harness.contract.mistakes import closest_mistake
from mha_harness.contract.reference import reference_attention

#: in every ALiBi diagnosis: a failure naming one drops its guess of a precision from the error's size (a wrong bias
#: changes the scores, which errs by any size; search's smallest layers, one head with slope 1/256, err by half
#: precision's)
ALIBI_MATCH = "ALiBi"


def _bias(kind: str, slopes: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """(1, H, Tq, Tk): :func:`~mha_harness.contract.conventions.alibi_bias_from` with a batch axis."""
    return alibi_bias_from(kind, slopes, q_pos, k_pos)[None]


def _with_bias(params: AttentionParams, inputs: AttentionInputs, bias: np.ndarray):
    """(params, inputs) whose reference is the layer without its ALiBi, with ``bias`` (1, H, Tq, Tk) added to the
    scores as one more float attn_mask (a bool mask's hidden keys at -inf, a float mask's values added)."""
    mask = inputs.attn_mask
    if mask is not None:
        mask = mask.reshape((1, 1) + mask.shape) if mask.ndim == 2 else mask
        bias = np.where(mask, bias, -np.inf) if mask.dtype == np.bool_ else bias + mask
    return (params.replace(config=dataclasses.replace(params.config, alibi=None)),
            inputs.replace(attn_mask=np.ascontiguousarray(np.broadcast_to(
                bias, (bias.shape[0], params.config.num_heads, inputs.tq, inputs.tk)))))


def _candidates(params: AttentionParams, inputs: AttentionInputs):
    """(label, wrong parameters, wrong inputs) for each ALiBi mistake that can change this layer's call; for a layer
    built without ALiBi, each kind applied anyway (a layer whose bias is always on, as BLOOM's and MPT's are)."""
    c = params.config
    kind, n, tq, tk = c.alibi, c.num_heads, inputs.tq, inputs.tk
    if kind is None:
        for other in ALIBI_KINDS:
            yield (f"; the output matches an ALiBi bias ({other!r}: "
                   + ("-m |p - s|" if other == "symmetric" else "-m (p - s)") + ", the paper's slopes) in a layer "
                   "built without one (config.alibi is None): a bias always on in the layer (BLOOM's, MPT's) applies "
                   "where the harness's layer has none: build it from config.alibi (None: no bias) and declare "
                   f"Capabilities(alibi=({other!r},))",
                   params.replace(config=dataclasses.replace(c, alibi=other)), inputs)
        return
    slopes = alibi_slopes(n)
    q_pos, k_pos = rotary_positions(tq, tk)
    yield ("; the output matches attention without its ALiBi bias: config.alibi = "
           f"{kind!r} is not applied (build the bias from config.alibi)",
           params.replace(config=dataclasses.replace(c, alibi=None)), inputs)
    if n > 1:
        yield ("; the output matches the ALiBi slopes in reverse head order: head h gets the slope of head "
               f"{n} - 1 - h (the paper's slopes fall from head 0, 2 ** (-8/n) first: alibi_slopes({n}))",
               *_with_bias(params, inputs, _bias(kind, slopes[::-1], q_pos, k_pos)))
    naive = 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
    if not np.allclose(naive, slopes, rtol=0, atol=0):
        yield (f"; the output matches ALiBi slopes 2 ** (-8 h / n) for h = 1 .. {n}: at {n} heads, not a power of "
               "two, the paper takes the slopes of the largest power of two m below n, then every other slope of 2m's "
               f"(mha_harness.alibi_slopes({n}), as BLOOM's build_alibi_tensor and MPT's gen_slopes give them)",
               *_with_bias(params, inputs, _bias(kind, naive, q_pos, k_pos)))
    if c.group > 1:
        per_kv = np.repeat(alibi_slopes(c.kv_heads), c.group)
        yield (f"; the output matches ALiBi slopes of the {c.kv_heads} key/value heads, each repeated for its group "
               f"of {c.group} query heads: the bias has one slope per query head (alibi_slopes({n}))",
               *_with_bias(params, inputs, _bias(kind, per_kv, q_pos, k_pos)))
    yield ("; the output matches the ALiBi bias with its sign flipped: +m * distance favours the distant keys "
           "(the bias is -m * distance)", *_with_bias(params, inputs, -_bias(kind, slopes, q_pos, k_pos)))
    if tq != tk:
        shift = f"+ {tk - tq}" if tk > tq else f"- {tq - tk}"
        yield (f"; the output matches an ALiBi bias that puts query i at position i, not i {shift} (the last query is "
               "at the last key's position, Tk - 1: a KV-cache step or a cross-attention call whose bias ignores "
               "the keys before the queries; flash-attn's alibi_slopes are bottom-right)",
               *_with_bias(params, inputs, _bias(kind, slopes, np.arange(tq), k_pos)))
    other = next(k for k in ALIBI_KINDS if k != kind)
    yield (f"; the output matches the {other!r} ALiBi bias where config.alibi = {kind!r}: "
           + ("-m * |p - s|, which also penalises the keys after the query's position, where the layer's "
              "-m * (p - s) favours them" if other == "symmetric" else
              "-m * (p - s), which favours the keys after the query's position, where the layer's -m * |p - s| "
              "penalises them"),
           *_with_bias(params, inputs, alibi_bias(other, n, tq, tk)[None]))


def alibi_match(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                rows: list[int] | None = None) -> tuple[str, float] | None:
    """The ALiBi mistake a failing whole output ``got`` matches within
    ``diagnosis_margin(bound)`` and explains better than the correct layer
    (:func:`~mha_harness.contract.mistakes.explains`), the closest of those that match, as (sentence to append, its
    distance from ``got``); for a layer built without ALiBi, a bias applied anyway; None when none matches.
    ``rows``: ``got`` holds only these query rows, and each reference is computed at them."""
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)) or inputs.tk < 2:  # one key: no distance to bias
        return None
    truth = np.asarray(reference_attention(params, inputs, rows=rows).output, np.float64)
    outputs = ((label, np.asarray(reference_attention(wrong_params, wrong_inputs, rows=rows).output, np.float64))
               for label, wrong_params, wrong_inputs in _candidates(params, inputs))
    return closest_mistake(got, truth, outputs, bound)


def alibi_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
               rows: list[int] | None = None) -> str:
    """:func:`alibi_match`'s sentence, or ""."""
    found = alibi_match(got, params, inputs, bound, rows)
    return "" if found is None else found[0]
