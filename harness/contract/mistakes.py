"""Known mistakes a wrong result is compared with to name it: wrong layers that are the true layer with other
parameters (a wrong score scale, W_o left out), calls with a wrong causal mask, a decode step that writes its new
keys and values one slot too far, and a backward that never reaches the parameters. Used by the conformance
cases' diagnoses and by ``mha-harness bench``'s check of a benchmarked call."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams
from mha_harness.contract.conventions import BOTTOM_RIGHT, TOP_LEFT, causal_offset, other_alignment
from mha_harness.contract.score_scale import score_scale_at


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """The largest absolute difference of two arrays of one shape, NaN where both hold NaN counting as equal; inf
    where only one holds NaN or inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.abs(np.where(both_nan, 0.0, a - b))
    diff[~both_nan & ~np.isfinite(diff)] = np.inf
    return float(diff.max(initial=0.0))


def folded_into_attn_mask(mask: np.ndarray | None, allowed: np.ndarray) -> np.ndarray:
    """A call's ``attn_mask`` (None, bool or float) with ``allowed`` (True = may attend) as one more mask in it: the
    two bool masks' intersection, or the float mask's values with -inf where ``allowed`` is False (a mistake that
    hides keys the reference would not, expressed as the call's own mask)."""
    if mask is None:
        return allowed
    if mask.dtype == np.bool_:
        return mask & allowed
    return np.where(allowed, mask, -np.inf)


def explains(got: np.ndarray, wrong: np.ndarray, truth: np.ndarray) -> bool:
    """Whether a known mistake's output ``wrong`` explains a failed output ``got`` better than the correct output
    ``truth`` does: less than half as far from it. A diagnosis compares with a margin wider than the failed
    bound (float noise of the mistake's own path), so where a failure is smaller than that margin every mistake
    that leaves this input's output unchanged (a padding mask not applied where nothing is padded) is within it too,
    yet cannot be what differs; this keeps those out."""
    return distance(got, wrong) < 0.5 * distance(got, truth)


def diagnosis_margin(bound: float) -> float:
    """How far a known mistake's output may lie from a failed output and still be named: ten times the failed
    bound (the mistake's own float64 path rounds too, and a layer in half precision rounds its way to it), at least
    1e-4."""
    return max(10 * bound, 1e-4)


def closest_mistake(got: np.ndarray, truth: np.ndarray, candidates, bound: float, *,
                    name_ties: bool = False) -> tuple[str, float] | None:
    """The known mistake a failed output ``got`` matches: of ``candidates`` (an iterable of (sentence to append,
    the mistake's output), computed as it is consumed), those within :func:`diagnosis_margin` of ``got`` that
    :func:`explains` better than the correct output ``truth``, the closest, as (sentence, its distance from
    ``got``); None when none matches. ``name_ties``: mistakes that give this call the very same output are named
    together, the first listed first ("; or, the same output at this call, ...")."""
    margin = diagnosis_margin(bound)
    found = []
    for label, wrong in candidates:
        gap = distance(got, wrong)
        if gap <= margin and explains(got, wrong, truth):
            found.append((label, gap))
    if not found:
        return None
    best = min(gap for _, gap in found)
    if not name_ties:
        return next(item for item in found if item[1] == best)
    tied = list(dict.fromkeys(label for label, gap in found if gap <= best + 1e-12 * (1.0 + best)))
    prefix = "; the output matches "
    others = "".join(f"; or, the same output at this call, {label.removeprefix(prefix)}" for label in tied[1:])
    return tied[0] + others, best


def explains_as_a_scale(got: np.ndarray, wrong: np.ndarray, truth: np.ndarray, uniform: np.ndarray) -> bool:
    """Whether a wrong score scale's output ``wrong`` explains a failed output ``got``: better than the correct
    output ``truth`` (:func:`explains`) and better than ``uniform``, the layer's output with every score 0 (uniform
    weights over the visible keys, :func:`with_score_scale` by 0). The small wrong scales' outputs approach uniform
    weights, and so does any output whose weights are spread over many keys: over a thousand keys in half precision,
    with the diagnosis's wider margin, keys projected from the wrong input came within it of scores scaled by
    1/d_model (a stranger's T5 layer). An output no nearer the wrong scale than uniform weights shows no scale."""
    return explains(got, wrong, truth) and explains(got, wrong, uniform)


def with_score_scale(params: AttentionParams, factor: float) -> AttentionParams:
    """Parameters whose reference output equals the true layer with scores multiplied by ``factor``: q's
    projection times ``factor``, or, in a layer with a q/k norm (which would undo that), q's norm gain (and bias)."""
    if params.config.qk_norm is not None:
        beta_q = None if params.beta_q is None else params.beta_q * factor
        return params.replace(g_q=params.g_q * factor, beta_q=beta_q)
    b_q = None if params.b_q is None else params.b_q * factor
    return params.replace(W_q=params.W_q * factor, b_q=b_q)


def wrong_scales(config: AttentionConfig, declared=None) -> dict[float, str]:
    """The common score scales (1/sqrt(d_head), 1/sqrt(d_model), none, 1/d_head, 1/d_model) other than the layer's
    true one (the ``declared`` score scale, :mod:`~mha_harness.contract.score_scale`: None is 1/sqrt(d_head)) as
    factors of the true scale -> their label; scales that coincide for this shape (d_head = sqrt(d_model): 1/d_head
    and 1/sqrt(d_model)) are one entry ("1/sqrt(d_model) or 1/d_head"; an outside user read
    "1/sqrt(d_model) = 1/d_head" as a claim about the formula), the true scale is left out (empty when
    d_model = d_head = 1: every common wrong scale is the right one)."""
    true = score_scale_at(declared, config.d_head)
    candidates = {"1/sqrt(d_head)": 1 / np.sqrt(config.d_head), "1/sqrt(d_model)": 1 / np.sqrt(config.d_model),
                  "1 (no scaling)": 1.0, "1/d_head": 1 / config.d_head, "1/d_model": 1 / config.d_model}
    same: dict[float, list[str]] = {}
    for label, scale in candidates.items():
        factor = scale / true
        if not np.isclose(factor, 1.0, rtol=1e-12):
            same.setdefault(round(float(factor), 12), []).append(label)
    return {factor: " or ".join(labels) for factor, labels in same.items()}


def with_kv_weights_swapped(params: AttentionParams) -> AttentionParams | None:
    """Parameters whose reference output is the layer with W_k (and b_k) loaded into its value projection and W_v
    (b_v) into its key projection; None where the swap changes nothing (the same arrays)."""
    if np.array_equal(params.W_k, params.W_v):
        return None
    return params.replace(W_k=params.W_v, W_v=params.W_k, b_k=params.b_v, b_v=params.b_k)


def with_qk_weights_swapped(params: AttentionParams) -> AttentionParams | None:
    """Parameters whose reference output is the layer with W_q (and b_q) loaded into its key projection and W_k
    (b_k) into its query projection (a fused qkv weight split in the wrong order); None where the shapes differ
    (grouped-query heads: such a layer raises) or the swap changes nothing."""
    if params.W_q.shape != params.W_k.shape or np.array_equal(params.W_q, params.W_k):
        return None
    return params.replace(W_q=params.W_k, W_k=params.W_q, b_q=params.b_k, b_k=params.b_q)


#: a fused qkv weight loaded in the other layout, in words: (layout the layer reads, layout loaded)
FUSED_QKV_LAYOUTS = {
    "per_head": ("GPT-NeoX's, Bloom's and Falcon's query_key_value: [q | k | v] per head, qkv.view(..., heads, "
                 "3 * d_head).chunk(3)", "[W_q | W_k | W_v] in blocks (GPT-2's c_attn, timm's qkv)"),
    "blocks": ("[W_q | W_k | W_v] in blocks (GPT-2's c_attn, timm's qkv)", "GPT-NeoX's per-head [q | k | v] order"),
}


def with_fused_qkv_misread(params: AttentionParams, layer_reads: str) -> AttentionParams | None:
    """Parameters whose reference output is a layer with one fused qkv projection that reads its columns in
    ``layer_reads`` layout (``"per_head"``: head h's q, k and v side by side, GPT-NeoX's; ``"blocks"``: all of q, then
    k, then v) loaded with them in the other; None for grouped-query heads (the fused widths differ) or one head
    (both layouts are the same)."""
    c = params.config
    if c.kv_heads != c.num_heads or c.num_heads == 1:
        return None
    d, h, dh = c.d_model, c.num_heads, c.d_head
    # what was loaded: the blocks as they are into a per-head layer, or packed per head (column j of the per-head
    # layout is column order[j] of the blocks: head i's q, k, v side by side) into a blocks layer
    loaded = slice(None) if layer_reads == "per_head" else \
        (np.arange(3)[None, :, None] * d + np.arange(h)[:, None, None] * dh + np.arange(dh)[None, None, :]).reshape(-1)
    fused_w = np.concatenate([params.W_q, params.W_k, params.W_v], axis=1)[:, loaded]
    fused_b = None if params.b_q is None else np.concatenate([params.b_q, params.b_k, params.b_v])[loaded]
    if layer_reads == "per_head":  # the layer splits the loaded columns per head: q, k, v of head i
        split = fused_w.reshape(d, h, 3, dh)
        ws = [split[:, :, j, :].reshape(d, d) for j in range(3)]
        bs = [None] * 3 if fused_b is None else [fused_b.reshape(h, 3, dh)[:, j, :].reshape(d) for j in range(3)]
    else:  # the layer splits the loaded columns in three blocks
        ws = [fused_w[:, j * d:(j + 1) * d] for j in range(3)]
        bs = [None] * 3 if fused_b is None else [fused_b[j * d:(j + 1) * d] for j in range(3)]
    return params.replace(W_q=ws[0], W_k=ws[1], W_v=ws[2], b_q=bs[0], b_k=bs[1], b_v=bs[2])


#: projection weights a wrapper loads into a (out, in) layer (torch's and Equinox's Linear weight) without .T
LOADED_UNTRANSPOSED = ("loaded untransposed: W where W.T belongs (torch.nn.Linear and eqx.nn.Linear keep their weight "
                       "as (out, in), the harness's W as (in, out): load W.T)")


def with_weights_transposed(params: AttentionParams, names: tuple[str, ...]) -> AttentionParams | None:
    """Parameters whose reference output is the layer with the square weights ``names`` transposed (a wrapper that
    loads W where W.T belongs); None when one of them is not square (its shapes would not fit: such a layer raises)
    or all are symmetric (the same layer: the head separation case's identity W_o is)."""
    arrays = {n: getattr(params, n) for n in names}
    if any(a.shape[0] != a.shape[1] for a in arrays.values()):
        return None
    changed = {n: a.T.copy() for n, a in arrays.items() if not np.array_equal(a, a.T)}
    return params.replace(**changed) if changed else None


def without_output_projection(params: AttentionParams) -> AttentionParams:
    """Parameters whose reference output is the heads' concatenation, W_o (and b_o) left out (d_model wide, as the
    layer's output: num_heads * d_head = d_model)."""
    return params.replace(W_o=np.eye(params.config.d_model, dtype=params.W_o.dtype),
                          b_o=None if params.b_o is None else np.zeros_like(params.b_o))


#: grouped-query key/value heads expanded by tiling, in words
KV_HEADS_TILED = ("grouped-query key/value heads expanded by tiling: query head h reads key/value head h % kv_heads "
                  "instead of h // (heads / kv_heads) (torch .repeat, np.tile or jnp.tile where repeat_interleave "
                  "or np.repeat / jnp.repeat belongs)")


def with_kv_heads_tiled(params: AttentionParams) -> AttentionParams | None:
    """Parameters whose reference output is the layer with its grouped-query key/value heads expanded by tiling
    (query head h reads key/value head h % kv_heads): the query heads relabelled, head h moved to (h % kv_heads) *
    group + h // kv_heads with its W_q columns, b_q entries and W_o rows, where the correct grouping gives it key/value
    head h % kv_heads; None where tiling is grouping (one key/value head, or one query head per key/value head)."""
    c = params.config
    if c.group == 1 or c.kv_heads == 1:
        return None
    order = [0] * c.num_heads
    for h in range(c.num_heads):
        order[(h % c.kv_heads) * c.group + h // c.kv_heads] = h
    columns = np.concatenate([np.arange(h * c.d_head, (h + 1) * c.d_head) for h in order])
    g_q = params.g_q[columns] if c.qk_norm == "rms_over_projection" else params.g_q  # a head's gains move with it
    return params.replace(W_q=params.W_q[:, columns], b_q=None if params.b_q is None else params.b_q[columns],
                          W_o=params.W_o[columns, :], g_q=g_q)


def causal_mask_mistakes(inputs: AttentionInputs) -> dict[str, AttentionInputs]:
    """For a causal call ``inputs``: the calls whose reference outputs are the common causal-mask mistakes, by name.
    ``"not_applied"``: the same call without its causal mask; ``"other_alignment"`` (Tq != Tk only): the other
    alignment; ``"one_key_too_wide"`` (query i
    also sees key i + 1), ``"reversed"`` (query i sees key i and every later key: triu where tril belongs),
    ``"no_diagonal"`` (query i cannot see its own key), ``"inverted"`` (the mask's polarity flipped: query i sees
    only the keys after i, the last query none) and, where the alignment offsets the diagonal (bottom-right with
    Tq != Tk), ``"offset_negated"`` (tril(diagonal=Tq - Tk) where diagonal=Tk - Tq belongs), as boolean masks
    offset like the call's alignment, joined to the call's own attn_mask where it has one (a causal mask one key too
    wide beside an additive mask was named a half-precision error: an outside user's FlexAttention layer). Empty
    without a causal mask. The calls carry no causal mask of their own, also for a backend that declares
    ``always_causal`` (:meth:`AttentionInputs.replace` keeps a copy's causal as given)."""
    if inputs.causal is None:
        return {}
    tq, tk = inputs.tq, inputs.tk
    offset = causal_offset(inputs.causal, tq, tk)
    unmasked = inputs.replace(causal=None)
    calls = {"not_applied": unmasked}
    if tq != tk:
        calls["other_alignment"] = inputs.replace(causal=other_alignment(inputs.causal))
    def causal_as(allowed: np.ndarray) -> AttentionInputs:  # the mistaken causal mask joined to the call's attn_mask
        return unmasked.replace(attn_mask=folded_into_attn_mask(inputs.attn_mask, allowed))
    calls["one_key_too_wide"] = causal_as(np.tri(tq, tk, k=offset + 1, dtype=bool))
    calls["reversed"] = causal_as(~np.tri(tq, tk, k=offset - 1, dtype=bool))
    calls["no_diagonal"] = causal_as(np.tri(tq, tk, k=offset - 1, dtype=bool))
    calls["inverted"] = causal_as(~np.tri(tq, tk, k=offset, dtype=bool))
    if offset:
        calls["offset_negated"] = causal_as(np.tri(tq, tk, k=-offset, dtype=bool))
    for chunk in QUERY_CHUNKS:  # only calls longer than a chunk differ from the right mask
        if chunk < tq:
            relative = np.arange(tq) % chunk
            calls[chunk_relative(chunk)] = causal_as(np.arange(tk)[None, :] <= relative[:, None] + offset)
    return calls


#: the query chunk sizes a causal mask built from chunk-relative query indices is looked for at
QUERY_CHUNKS = (16, 32, 64, 128, 256, 512)


def chunk_relative(chunk: int) -> str:
    """The name :func:`causal_mask_mistakes` gives the call of a causal mask built per chunk of ``chunk`` queries."""
    return f"chunk_relative_{chunk}"


def chunk_relative_words(chunk: int) -> str:
    """A causal mask built per chunk of ``chunk`` queries from the chunk-relative query index, in words."""
    return (f"a causal mask built per chunk of {chunk} queries from the chunk-relative query index (arange(0, end - "
            f"start) where arange(start, end) belongs): query i sees the keys up to i mod {chunk}, so every chunk "
            "after the first loses the keys before it")


#: a bottom-right causal mask built with its diagonal offset's sign flipped, in words
OFFSET_NEGATED = ("a causal mask with its diagonal offset negated: query i sees keys 0..i + Tq - Tk instead of "
                  "0..i + Tk - Tq (tril(ones(Tq, Tk), diagonal=Tq - Tk) where diagonal=Tk - Tq belongs)")


#: what each alignment lets query i see, and the mask that makes it
_REACH = {TOP_LEFT: ("keys 0..i", "tril(ones(Tq, Tk))"),
          BOTTOM_RIGHT: ("keys 0..i + Tk - Tq", "tril(ones(Tq, Tk), diagonal=Tk - Tq)")}


def padding_over_query_length(inputs: AttentionInputs) -> AttentionInputs | None:
    """The call as a layer sees it whose key padding mask is built, sliced or looped over the query length
    (``range(q.shape[1])``, written for self-attention): ``key_padding_mask`` cleared at the key positions >= Tq.
    None when that is the call itself (no padding mask, Tq >= Tk, or no key at or after Tq padded)."""
    kpm = inputs.key_padding_mask
    if kpm is None or inputs.tq >= inputs.tk or not np.asarray(kpm)[:, inputs.tq:].any():
        return None
    short = np.array(kpm, bool)
    short[:, inputs.tq:] = False
    return inputs.replace(key_padding_mask=short)


#: the start of the diagnosis of a cross-attention layer whose keys and values come from its query input
SELF_ATTENTION_OVER_QUERIES = ("keys and values projected from the query input: self-attention over the queries where "
                               "attention to ")


def wrong_input_calls(inputs: AttentionInputs) -> list[tuple[str, AttentionInputs]]:
    """(description, call) of a cross-attention layer that projects its keys or values from the wrong input, for a
    ``shared_kv`` or ``separate`` call: the key and value inputs swapped, keys from the value input, values from the
    key input (``separate``), and, where the query input has the key input's shape (Tq = Tk), keys, values or both
    from the query input (the last is self-attention over the queries; at Tq != Tk only it, and only for a call
    without masks). Each call's reference output is that layer's; empty for the other forms (one x, or a KV-cache
    step whose keys are its own input). Used by ``check``'s diagnoses and ``bench``'s output check."""
    form = inputs.form
    if form not in ("shared_kv", "separate"):
        return []
    kv = "x_kv" if form == "shared_kv" else "the key input"
    calls = []
    if form == "separate":
        calls += [("the key and value inputs swapped (W_k applied to value, W_v to key)",
                   inputs.replace(key=inputs.value, value=inputs.key)),
                  ("keys projected from the value input (W_k applied to value, not key)",
                   inputs.replace(key=inputs.value)),
                  ("values projected from the key input (W_v applied to key, not value)",
                   inputs.replace(value=inputs.key))]
    same_shape = inputs.query.shape == inputs.key.shape
    if same_shape:
        values = "x_kv" if form == "shared_kv" else "the value input"
        calls += [(f"keys projected from the query input (W_k applied to the query input, not {kv})",
                   inputs.replace(key=inputs.query)),
                  (f"values projected from the query input (W_v applied to the query input, not {values})",
                   inputs.replace(value=inputs.query))]
    # at Tq != Tk a layer projecting both from the query input attends over the Tq queries, a call the reference can
    # make where no mask over the Tk keys is in it (an outside user's bench of such a layer said only "wrong-output")
    if same_shape or (inputs.key_padding_mask is None and inputs.attn_mask is None and not inputs.causal):
        calls.append((SELF_ATTENTION_OVER_QUERIES + kv + " belongs", inputs.replace(key=inputs.query,
                                                                                value=inputs.query)))
    return calls


def alignment_mistake(expected: str, form: str) -> str:
    """The causal mask aligned the other way than ``expected`` (Tq != Tk), in words and as the mask that was built:
    "top-left alignment instead of bottom-right: query i sees ...". A KV-cache call (``form`` "kv_cache") that
    should be bottom-right says what that means for a step: its new queries miss the cached keys."""
    other = other_alignment(expected)
    text = (f"{other} alignment instead of {expected}: query i sees {_REACH[other][0]}, not {_REACH[expected][0]} "
            f"({_REACH[other][1]} where {_REACH[expected][1]} belongs)")
    if form == "kv_cache" and expected == BOTTOM_RIGHT:
        text += "; in a KV-cache step the new queries then miss the cached keys: offset the mask by the cache length"
    return text


def frozen_parameters_hint(gradients: dict, params: AttentionParams) -> str:
    """A message suffix when every parameter's gradient in ``gradients`` (name -> array, or a part of it) is zero or
    absent: the backward never reaches the parameters. Empty otherwise (a layer without parameters included)."""
    names = list(params.arrays())
    if names and all(not np.any(np.asarray(gradients.get(n, 0.0), np.float64)) for n in names):
        return ("; every parameter's gradient is zero or missing: the backward does not reach the parameters (a "
                "weight that does not require grad, a detached or no_grad projection)")
    return ""


#: where a causal mask without its diagonal comes from in a KV-cache step, as a diagnosis adds it
ATTENDS_BEFORE_WRITING = ("in a KV-cache step: one that attends to the cache before it writes the new tokens' keys "
                          "and values, or a key range that stops one key short of the step's own")

#: what :func:`written_one_slot_late` stands for, as a diagnosis names it
WRITTEN_ONE_SLOT_LATE = ("a decode step that writes the new keys and values one slot too far (from position Tk - Tq "
                         "+ 1: the slot before them stays empty) and attends the first Tk slots, so query i sees an "
                         "empty slot and not its own key: write at the step's position, not one past it")


def written_one_slot_late(params: AttentionParams, inputs: AttentionInputs) -> AttentionInputs | None:
    """For a causal KV-cache call (``inputs.form == "kv_cache"``; bottom-right, or either alignment at Tq = Tk): the
    call whose reference output is a decode step's that writes its Tq new keys and values one slot past their
    positions, leaving the slot before them zero, and attends the first Tk slots: query j sees the cached positions,
    the empty slot and the new keys before its own. None where no call of this layer gives that: another form or
    mask, no causal mask, or key/value biases (an empty slot's zeros are then no projection of an input)."""
    bottom_right = inputs.causal == BOTTOM_RIGHT or (inputs.causal is not None and inputs.tq == inputs.tk)
    if (inputs.form != "kv_cache" or not bottom_right or inputs.key_padding_mask is not None
            or inputs.attn_mask is not None or params.b_k is not None or params.b_v is not None):
        return None
    start = inputs.tk - inputs.tq
    x = inputs.key
    shifted = np.concatenate([x[:, :start], np.zeros_like(x[:, :1]), x[:, start:inputs.tk - 1]], axis=1)
    return inputs.replace(key=shifted, value=shifted)
