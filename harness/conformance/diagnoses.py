"""Known wrong algorithms, computed in NumPy, so a failed comparison can name the mistake its output matches: a
reversed, misaligned, missing, diagonal-free or one-off causal mask, a mask read with the opposite polarity, the key
padding mask along the query axis or not applied, one of two masks dropped, masks applied after the softmax, heads
split by tokens instead of features (on the way in, out, or both), heads concatenated feature-major, grouped-query
key/value heads tiled, keys or values projected from the wrong input, a softmax over the queries, an online softmax
that never rescales its accumulator, no output projection, a KV-cache step's new keys put before the cached ones;
and, where none is named, that the rows seeing a single key are the only right ones (the weights are wrong). The
rows a wrong call leaves without a key are compared under the empty-row convention the backend's output follows there
(zeros, or the uniform average of V or NaN that a ``fully_masked_rows`` divergence declares). A mistake is named only
where it explains the output better than the correct layer does (:func:`~mha_harness.contract.mistakes.explains`)."""
from __future__ import annotations

import functools
import re
from collections.abc import Callable

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.conventions import causal_offset, rotary_positions
from mha_harness.contract.mistakes import (
    ATTENDS_BEFORE_WRITING,
    FUSED_QKV_LAYOUTS,
    KV_HEADS_TILED,
    LOADED_UNTRANSPOSED,
    OFFSET_NEGATED,
    QUERY_CHUNKS,
    WRITTEN_ONE_SLOT_LATE,
    alignment_mistake,
    causal_mask_mistakes,
    chunk_relative,
    chunk_relative_words,
    diagnosis_margin,
    explains,
    folded_into_attn_mask,
    padding_over_query_length,
    with_fused_qkv_misread,
    with_kv_weights_swapped,
    with_qk_weights_swapped,
    with_weights_transposed,
    written_one_slot_late,
    wrong_input_calls,
)
from mha_harness.contract.reference import (
    allowed_and_bias,
    empty_rows_convention,
    logit_softcap,
    qk_normed,
    reference_attention,
    rotated,
    score_scale,
    soft_capped,
)
from mha_harness.contract.scores_fit import scores_mismatch


def wrong_layer_output(params: AttentionParams, inputs: AttentionInputs, *, split_tokens: bool | str = False,
                       heads_feature_major: bool = False, softmax_axis: int = -1,
                       mask_after_softmax: bool = False, kv_tiled: bool = False,
                       unrescaled_block: int = 0, unrescaled: str = "both", cap_after_mask: bool = False,
                       cached_kv_swapped: bool = False, masked_fill: float | None = None) -> np.ndarray:
    """The layer with one of the known mistakes, in float64, with the call's biases and masks: ``split_tokens``, the
    lesson's wrong head split (each projection (B, T, h * d_head) reshaped to (B, h, T, d_head): a head holds a
    block of tokens instead of its own features of every token, merged back the same way; a module masks its score
    matrix by index); ``split_tokens="split"`` only on the way in (the merge transposes back correctly),
    ``split_tokens="merge"`` only on the way out (the split is right, the merge reshapes (B, h, T, d_head) to (B, T,
    h * d_head) without the transpose); ``heads_feature_major``, the heads merged feature-major before W_o (feature
    j of head h at j * h_count + h instead of h * d_head + j: (B, h, T, d_head) transposed to (B, T, d_head, h)
    before the reshape, as W_o read per head as reshape(d_head, h, d_model).transpose(1, 0, 2) does);
    ``softmax_axis=-2``, the softmax over the queries instead of the keys; ``mask_after_softmax``, the masks applied
    after the softmax without renormalising (masked keys get weight 0 but stay in every row's normaliser);
    ``kv_tiled``, grouped-query key/value heads expanded by tiling (query head h reads key/value head h % kv_heads,
    as torch ``.repeat`` or ``np.tile`` give) instead of each repeated for its group of consecutive query heads (h
    // group); ``unrescaled_block``, an online softmax over key blocks of that many keys that never rescales its
    accumulator and row sum when the running maximum grows (each key weighted exp(s - m) with the running maximum
    m after its own block, :func:`unrescaled_block_weights`), or, with ``unrescaled="accumulator"``, only its
    accumulator (the row sum rescaled, so the stale numerators are divided by the true row sum), or with
    ``"row_sum"`` only its row sum (the true numerators over the stale sum); ``cap_after_mask``, the declared soft cap c
    (:func:`~mha_harness.contract.reference.logit_softcap`) taken after the masks, ``c * tanh((s + mask) / c)``
    with a masked score at -c (tanh(-inf) = -1: the masked keys keep a weight); ``cached_kv_swapped``, a KV-cache
    step that reads its cached positions' keys from the value cache and their values from the key cache (the
    step's own new keys and values right; the cached keys as stored, turned by a rotary); ``masked_fill``, every
    masked score set to that value instead of -inf (``jnp.where(mask, scores, 0.0)``: a masked key keeps a weight).
    A layer with a q/k norm
    (``config.qk_norm``) norms its q and k projections as the reference does (a mistaken norm:
    :mod:`~mha_harness.contract.qk_norm_diagnoses`). Masked values never reach
    it (a NaN stored there is read as 0)."""
    c = params.config
    split_in, merge_out = split_tokens in (True, "split"), split_tokens in (True, "merge")

    def heads(x, w, bias, n, which="v"):
        y = np.asarray(x, np.float64) @ w + (0.0 if bias is None else bias)
        if which != "v":
            y = qk_normed(y, getattr(params, f"g_{which}"), c, n, bias=getattr(params, f"beta_{which}"))
        b, t, width = y.shape
        h = y.reshape(b, n, t, width // n) if split_in else y.reshape(b, t, n, width // n).transpose(0, 2, 1, 3)
        return h if which == "v" else rotated(h, positions[which], c, which=which)
    positions = dict(zip("qk", rotary_positions(inputs.tq, inputs.tk)))
    q = heads(inputs.query, params.W_q, params.b_q, c.num_heads, "q")
    def expand(kv):
        return np.tile(kv, (1, c.group, 1, 1)) if kv_tiled else np.repeat(kv, c.group, axis=1)
    k, v = (expand(heads(x, w, bias, c.kv_heads, which))
            for x, w, bias, which in ((inputs.key, params.W_k, params.b_k, "k"),
                                      (inputs.value, params.W_v, params.b_v, "v")))
    if cached_kv_swapped:
        start = inputs.tk - inputs.tq
        k, v = (np.concatenate([v[:, :, :start], k[:, :, start:]], axis=2),
                np.concatenate([k[:, :, :start], v[:, :, start:]], axis=2))
    allowed, additive = allowed_and_bias(params, inputs)
    raw, bias = q @ k.transpose(0, 1, 3, 2) * score_scale(c.d_head), (0.0 if additive is None else additive)
    cap = logit_softcap()
    if cap_after_mask and cap is not None:
        with np.errstate(invalid="ignore"):
            scores = np.where(allowed, cap * np.tanh((raw + bias) / cap), -cap)
    else:
        scores = soft_capped(raw) + bias
        if not mask_after_softmax:
            scores = np.where(allowed, scores, -np.inf if masked_fill is None else masked_fill)
    if unrescaled not in ("both", "accumulator", "row_sum"):
        raise ValueError(f"unrescaled: got {unrescaled!r}; accepted: both, accumulator, row_sum")
    top = scores.max(axis=softmax_axis, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    normaliser = weights  # the row sum's terms, in the same units as the numerators
    if unrescaled_block:
        stale = unrescaled_block_weights(scores, unrescaled_block)
        weights, normaliser = {"both": (stale, stale), "accumulator": (stale, weights),
                               "row_sum": (weights, stale)}[unrescaled]
    weights = weights / np.maximum(normaliser.sum(axis=softmax_axis, keepdims=True),
                                   np.finfo(np.float64).tiny)  # empty: zeros
    if mask_after_softmax:
        weights = np.where(allowed, weights, 0.0)
    out = weights @ np.where(np.isfinite(v), v, 0.0)
    b, h, t, dh = out.shape
    order = (0, 2, 3, 1) if heads_feature_major else (0, 2, 1, 3)  # (B, T, d_head, h) or (B, T, h, d_head)
    merged = out.reshape(b, t, h * dh) if merge_out else out.transpose(order).reshape(b, t, h * dh)
    return merged @ params.W_o + (0.0 if params.b_o is None else params.b_o)


def unrescaled_block_weights(scores: np.ndarray, block: int) -> np.ndarray:
    """The unnormalised weights of an online softmax over key blocks of ``block`` keys that never rescales what it
    has accumulated: each key's exp(s - m_b), m_b the running row maximum after the key's block b (-inf scores,
    masked keys, weigh 0). Normalised by their row sum, they are that kernel's output weights: its accumulator and
    row sum both hold each block in the units of the maximum it saw then."""
    tk = scores.shape[-1]
    blocks = -(-tk // block)
    padded = np.concatenate([scores, np.full((*scores.shape[:-1], blocks * block - tk), -np.inf)], axis=-1)
    running = np.maximum.accumulate(padded.reshape(*scores.shape[:-1], blocks, block).max(axis=-1), axis=-1)
    per_key = np.repeat(running, block, axis=-1)[..., :tk]
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(scores), np.exp(scores - np.where(np.isfinite(per_key), per_key, 0.0)), 0.0)


#: the key block sizes an online softmax's missing rescale is looked for at (powers of two of tiled CPU and GPU kernels)
UNRESCALED_BLOCKS = (16, 32, 64, 128, 256)

#: what an online softmax may leave unrescaled (wrong_layer_output's ``unrescaled``), in words, and the fix: both, or
#: one of the two (an outside user's JAX kernel rescaled its row sum but not its accumulator and was named nowhere)
UNRESCALED_PARTS = (("both", "its accumulator and row sum",
                     "multiply both by exp(m_old - m_new) before adding a block"),
                    ("accumulator", "its accumulator (the row sum is rescaled)",
                     "multiply the accumulator by exp(m_old - m_new) before adding a block, as the row sum is"),
                    ("row_sum", "its row sum (the accumulator is rescaled)",
                     "multiply the row sum by exp(m_old - m_new) before adding a block, as the accumulator is"))


def _truth(params: AttentionParams, inputs: AttentionInputs, weights: bool = False) -> Callable[[], np.ndarray]:
    """The correct call's float64 output (with ``weights``: per-head weights), computed on first use only; the hints
    take it as ``truth`` so that :func:`mask_mistake` computes it once for all of them."""
    @functools.cache
    def compute() -> np.ndarray:
        out = reference_attention(params, inputs, need_weights=weights)
        return out.weights if weights else out.output
    return compute


def _matches(got: np.ndarray, params: AttentionParams, call: AttentionInputs, rows=None, atol: float = 1e-3,
             weights: bool = False, truth: Callable[[], np.ndarray] | None = None) -> bool:
    """Whether ``got`` (on ``rows`` of (batch, Tq) if given) is, within ``atol``, the reference output of the wrong
    ``call`` (with ``weights``: its per-head weights (batch, heads, Tq, Tk), on whole arrays), with the rows that
    ``call``'s masks leave without a key under the empty-row convention the backend follows there: the reference's
    (zeros; the declared one while a ``fully_masked_rows`` divergence is verified) first, else the one ``got`` shows,
    NaN where it has NaN, the uniform average of V where it is finite. So a backend that declares
    ``fully_masked_rows:uniform_average`` (flax, jax.nn.dot_product_attention) or ``:nan`` is diagnosed like one that
    gives zeros: a wrong mask that hides every key of a row shows its convention there, not zeros. NaN outside those
    rows, or inf, matches nothing and costs no reference. With ``truth`` (the correct call's output, :func:`_truth`)
    the wrong call must also explain ``got`` better than it (:func:`~mha_harness.contract.mistakes.explains`)."""
    def pick(a: np.ndarray) -> np.ndarray:
        return a if rows is None else a[rows]
    compared = pick(np.asarray(got, np.float64))
    allowed, _ = allowed_and_bias(params, call)
    empty = np.broadcast_to(~allowed.any(axis=-1), (call.batch, params.config.num_heads, call.tq))  # per head
    empty = pick(empty if weights else empty.any(axis=1))  # an output row: some head sees no key
    nan_rows = ~np.isfinite(compared).all(axis=-1)
    if np.isinf(compared).any() or (nan_rows & ~empty).any():
        return False
    if nan_rows.any():
        conventions = ["nan"]
    else:  # finite: the convention in force first, the other finite one only where a row is left without a key
        in_force = empty_rows_convention()
        conventions = sorted(("zeros", "uniform_average"), key=lambda c: c != in_force)[:2 if empty.any() else 1]
    for convention in conventions:
        out = reference_attention(params, call, need_weights=weights, empty_rows=convention)
        wrong = pick(out.weights if weights else out.output)
        if np.allclose(compared, wrong, atol=atol, equal_nan=True):
            return truth is None or explains(compared, wrong, pick(truth()))
    return False


def _wrong_layer_explains(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows,
                          truth: Callable[[], np.ndarray] | None, **mistake) -> bool:
    """Whether ``got`` (on ``rows`` of (batch, Tq) if given) is, within 1e-4, :func:`wrong_layer_output` with
    ``mistake``, and that explains it better than the correct output (``truth``, computed here when None) does."""
    if rows is not None:
        got = got[rows]
    if not np.all(np.isfinite(got)):  # the wrong layer's output is finite: no match, and no need to build it
        return False
    wrong = wrong_layer_output(params, inputs, **mistake)
    if rows is not None:
        wrong = wrong[rows]
    if not np.allclose(got, wrong, atol=1e-4, rtol=1e-4):
        return False
    correct = (truth or _truth(params, inputs))()
    return explains(got, wrong, correct if rows is None else correct[rows])


def normaliser_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                    truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix when ``got`` matches the mask-after-softmax mistake (on ``rows`` of (batch, Tq) if given)."""
    if not _wrong_layer_explains(got, params, inputs, rows, truth, mask_after_softmax=True):
        return ""
    return ("; the output matches the mask applied after the softmax without renormalising (masked keys still "
            "enter the softmax denominator)")


def masked_to_zero_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                        truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix when ``got`` (on ``rows`` of (batch, Tq) if given) matches the masked scores set to 0 instead
    of -inf (``wrong_layer_output(..., masked_fill=0.0)``): each masked key keeps a weight exp(0 - max) (an outside
    user's JAX layer with ``jnp.where(mask, scores, 0.0)`` failed the causal cases with figures and "a leak")."""
    if not _wrong_layer_explains(got, params, inputs, rows, truth, masked_fill=0.0):
        return ""
    return ("; the output matches masked scores set to 0 instead of -inf (jnp.where(mask, scores, 0.0) or "
            "masked_fill(mask, 0.0) where -inf, or the dtype's most negative finite value, belongs): every masked key "
            "keeps a weight of exp(0 - max)")


def cap_after_mask_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                        truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix when a layer that declares a soft cap c gives ``got`` (on ``rows`` of (batch, Tq) if given)
    as the cap taken after the masks does (``wrong_layer_output(..., cap_after_mask=True)``): a float mask bent with
    the scores, a masked score -c instead of -inf, so every masked key keeps a weight of about exp(-c - max) and a
    row with no visible key averages them all (a port of Gemma 2's eager attention adding the mask before its
    ``attn_logit_softcapping``: an outside user's copy failed the float-mask, composition and fully-masked cases
    with numbers only). "" without a declared cap."""
    cap = logit_softcap()
    if cap is None or not _wrong_layer_explains(got, params, inputs, rows, truth, cap_after_mask=True):
        return ""
    return f"; the output matches {CAP_AFTER_MASK.format(cap=cap)}"


#: the mistake :func:`cap_after_mask_hint` names (``cap``: the declared cap); it holds :data:`SOFTCAP_MATCH`, so a
#: failure that names it drops its guess of a precision
CAP_AFTER_MASK = ("scores soft-capped after the masks, {cap:g} * tanh((s + mask) / {cap:g}): a float mask is bent with "
                  "the scores and a masked score becomes -{cap:g} instead of -inf, so the masked keys keep a weight "
                  "(a row with no visible key averages them): cap the scaled scores, then add the mask")


_ONE_KEY_TOO_WIDE = "; the output matches a causal mask one key too wide (query i also sees key i + 1)"


def causal_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs,
                truth: Callable[[], np.ndarray] | None = None, rows=None) -> str:
    """A message suffix naming the causal-mask mistake a causal call's output ``got`` matches: the other alignment
    (Tq != Tk), a mask without the diagonal, no mask at all, a reversed mask (the future instead of the past), an
    inverted one (its polarity flipped: only the future), a bottom-right mask with its diagonal offset negated, or a
    mask one key too wide; "" when none. On ``rows`` of (batch, Tq) if given (a composition with a padding mask:
    its real queries). Rows a candidate leaves without a key are compared under the backend's empty-row convention
    (:func:`_matches`)."""
    alignment, tq, tk = inputs.causal, inputs.tq, inputs.tk
    if alignment is None:
        return ""

    truth = truth or _truth(params, inputs)

    def matches(other: AttentionInputs | None) -> bool:
        return other is not None and _matches(got, params, other, rows, truth=truth)
    mistake = causal_mask_mistakes(inputs)
    # at some shapes a negated offset gives what another mistake gives (Tq > Tk: every key, as no mask; one query
    # against two keys: none, as the inverted mask): both are named there
    negated = f"; the output matches {OFFSET_NEGATED}" if matches(mistake.get("offset_negated")) else ""
    if inputs.attn_mask is None and matches(mistake.get("not_applied")):  # Tq = Tk = 2: one key too wide is no mask
        return _together(["; the output matches attention without a causal mask: the mask is not applied",
                          _ONE_KEY_TOO_WIDE if matches(mistake.get("one_key_too_wide")) else "", negated])
    if matches(mistake.get("reversed")):
        return _together(["; the output matches a reversed causal mask: query i sees key i and every later key (the "
                          "future) instead of the keys up to i (triu where tril belongs: torch.triu, np.triu or "
                          "jnp.triu)", negated])
    no_diagonal = matches(mistake.get("no_diagonal"))
    if matches(mistake.get("inverted")):  # one query against one key: no key either way, as without the diagonal
        return _together(["; the output matches the causal mask inverted: query i sees only the keys after i (the "
                          "future), none of the keys up to i (the mask's polarity flipped: keys masked where they may "
                          "be attended, as masked_fill(mask == 1, ...) where mask == 0 belongs, or a keep-mask passed "
                          "where a mask of the keys to hide is read)", negated,
                          _no_diagonal_words(alignment, tq, tk, inputs.form) if no_diagonal else ""])
    if negated:
        return negated
    if matches(mistake.get("one_key_too_wide")):
        return _ONE_KEY_TOO_WIDE
    hints = []  # at some shapes (one query against two keys) these two give the same output: both are named
    if no_diagonal:
        hints.append(_no_diagonal_words(alignment, tq, tk, inputs.form))
    late = written_one_slot_late(params, inputs)
    if late is not None and matches(late):
        hints.append(f"; the output matches {WRITTEN_ONE_SLOT_LATE}")
    if matches(mistake.get("other_alignment")):
        hints.append(f"; the output matches {alignment_mistake(alignment, inputs.form)}")
    hints += [f"; the output matches {chunk_relative_words(chunk)}" for chunk in QUERY_CHUNKS
              if matches(mistake.get(chunk_relative(chunk)))]
    return _together(hints)


def _no_diagonal_words(alignment: str, tq: int, tk: int, form: str) -> str:
    """The diagnosis of a causal mask without its diagonal, as a message suffix."""
    offset = causal_offset(alignment, tq, tk)
    own_key = "key i" if offset == 0 else f"its own key, key i {'+' if offset > 0 else '-'} {abs(offset)}"
    step = f" ({ATTENDS_BEFORE_WRITING})" if form == "kv_cache" else ""
    return f"; the output matches a causal mask that excludes the diagonal (query i cannot see {own_key})" + step


def dropped_mask_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                      truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix naming the one mask that a call with several masks behaves as if it had dropped, or a lone
    key padding mask as not applied: ``got`` matches the reference of the same call without that mask (on ``rows`` of
    (batch, Tq) if given; rows left without a key under the backend's empty-row convention, :func:`_matches`); ""
    when none. A lone causal mask or attn_mask is left to :func:`causal_hint` and the polarity and normaliser
    hints."""
    candidates = []
    if inputs.causal is not None:  # without its causal mask, also for a backend that declares always_causal
        candidates.append((f"the causal mask ({inputs.causal})", inputs.replace(causal=None)))
    if inputs.key_padding_mask is not None:
        candidates.append(("key_padding_mask", inputs.replace(key_padding_mask=None)))
    if inputs.attn_mask is not None:
        kind = "bool" if inputs.attn_mask.dtype == np.bool_ else "additive"
        candidates.append((f"the {kind} attn_mask", inputs.replace(attn_mask=None)))
    if not candidates or (len(candidates) == 1 and inputs.key_padding_mask is None):
        return ""
    ending = "that mask is dropped when combined" if len(candidates) > 1 else "the mask is not applied"
    truth = truth or _truth(params, inputs)
    for label, other in candidates:
        if _matches(got, params, other, rows, truth=truth):
            return f"; the output matches the same call without {label}: {ending}"
    return ""


def layer_mistake(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float) -> str:
    """The diagnosis of a whole output that matches, within ``max(10 * bound, 1e-4)``, the layer with its heads
    split by tokens (on the way in, out, or both), its heads concatenated feature-major, its grouped-query key/value
    heads tiled, its keys or values projected from the wrong input (:func:`wrong_input_calls`), its softmax over the
    queries or over key blocks never rescaled (:data:`UNRESCALED_BLOCKS`), W_k and W_v loaded into each other's
    projections, W_q and W_k loaded into each other's, a fused qkv weight loaded in the other layout (blocks into
    GPT-NeoX's per-head one, or the other way round), square weights loaded untransposed (all of them, or one), or
    no output projection; "" when none.
    A candidate is tried only where it differs from the correct layer; every one that matches is named (with one
    key, a split by tokens on the way in changes nothing, so it cannot be told from the correct split)."""
    if not np.all(np.isfinite(got)):
        return ""
    c = params.config
    candidates = []
    if c.num_heads > 1 and inputs.tq > 1:  # one head or one token: the token split is the identity
        candidates.append(("the 'split tokens instead of features' mistake (reshape(h, T, d_head))",
                           lambda: wrong_layer_output(params, inputs, split_tokens=True)))
        candidates.append(("the 'split tokens instead of features' mistake on the way in only: the projections "
                           "reshaped to (B, h, T, d_head), where (B, T, h, d_head) then transpose(1, 2) belongs; the "
                           "merge is right",
                           lambda: wrong_layer_output(params, inputs, split_tokens="split")))
        candidates.append(("the heads merged without the transpose back: (B, h, T, d_head) reshaped to "
                           "(B, T, h * d_head), where transpose(1, 2) then reshape belongs; the split is right",
                           lambda: wrong_layer_output(params, inputs, split_tokens="merge")))
    if c.num_heads > 1 and c.d_head > 1:  # one head, or one feature per head: both layouts are the same
        candidates.append(("heads concatenated in the wrong order: feature j of head h at j * heads + h instead of "
                           "h * d_head + j (a transpose missing or swapped before the merge reshape, or W_o read per "
                           "head as reshape(d_head, heads, d_model))",
                           lambda: wrong_layer_output(params, inputs, heads_feature_major=True)))
    if c.group > 1 and c.kv_heads > 1:  # one key/value head, or one query head each: tiling is grouping
        candidates.append((KV_HEADS_TILED, lambda: wrong_layer_output(params, inputs, kv_tiled=True)))
    candidates.append(("a softmax over the queries (axis -2: each key's weights sum to 1) instead of over the keys",
                       lambda: wrong_layer_output(params, inputs, softmax_axis=-2)))
    candidates += [(label, functools.partial(lambda call: reference_attention(params, call).output, call))
                   for label, call in wrong_input_calls(inputs)]
    candidates += [(f"an online softmax over {b}-key blocks that never rescales {what} when the running maximum "
                    f"grows ({fix})",
                    functools.partial(lambda b, mode: wrong_layer_output(params, inputs, unrescaled_block=b,
                                                                         unrescaled=mode), b, mode))
                   for b in UNRESCALED_BLOCKS if b < inputs.tk for mode, what, fix in UNRESCALED_PARTS]
    swapped = with_kv_weights_swapped(params)
    if swapped is not None:
        candidates.append(("W_k and W_v loaded into each other's projections (W_k into the value projection, W_v "
                           "into the key projection)",
                           functools.partial(lambda p: reference_attention(p, inputs).output, swapped)))
    swapped = with_qk_weights_swapped(params)
    if swapped is not None:
        candidates.append(("W_q and W_k loaded into each other's projections (W_q into the key projection, W_k "
                           "into the query projection: a fused qkv weight split in the wrong order)",
                           functools.partial(lambda p: reference_attention(p, inputs).output, swapped)))
    for layout, (reads, loaded) in FUSED_QKV_LAYOUTS.items():
        misread = with_fused_qkv_misread(params, layout)
        if misread is not None:
            candidates.append((f"a fused qkv weight loaded as {loaded} into a layer that reads {reads}: pack W_q, "
                               "W_k and W_v (and their biases) in the layer's own layout",
                               functools.partial(lambda p: reference_attention(p, inputs).output, misread)))
    weights = [n for n in ("W_q", "W_k", "W_v", "W_o") if getattr(params, n).shape[0] == getattr(params, n).shape[1]]
    for names in [tuple(weights)] + [(n,) for n in weights]:  # all of them (W_q and W_o are always square), or one
        transposed = with_weights_transposed(params, names)
        if transposed is not None:
            candidates.append((f"{', '.join(names)} {LOADED_UNTRANSPOSED}",
                               functools.partial(lambda p: reference_attention(p, inputs).output, transposed)))
    no_bias = None if params.b_o is None else np.zeros_like(params.b_o)
    candidates.append(("concat(heads) without the output projection W_o (and b_o): W_o is missing",
                       lambda: reference_attention(params.replace(W_o=np.eye(c.d_model), b_o=no_bias), inputs).output))
    truth = reference_attention(params, inputs).output
    margin = diagnosis_margin(bound)
    found = []
    for label, output in candidates:
        wrong = output()
        if np.max(np.abs(got - wrong)) <= margin and explains(got, wrong, truth):
            found.append(f"; the output matches {label}")
    return _together(found)


#: where an inverted mask comes from when a wrapper converts the harness's mask for its layer: either the conversion
#: or the layer's own reading of its mask; flipping the wrapper to pass a layer that reads its mask inverted passes
#: here and breaks the layer for its real callers (a stranger's BERT encoder passed so)
_POLARITY_ADVICE = (" -- where a wrapper converts the harness's mask, either that conversion or the layer's own "
                    "reading of its mask is inverted: fix the layer when it is the layer (its real callers pass its "
                    "own convention), not by flipping the wrapper")


def polarity_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                  weights: bool = False, truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix when ``got`` matches the call with its key_padding_mask or bool attn_mask inverted (read as
    the opposite convention); on ``rows`` of (batch, Tq) if given; with ``weights``, ``got`` is the per-head
    weights (batch, heads, Tq, Tk) (a masked entry that is not 0); "" when neither. The inverted mask hides every key
    of the rows the true one leaves whole (an unpadded batch item): those are compared under the backend's
    empty-row convention (:func:`_matches`), so a backend that declares the uniform average of V there is named too."""
    candidates = []
    if inputs.key_padding_mask is not None:
        candidates.append(("key_padding_mask read with the opposite polarity (the harness's True = padding, ignore)",
                           inputs.replace(key_padding_mask=~inputs.key_padding_mask)))
    if inputs.attn_mask is not None and inputs.attn_mask.dtype == np.bool_:
        candidates.append(("INVERTED mask (True read as 'masked out'): mask polarity is reversed",
                           inputs.replace(attn_mask=~inputs.attn_mask)))
    truth = truth or _truth(params, inputs, weights)
    for label, inverted in candidates:
        if _matches(got, params, inverted, rows, weights=weights, truth=truth):
            return f"; the {'weights match' if weights else 'output matches'} the {label}{_POLARITY_ADVICE}"
    return ""


def transposed_mask_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                         truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix when ``got`` (on ``rows`` of (batch, Tq) if given) matches the call with its square
    attn_mask transposed (query i masked as query j's key i would be); "" otherwise, or when the mask is symmetric."""
    mask = inputs.attn_mask
    if mask is None or inputs.tq != inputs.tk:
        return ""
    transposed = np.swapaxes(mask, -1, -2)
    if np.array_equal(transposed, mask) or not _matches(got, params, inputs.replace(attn_mask=transposed), rows,
                                                        truth=truth):
        return ""
    return ("; the output matches the attn_mask transposed (entry [j, i] applied where [i, j] belongs: a mask "
            "built as (Tk, Tq) and read as (Tq, Tk), or one transpose too many)")


def padding_axis_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                      truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix when ``got`` (on ``rows`` of (batch, Tq) if given) matches the key padding mask broadcast
    along the query axis (``mask[:, None, :, None]`` where ``mask[:, None, None, :]`` belongs): the padded
    positions' query rows see no key, every other row sees every key, padded ones included; only with Tq == Tk,
    where that broadcast runs; "" otherwise. Each batch item is its own call (its rows' mask joins the call's other
    masks), compared under the backend's empty-row convention (:func:`_matches`); an item with no padded key (the
    same call either way) must match but cannot explain better than the correct output; nor can an item whose
    compared rows the broadcast leaves as they were (under a causal mask, right padding: the real queries see no
    padded key either way, an outside user's always-causal layer was named "dropped" only), so one item that it
    explains better than the correct output is enough."""
    kpm = inputs.key_padding_mask
    if kpm is None or inputs.tq != inputs.tk or not kpm.any():
        return ""
    got = np.asarray(got, np.float64)
    whole = truth or _truth(params, inputs)
    explained = False
    for b in range(inputs.batch):
        mask = folded_into_attn_mask(inputs.attn_mask, np.broadcast_to(~kpm[b][:, None], (inputs.tq, inputs.tk)))
        call = inputs.replace(query=inputs.query[b:b + 1], key=inputs.key[b:b + 1], value=inputs.value[b:b + 1],
                              key_padding_mask=None, attn_mask=mask)
        item_rows = None if rows is None else rows[b:b + 1]
        # explaining better than the correct output implies matching: the first item that does costs one question
        if not explained and kpm[b].any() and _matches(got[b:b + 1], params, call, item_rows,
                                                       truth=lambda b=b: whole()[b:b + 1]):
            explained = True
        elif not _matches(got[b:b + 1], params, call, item_rows):
            return ""
    if not explained:
        return ""
    return ("; the output matches key_padding_mask applied along the query axis instead of the key axis (padded "
            "positions' queries see no key, the others see the padded keys too: mask[:, None, :, None] where "
            "mask[:, None, None, :] belongs)")


def padding_within_query_length_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None,
                                     truth: Callable[[], np.ndarray] | None = None) -> str:
    """A message suffix when ``got`` of a call with fewer queries than keys (Tq < Tk) matches the key padding mask
    applied to the first Tq keys only: a mask built, sliced or looped over the query length (``range(q.shape[1])``,
    written for self-attention, where Tq = Tk); "" otherwise, or when no key at or after position Tq is padded (the
    same call either way)."""
    short = padding_over_query_length(inputs)
    if short is None or not _matches(got, params, short, rows, truth=truth or _truth(params, inputs)):
        return ""
    later = (f"the key at position {inputs.tq} is" if inputs.tk - inputs.tq == 1
             else f"the keys at positions {inputs.tq}..{inputs.tk - 1} are")
    return (f"; the output matches key_padding_mask applied to the first Tq = {inputs.tq} keys only ({later} never "
            "masked): a padding mask built, sliced or looped over the query length, which equals the key length in "
            "self-attention only")


#: the phrase of every hint that names a known mistake the output matches (one, or several an input cannot tell apart)
MISTAKE_MATCH = "the output matches"

#: phrases every :func:`scores_fit_hint` sentence holds, one of them (a failure that has one drops its guess of a
#: precision: the fit named the cause)
SOFTCAP_MATCH, SCALE_MATCH = "soft-capped", "the output matches scores scaled by"


def scores_fit_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                    compare: np.ndarray | None = None) -> str:
    """A failed whole output that the reference reproduces with another soft cap on the scores
    (:func:`~mha_harness.contract.scores_fit.fitted_softcap`) or another score scale than any common one
    (:func:`~mha_harness.contract.scores_fit.fitted_score_scale`), whichever fits closer: scores soft-capped by an
    undeclared cap (an outside user's Gemma 2 layer was told its error was of half precision's size), by another cap
    than the declared one, or not at all under a declared cap; scores scaled by 0.125 where 0.1 is declared; ""
    otherwise. ``compare``: the (batch, Tq) rows of ``got`` that are specified."""
    return scores_mismatch(got, params, inputs, bound, compare=compare)


def single_key_rows_hint(got: np.ndarray, expected: np.ndarray, bound: float, params: AttentionParams,
                         inputs: AttentionInputs) -> str:
    """Where a failed output is right on every row that sees exactly one key (in every head) and wrong on every row
    that sees several: a row with one key outputs that key's value whatever its score, so the values, their
    projection, the head merge and W_o are right, and what differs is the weights where there is more than one key
    (the scores: the query or key path, the scale, a rotary or bias applied to one of q and k; or their
    normalisation). "" when no row sees one key, or such a row is wrong too (an outside user's Llama layer with rotary
    applied to k alone failed every case with numbers only, its single-key rows right)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if got.shape != expected.shape or got.ndim != 3:
        return ""
    allowed, _ = allowed_and_bias(params, inputs)
    visible = np.broadcast_to(allowed, (inputs.batch, allowed.shape[1], inputs.tq, inputs.tk)).sum(axis=-1)
    single = np.all(visible == 1, axis=1)  # (batch, Tq)
    with np.errstate(invalid="ignore"):
        wrong = ~(np.abs(got - expected).max(axis=-1) <= bound)  # NaN is wrong
    if not single.any() or not np.array_equal(wrong, ~single):  # right exactly where a row sees one key
        return ""
    # no counts: the summary groups failures by this sentence, whatever the call
    return ("; every row that sees a single key is right and every row that sees several keys is wrong: a row with "
            "one key outputs that key's value whatever its score, so the values, the head merge and W_o are right, "
            "and the weights over several keys differ: the scores (the query or key projection, the scale, a rotary "
            "or bias applied to q or k alone) or their normalisation")


def cache_order_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs) -> str:
    """A KV-cache step's output that matches the new keys and values put before the cached ones (x_kv's last Tq
    rows first, the masks and the causal offset applied by index as given); "" otherwise or for other forms."""
    if inputs.form != "kv_cache" or inputs.tk == inputs.tq or not np.all(np.isfinite(got)):
        return ""
    start = inputs.tk - inputs.tq
    reordered = np.concatenate([inputs.key[:, start:], inputs.key[:, :start]], axis=1)
    if _matches(got, params, inputs.replace(key=reordered, value=reordered), truth=_truth(params, inputs)):
        return ("; the output matches the new keys and values put before the cached ones (the step concatenates "
                "[new, cached]): append them after the cache")
    return ""


def cache_kv_swapped_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs) -> str:
    """A KV-cache step's output that matches its cached positions' keys and values read from each other's cache,
    its own new ones right (:func:`wrong_layer_output`'s ``cached_kv_swapped``); "" otherwise, for other forms and
    for a step with nothing cached. An outside user's step with its cache's K and V swapped failed with figures
    only."""
    if inputs.form != "kv_cache" or inputs.tk == inputs.tq:
        return ""
    if not _wrong_layer_explains(got, params, inputs, None, None, cached_kv_swapped=True):
        return ""
    return ("; the output matches the cache's keys and values swapped: the cached positions' keys read from the "
            "value cache and their values from the key cache, the step's own new keys and values right (a (k, v) "
            "pair stored or unpacked in the other order, past_key_value[0] and [1] exchanged)")


def _together(hints: list[str]) -> str:
    """Hints that all match one output, as one suffix: the first, or every one when the input cannot tell them
    apart (a diagnosis is named alone only when it is the only one that fits)."""
    hints = [h for h in hints if h]
    if len(hints) < 2:
        return hints[0] if hints else ""
    prefix = "; the output matches "
    parts = []
    for hint in hints:
        told = _TOLD_APART.match(hint)  # a list of its own (causal_hint's): its parts join this one
        parts += told.group(1).split("; or ") if told else [hint[len(prefix):] if hint.startswith(prefix)
                                                              else hint.lstrip("; ")]
    return (f"; this input cannot tell {len(parts)} mistakes apart, the output matches each: "
            + "; or ".join(parts))


_TOLD_APART = re.compile(r"; this input cannot tell \d+ mistakes apart, the output matches each: (.*)\Z", re.S)


def mask_mistake(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, rows=None) -> str:
    """The mask mistakes a failing output ``got`` of a masked call matches (on ``rows`` if given): the causal
    mask's (:func:`causal_hint`), an inverted polarity, the attn_mask transposed, the key padding mask along the
    query axis, over the first Tq keys only or not applied, one of two masks dropped, the masks applied after the
    softmax, masked scores set to 0 instead of -inf (:func:`masked_to_zero_hint`), a declared soft cap taken after
    the masks (:func:`cap_after_mask_hint`); "" when none or when the call has no mask. Every one that matches is
    named: on a small input two mistakes can give the same output, and naming only the first would be a guess. The
    wrong calls' rows without a key follow the backend's empty-row convention (:func:`_matches`)."""
    if inputs.causal is None and inputs.key_padding_mask is None and inputs.attn_mask is None:
        return ""
    truth = _truth(params, inputs)  # the correct output, computed once for every hint that needs it
    return _together([causal_hint(got, params, inputs, truth, rows),
                      polarity_hint(got, params, inputs, rows, truth=truth),
                      transposed_mask_hint(got, params, inputs, rows, truth),
                      padding_axis_hint(got, params, inputs, rows, truth),
                      padding_within_query_length_hint(got, params, inputs, rows, truth),
                      dropped_mask_hint(got, params, inputs, rows, truth),
                      normaliser_hint(got, params, inputs, rows, truth),
                      masked_to_zero_hint(got, params, inputs, rows, truth),
                      cap_after_mask_hint(got, params, inputs, rows, truth)])
