"""Agreement with the float64 reference across shapes and dtypes, and the attention weights."""
from __future__ import annotations

import numpy as np

from mha_harness.cases._fixtures import (
    ALL_FORMS,
    SHORT_BATCH,
    SHORT_D_HEAD,
    SHORT_HEADS,
    SHORT_SEQ,
    cross_ok,
    form_inputs,
    kv_cache_refusal,
)
from mha_harness.conformance.casekit import (
    CaseFailure,
    FormRefusal,
    Measurement,
    assert_close,
    case,
    check_against_reference,
    naive_forwards,
    primary_dtype,
    run,
    scale_hint,
    scores_hint,
    tolerance_for,
)
from mha_harness.conformance.diagnoses import polarity_hint
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.conventions import COMMON_ROTARY_SCALINGS
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention
from mha_harness.contract.tolerance import farthest, tolerance_from

# name: (batch, heads, d_head, Tq, Tk, bias, kv_heads): covers batch {1, 3}, T {1, 7, 64, 129, 1000}, Tq != Tk,
# d_head {8, 64, 80}, heads {1, 2, 8}, with and without biases, grouped- and multi-query heads, grouped-query heads
# with more keys than queries too (a KV-cache step with a filled cache, a cross-attention call: a layer that groups
# its heads right only at Tq == Tk passed every other row, a stranger's KV-cache step tiling them). A row with
# biases runs bias-free on a backend that declares no biases (Capabilities.bias False: most current layers), so such
# a backend loses no shape, length or head layout of the grid; its variant says ``bias: False``.
GRID = {
    "single_token": (1, 1, 8, 1, 1, False, None),
    "short_with_bias": (SHORT_BATCH, SHORT_HEADS, SHORT_D_HEAD, SHORT_SEQ, SHORT_SEQ, True, None),
    "eight_heads": (3, 8, 8, 64, 64, False, None),
    "d_head_64_with_bias": (1, 2, 64, 129, 129, True, None),
    "d_head_80": (3, 2, 80, 129, 129, False, None),
    "long_with_bias": (1, 2, 64, 1000, 1000, True, None),
    "more_keys": (3, 2, 8, 7, 64, False, None),
    "long_keys_with_bias": (1, 8, 8, 129, 1000, True, None),
    "single_key": (3, 8, 8, 64, 1, False, None),
    "grouped_query": (3, 8, 8, 64, 64, True, 2),
    "grouped_query_more_keys": (3, 8, 8, 7, 64, False, 2),
    "multi_query": (1, 8, 64, 129, 129, False, 1),
}
#: rows of layers with a norm on q and k (Capabilities.qk_norms; the same tuple as GRID's, then the norm): Qwen 3's
#: per-head RMSNorm with grouped-query heads and biases, OLMo 2's over the projection, timm's per-head LayerNorm with
#: its bias and ViT-22B's without (the projections' biases on in both), each at Tq = Tk, which every input form runs (an
#: outside user's OLMo 2 layer, one x only, skipped a Tq != Tk row: its norm was never compared). A backend that
#: declares no such norm skips them naming it.
QK_NORM_GRID = {
    "qk_norm_per_head": (3, 4, 16, 33, 33, True, 2, "rms_per_head"),
    "qk_norm_over_projection": (2, 4, 16, 40, 40, False, None, "rms_over_projection"),
    "qk_layer_norm_per_head": (2, 4, 16, 24, 24, True, None, "layer_per_head"),
    "qk_layer_norm_no_bias_per_head": (2, 4, 16, 24, 24, True, None, "layer_per_head_no_bias"),
}

#: rows of layers with rotary position embeddings (Capabilities.rotary; GRID's tuple, then the q/k norm, the rotary
#: pairing and its base): Llama 2's rotate_half with grouped-query heads and biases over 64 positions, Meta's
#: interleaved pairs at Llama 3's base, the queries as the last 7 of 64 positions (a KV-cache step: a layer that turns
#: them as positions 0 .. 6 passes every Tq = Tk row), and Qwen 3's layer (its per-head RMSNorm, then rotary at base
#: 1,000,000). A backend that declares no rotary skips them naming it. The last two rows (pairing None) run with the
#: first pairing the backend declares, so a layer with either pairing alone gets a row at Tq != Tk (an outside user's
#: Meta-style interleaved layer, its queries turned from 0, was caught by the gradients only). The last field is the
#: rotary's width (``rotary_dims``): ``rotary_partial`` is Phi-2's layer (d_head 80, its first 32 features turned,
#: the other 48 passed, with biases), which a backend declaring ``Capabilities.partial_rotary`` runs. The very last
#: is the frequencies' rescaling (``COMMON_ROTARY_SCALINGS``' kind): ``rotary_scaled_llama3`` is Llama 3.1's layer
#: (its ``rope_type="llama3"`` scaling by 8, base 500,000, grouped-query heads), ``rotary_scaled_linear`` a position
#: interpolation by 4, ``rotary_scaled_yarn`` Qwen 2.5's long-context layer (YaRN by 4 over 32,768 positions, base
#: 1,000,000, biases, grouped-query heads: its ramp spans frequencies 5 .. 10 of 16, q and k times 1.139); each runs
#: for a backend that declares that kind in ``Capabilities.rotary_scalings``. ``rotary_other_base`` (base None) turns
#: the first pairing declared at the base that pairing's own row does not use (:data:`OTHER_BASE`), at Tq = Tk: a
#: one-x layer of one pairing, no q/k norm and no gradients ran its own row alone, and an outside user's layer with
#: its base hard-coded to 10,000 passed.
ROTARY_GRID = {
    "rotary_half_split": (2, 4, 16, 64, 64, True, 2, None, "half_split", 10_000.0, None, None),
    "rotary_interleaved": (1, 2, 32, 48, 48, False, None, None, "interleaved", 500_000.0, None, None),
    "rotary_more_keys": (2, 4, 16, 7, 64, False, 2, None, None, 500_000.0, None, None),
    "rotary_other_base": (1, 2, 32, 48, 48, False, None, None, None, None, None, None),
    "rotary_qk_norm_per_head": (2, 4, 16, 40, 40, False, 2, "rms_per_head", None, 1_000_000.0, None, None),
    "rotary_partial": (2, 2, 80, 48, 48, True, None, None, None, 10_000.0, 32, None),
    "rotary_scaled_llama3": (2, 2, 32, 64, 64, False, 1, None, None, 500_000.0, None, "llama3"),
    "rotary_scaled_linear": (1, 2, 32, 48, 48, False, None, None, None, 10_000.0, None, "linear"),
    "rotary_scaled_yarn": (2, 2, 32, 64, 64, True, 1, None, None, 1_000_000.0, None, "yarn"),
}


#: ``rotary_other_base``'s base for each pairing: the base of the other pairing's row, not its own row's
OTHER_BASE = {"half_split": 500_000.0, "interleaved": 10_000.0}


def _grid_row_refusal(backend, tq, tk, kv, qk_norm=None, rotary=None, rotary_dims=None, scaling=None) -> str | None:
    """Why the backend cannot run a GRID row, from its declarations (the skip reason), or None. Biases are never a
    reason: a bias-free backend runs the row without them."""
    caps = backend.capabilities
    if rotary and rotary not in caps.rotary:
        return (f"does not declare rotary {rotary!r} (Capabilities.rotary: a layer with rotary position embeddings, "
                "as Llama, Mistral and Qwen have, declares its pairing)")
    if rotary_dims and not caps.partial_rotary:
        return (f"does not declare partial_rotary (rotary_dims = {rotary_dims}: Capabilities.partial_rotary, a layer "
                "whose rotary turns only each head's first features, as GPT-NeoX, Phi and StableLM have)")
    if scaling and scaling not in caps.rotary_scalings:
        return (f"does not declare rotary_scalings {scaling!r} (Capabilities.rotary_scalings: a layer whose rotary "
                "frequencies are rescaled for long contexts, as Llama 3.1's rope_type='llama3' or Qwen 2.5's 'yarn' "
                "does, declares it)")
    if qk_norm and qk_norm not in caps.qk_norms:
        return (f"does not declare qk_norms {qk_norm!r} (Capabilities.qk_norms: a layer with a norm of q and k, "
                "as Qwen 3, Gemma 3, OLMo 2 and ViT-22B have, declares it)")
    if tq != tk and not cross_ok(backend):
        return (FormRefusal(f"declares inputs='self' (one x): Tq = {tq} != Tk = {tk} is not defined for that form")
                if caps.inputs == "self"
                else f"does not declare capability 'cross_attention' (Tq = {tq} != Tk = {tk})")
    if tq > tk and caps.inputs == "kv_cache":  # the form's own limit, in the words _fixtures' KV-cache calls use
        return kv_cache_refusal(tq, tk)
    if tq > tk and not caps.more_queries_than_keys:
        return f"does not declare capability 'more_queries_than_keys' (Tq = {tq} > Tk = {tk})"
    if kv and not caps.grouped_query:
        return f"does not declare capability 'grouped_query' ({kv} key/value head(s))"
    if caps.max_seq_len and max(tq, tk) > caps.max_seq_len:
        return f"declares max_seq_len={caps.max_seq_len} (the row has T = {max(tq, tk)})"
    return None


def _grid_variants(backend):
    """Every GRID row (named by ``variant``) the backend can run, in every declared dtype; each row it cannot run
    once, in its primary dtype, as a variant that skips with the reason."""
    caps = backend.capabilities
    out, refused = [], []
    for dtype in caps.dtypes:
        rows = ([(name, row + (None,) * 5) for name, row in GRID.items()]
                + [(name, row + (None,) * 4) for name, row in QK_NORM_GRID.items()] + list(ROTARY_GRID.items()))
        for name, (batch, heads, d_head, tq, tk, bias, kv, qk_norm, rotary, base, rotary_dims, scaling) in rows:
            if name in ROTARY_GRID and rotary is None:  # the first pairing declared, half_split where none is
                rotary = (caps.rotary or ("half_split",))[0]
            if name in ROTARY_GRID and base is None:
                base = OTHER_BASE[rotary]
            v = {"dtype": dtype, "variant": name, "batch": batch, "heads": heads, "d_head": d_head, "seq": tq,
                 "tk": tk, "bias": bias and caps.bias}
            if kv:
                v["kv_heads"] = kv
            if qk_norm:
                v["qk_norm"] = qk_norm
            if rotary:
                v["rotary"], v["rotary_base"] = rotary, base
            if rotary_dims:
                v["rotary_dims"] = rotary_dims
            if scaling:
                v["rotary_scaling"] = scaling
            if caps.inputs == "separate" and tq == tk:  # called as a self-attention model calls it: labelled so
                v["one_x"] = True
            refusal = _grid_row_refusal(backend, tq, tk, kv, qk_norm, rotary, rotary_dims, scaling)
            if refusal is None:
                out.append(v)
            elif dtype == primary_dtype(backend):
                refused.append({**v, "unsupported": refusal})
    return out + refused


def _inputs(form, config, batch, tq, tk=None, seed=1, one_x=False, **masks):
    """Separate backends: one x (query is key is value) where the variant says ``one_x`` (the grid's and the long
    case's Tq == Tk rows), separate arrays otherwise; others: their form."""
    if form == "separate":
        return make_inputs(config, batch, tq, tk, seed=seed, self_attention=one_x, **masks)
    return form_inputs(form, config, batch, tq, tk, seed=seed, **masks)


@case(variants=_grid_variants, forms=ALL_FORMS)
def check_output_matches_reference(backend, *, form, dtype, variant, batch, heads, d_head, seq, tk, bias,
                                   kv_heads=None, one_x=False, qk_norm=None, rotary=None, rotary_base=10_000.0,
                                   rotary_dims=None, rotary_scaling=None):
    """Over a grid of batch sizes, sequence lengths (self and cross), head counts and widths, with and without
    biases, in every declared dtype, the output equals the float64 reference within the tolerance rule. A
    separate-form backend gets one x at Tq == Tk (``one_x``: how a self-attention model calls it; the other cases
    give it separate arrays) and separate arrays at Tq != Tk. A layer with a norm on q and k (``qk_norm``, declared
    in ``Capabilities.qk_norms``) runs its rows with that norm and gains that are not 1: the norm's axis and gains
    are checked too; one with rotary position embeddings (``rotary``, declared in ``Capabilities.rotary``) runs its
    rows turned at the positions of :func:`~mha_harness.contract.conventions.rotary_positions`, with the row's base,
    and one declaring ``Capabilities.partial_rotary`` a row whose rotary turns only each head's first
    ``rotary_dims`` features, and one declaring ``Capabilities.rotary_scalings`` a row with each declared rescaling
    of the frequencies (``rotary_scaling``, the kind of :data:`COMMON_ROTARY_SCALINGS`: Llama 3.1's, a linear one)."""
    config = AttentionConfig(heads * d_head, heads, kv_heads, bias=bias, qk_norm=qk_norm, rotary=rotary,
                             rotary_base=rotary_base, rotary_dims=rotary_dims,
                             rotary_scaling=rotary_scaling and COMMON_ROTARY_SCALINGS[rotary_scaling])
    params = make_params(config, seed=seq + tk)
    inputs = _inputs(form, config, batch, seq, tk, seed=batch + heads, one_x=one_x)
    # an always-causal backend's grid runs causal: a failure names the causal-mask mistake it matches (as every
    # whole-output comparison does)
    return Measurement(max_error=check_against_reference(backend, params, inputs, dtype))


def _long_variants(backend):
    caps = backend.capabilities
    if caps.max_seq_len and caps.max_seq_len < 8192:
        return [{"unsupported": f"declares max_seq_len={caps.max_seq_len}, below this case's T = 8192"}]
    # an always-causal layer is causal in both (its inputs are): one variant, labelled as what runs; at Tq = Tk the
    # causal variant runs in either alignment (the same mask), so a bottom-right-only layer runs it too
    out = [] if caps.always_causal else [{"dtype": primary_dtype(backend), "seq": 8192, "causal": False}]
    if caps.causal_alignments:
        out.append({"dtype": primary_dtype(backend), "seq": 8192, "causal": True})
    return [v | {"one_x": True} for v in out] if caps.inputs == "separate" else out


@case(variants=_long_variants, slow=True, forms=ALL_FORMS)
def check_long_sequence_sampled_rows_match_reference(backend, *, form, dtype, seq, causal, one_x=False):
    """At T = 8192 a seeded sample of query rows (first, last and random) equals the row-subset reference,
    which costs O(rows * T) instead of O(T^2). Two heads of width 8 (the FLOPs of one of width 16), so a head
    split or a scale by sqrt(d_model) is wrong here too."""
    config = AttentionConfig(16, 2)
    params = make_params(config, seed=8)
    declared = backend.capabilities.causal_alignments
    alignment = "top-left" if "top-left" in declared or not declared else declared[0]  # Tq = Tk: the same mask
    inputs = _inputs(form, config, 1, seq, seed=8, one_x=one_x, causal=alignment if causal else None)
    rows = np.unique(np.concatenate([[0, 1, seq // 2, seq - 1], np.random.default_rng(8).integers(0, seq, 12)]))
    err = check_against_reference(backend, params, inputs, dtype, "long-sequence rows", rows=rows)
    return Measurement(max_error=err)


def _weight_variants(backend):
    caps = backend.capabilities
    out = [{"dtype": primary_dtype(backend), "masked": False}]
    if caps.key_padding_mask or caps.causal_alignments:
        out.append({"dtype": primary_dtype(backend), "masked": True})
    return out


@case(requires=("attention_weights",), variants=_weight_variants, forms=ALL_FORMS)
def check_attention_weights_match_reference(backend, *, form, dtype, masked):
    """Per-head weights (batch, heads, Tq, Tk) sum to 1 over keys, equal the reference, and masked keys
    have weight exactly 0."""
    config = AttentionConfig(32, 4, bias=backend.capabilities.bias)
    params = make_params(config, seed=6)
    masks = {}
    if masked:
        caps = backend.capabilities
        if caps.key_padding_mask:
            masks["key_padding_mask"] = np.arange(9)[None, :] >= np.array([9, 5])[:, None]
        if "top-left" in caps.causal_alignments:
            masks["causal"] = "top-left"
    inputs = form_inputs(form, config, 2, 9, seed=6, **masks)
    call = run(backend, params, inputs, dtype, need_weights=True)
    got = call.weights
    ref = reference_attention(params, inputs, need_weights=True).weights
    # the largest error of the same estimates as tolerance_for
    naive = farthest((n.weights for n in naive_forwards(params, inputs, dtype, need_weights=True)), ref)
    tol = tolerance_from(ref, naive, dtype, length=inputs.tk)
    labels = ("batch", "head", "query", "key")
    live = ref.sum(axis=-1, keepdims=True) > 0  # rows with at least one allowed key
    if masked:
        must_be_zero = (ref == 0) & live
        if np.any(got[must_be_zero] != 0):
            idx = tuple(int(i) for i in np.argwhere(must_be_zero & (got != 0))[0])
            raise CaseFailure(f"weights: masked entry at {dict(zip(labels, idx))} is {got[idx]:.3g}; "
                              "expected exactly 0").with_hint(polarity_hint(got, params, inputs, weights=True))
    sums = np.where(live[..., 0], got.sum(axis=-1), 1.0)
    assert_close(sums, np.ones_like(sums), tol, "weight row sums", labels=labels[:3])
    try:
        return Measurement(max_error=assert_close(np.where(live, got, 0), np.where(live, ref, 0), tol,
                                                  "attention weights", labels=labels))
    except CaseFailure as failure:  # the same call's output says which other scale or soft cap the weights have
        raise failure.with_hint(_scores_hint(call.output, params, inputs, dtype)) from None


def _scores_hint(output, params, inputs, dtype: str) -> str:
    """The other score scale or soft cap the output of a call whose weights failed matches (:func:`scale_hint`,
    :func:`scores_hint`, at the output's own tolerance), or ""."""
    if output is None:
        return ""
    got = np.asarray(output, np.float64)
    bound = tolerance_for(params, inputs, dtype)[1].bound
    return scale_hint(got, params, inputs, bound) or scores_hint(got, params, inputs, bound)


@case(requires=("non_causal",), variants=lambda b: [{"dtype": d} for d in b.capabilities.dtypes],
      forms=ALL_FORMS)
def check_lesson_worked_example_head_weights(backend, *, dtype):
    """The lesson's worked example (default_rng(7), T=4, d_model=8, h=2, weights * 0.5) gives the printed
    head weights to the printed two decimals (unless it declares soft-capped scores or a score scale of its own),
    and the reference output.
    Where the backend returns weights both come from one ``need_weights=True`` call (one compiled program per
    dtype); the grid checks ``need_weights=False``."""
    from mha_harness.cases.golden import LESSON_HEAD_WEIGHTS, lesson_example
    params, inputs = lesson_example()
    got = None
    if backend.capabilities.attention_weights:
        # one call gives both the weights and the output compared below: one compiled program per dtype, not two
        got = run(backend, params, inputs, dtype, need_weights=True)
        weights = got.weights[0]
        err = float(np.max(np.abs(weights - LESSON_HEAD_WEIGHTS)))
        # the printed weights are the lesson's uncapped scores scaled by 1/sqrt(d_head): a declared soft cap or
        # score scale is held to the reference alone
        printed = 0.005 + 0.5e-2 * (dtype in ("float16", "bfloat16"))
        as_printed = backend.capabilities.logit_softcap is None and backend.capabilities.score_scale is None
        if as_printed and not err <= printed:
            h, r, c = np.unravel_index(int(np.argmax(np.abs(weights - LESSON_HEAD_WEIGHTS))), weights.shape)
            raise CaseFailure(f"lesson example: head {h} weight [{r}, {c}] printed {LESSON_HEAD_WEIGHTS[h, r, c]:.2f}, "
                              f"got {weights[h, r, c]:.4f}", max_error=err).with_hint(
                                  _scores_hint(got.output, params, inputs, dtype))
    return Measurement(max_error=check_against_reference(backend, params, inputs, dtype, "lesson example output",
                                                         got=None if got is None else got.output))
