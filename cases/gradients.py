"""Gradients (vector-Jacobian products) against the reference's exact gradients."""
from __future__ import annotations

import functools

import numpy as np

from mha_harness.cases._fixtures import (
    ALL_FORMS,
    CAUSAL_SQUARE,
    KEYS_ACROSS_BLOCKS,
    additive_mask_from,
    cross_ok,
    form_inputs,
    random_allowed_mask,
)
from mha_harness.conformance.casekit import (
    CaseFailure,
    Measurement,
    assert_gradients_match_reference,
    case,
    forward_also_wrong,
    require,
)
from mha_harness.conformance.gradient_diagnoses import DOUBLE_WHERE_TRAP
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.conventions import COMMON_ROTARY_SCALINGS
from mha_harness.contract.params import make_params
from mha_harness.contract.reference import empty_rows_convention, uniform_row_scores_as

#: the keys of every variant but one_x's: 65 crosses the 16-, 32- and 64-key blocks of a tiled (FlashAttention)
#: backward, whose per-block recomputation and accumulation one block of keys would never exercise
GRADIENT_KEYS = KEYS_ACROSS_BLOCKS


def _gradient_variants(backend):
    caps = backend.capabilities
    out = []
    for dtype in caps.dtypes:  # an always-causal layer runs every variant causal: its parameters say so
        out.append({"dtype": dtype, "causal": caps.always_causal, "bias": caps.bias, "kv_heads": 4})
    if caps.causal_alignments and not caps.always_causal:
        out.append({"dtype": out[0]["dtype"] if "float32" not in caps.dtypes else "float32", "causal": True,
                    "bias": False, "kv_heads": 4})
    if caps.grouped_query:
        out.append({"dtype": "float32" if "float32" in caps.dtypes else caps.dtypes[0], "causal": caps.always_causal,
                    "bias": False, "kv_heads": 2})
    if caps.inputs == "separate":  # it accepts one x too (the grid and search call it so)
        out.append({"dtype": out[0]["dtype"], "causal": caps.always_causal, "bias": caps.bias, "kv_heads": 4,
                    "one_x": True})
    # a backward that drops a mask the forward applies: padding and the attn_mask kind declared (additive first),
    # together in one call (one more compiled program per backend, not two)
    attn_mask = next((k for k in ("additive_attn_mask", "bool_attn_mask") if getattr(caps, k)), None)
    masks = [k for k in ("key_padding_mask" if caps.key_padding_mask else None, attn_mask) if k]
    if masks:
        masked = {"dtype": "float32" if "float32" in caps.dtypes else caps.dtypes[0],
                  "causal": caps.always_causal, "bias": caps.bias, "kv_heads": 4, "mask": "+".join(masks)}
        out.append(masked)
        # the same call with rows that see no key: one query row whose attn_mask masks every key, or, for a layer
        # with padding alone (BERT's), batch item 1 with every key padded; nothing but b_o's share flows back there
        # (the double-where trap, a log-sum-exp of -inf, give NaN); same shapes and mask kinds, no new program
        out.append({**masked, "empty_row": True})
    # the layer features' variants, each in float32 where declared
    feature = {"dtype": "float32" if "float32" in caps.dtypes else caps.dtypes[0], "causal": caps.always_causal,
               "bias": caps.bias}
    # a layer with a norm on q and k: the backward through each norm it declares, to the projections and the gains
    for norm in caps.qk_norms:
        out.append({**feature, "kv_heads": 4, "qk_norm": norm})
    # a layer with rotary embeddings: the backward turns each gradient of q and k back, at the call's positions
    # (Tq != Tk where declared: the queries are the last positions), with grouped-query heads where declared
    turned = {**feature, "kv_heads": 2 if caps.grouped_query else 4}
    for kind in caps.rotary:
        out.append({**turned, "rotary": kind})
    # a partial rotary (declared): half of each head's 8 features turned, the other half passed back unturned
    if caps.rotary and caps.partial_rotary:
        out.append({**turned, "rotary": caps.rotary[0], "rotary_dims": 4})
    # a rescaling (the first declared): the same backward, by the rescaled frequencies
    if caps.rotary and caps.rotary_scalings:
        out.append({**turned, "rotary": caps.rotary[0], "rotary_scaling": caps.rotary_scalings[0]})
    # a sliding window (declared): causal over 65 positions, a window of 16 keys, so a backward that recomputes its
    # softmax without the window gives keys behind it a gradient
    if caps.sliding_window and caps.causal_alignments:
        out.append({**feature, "causal": True, "kv_heads": 2 if caps.grouped_query else 4,
                    "sliding_window": GRADIENT_WINDOW})
    # ALiBi (each kind declared): the backward through the biased scores, Tq != Tk where declared (the queries at
    # the last positions), grouped-query heads where declared (the slopes are the query heads')
    for kind in caps.alibi:
        out.append({**turned, "alibi": kind})
    return out


#: the window of the gradient case's sliding-window variant
GRADIENT_WINDOW = 16


#: real keys of batch item 1 in the padding variant (item 0 has all 65): the padded ones start inside a key block
PADDED_ITEM_KEYS = 17
#: the query row whose attn_mask masks every key in the ``empty_row`` variant (a real query in every item)
EMPTY_ROW = 3


def _mask(kinds: str | None, batch: int, tq: int, tk: int, empty_row: bool = False) -> dict:
    """The variant's masks as AttentionInputs fields, for each kind in ``kinds`` ('+'-joined): item 1 padded after
    PADDED_ITEM_KEYS keys; a random attn_mask (every row keeps key 0, so padding never empties a row; bool, or
    finite biases with -inf where masked), except row EMPTY_ROW with ``empty_row``, which it masks whole; with
    ``empty_row`` and padding alone, item 1 has every key padded."""
    fields = {}
    kinds = (kinds or "").split("+")
    for kind in kinds:
        if kind == "key_padding_mask":
            real = 0 if empty_row and kinds == ["key_padding_mask"] else PADDED_ITEM_KEYS
            fields[kind] = np.arange(tk)[None, :] >= np.array([tk, real][:batch])[:, None]
        elif kind in ("bool_attn_mask", "additive_attn_mask"):
            allowed = random_allowed_mask(tq, tk, seed=23)
            allowed[:, 0] = True
            if empty_row:
                allowed[EMPTY_ROW] = False
            fields["attn_mask"] = allowed if kind == "bool_attn_mask" else additive_mask_from(allowed, seed=24)
    return fields


@case(requires=("gradients",), variants=_gradient_variants, forms=ALL_FORMS)
def check_gradients_match_reference(backend, *, form, dtype, causal, bias, kv_heads, one_x=False, mask=None,
                                    empty_row=False, qk_norm=None, rotary=None, rotary_dims=None,
                                    rotary_scaling=None, sliding_window=None, alibi=None):
    """Gradients of sum(output * cotangent) with respect to query, key, value and every parameter equal the
    reference's, within the tolerance rule applied to the naive backward in the same dtype. The input gradients
    follow the backend's declared form: one x (``inputs='self'``) gives d/dx, the sum over its three uses; shared
    K/V gives d/dx_kv, the sum of the key and value parts; a KV-cache step (``inputs='kv_cache'``) gives d/dx_new,
    the sum over its three uses, and d/dx_cached (``key``, absent when nothing is cached); a separate-form backend
    gives d/dquery, d/dkey and d/dvalue, also when it is called with one x (``one_x``, as the grid and search call
    it). With ``mask`` (padding and the attn_mask kind declared, in one call) the backward applies them as the
    forward does: padded and masked keys get exactly the reference's gradient (zero where nothing reaches them);
    the cotangent is zero at padded query positions (Tq = Tk), whose outputs are unspecified. With ``empty_row`` the
    attn_mask also masks every key of query row EMPTY_ROW (a layer with padding and no attn_mask: batch item 1 has
    every key padded), whose output is zeros before W_o (b_o): nothing flows back through it but b_o's share, and
    no gradient is NaN (a layer whose empty rows output the uniform average of
    V or NaN declares it, and the declaration covers this variant). With ``qk_norm`` (a norm the layer declares in
    ``Capabilities.qk_norms``) the gradients reach the projections through that norm, and its gains ``g_q`` and
    ``g_k`` have gradients of their own. With ``rotary`` (declared in ``Capabilities.rotary``; base 500,000) the
    gradients of q and k are turned back at their positions (with ``rotary_dims``, a partial rotary declared in
    ``Capabilities.partial_rotary``: only those of each head's first features; with ``rotary_scaling``, the first
    kind declared in ``Capabilities.rotary_scalings``: by the rescaled frequencies). With ``sliding_window`` (declared
    in ``Capabilities.sliding_window``) the keys behind each query's window get exactly the reference's gradient.
    With ``alibi`` (a kind declared in ``Capabilities.alibi``) the gradients flow through the scores biased by
    distance, the queries at the last Tq of the Tk positions."""
    config = AttentionConfig(32, 4, None if kv_heads == 4 else kv_heads, bias=bias, qk_norm=qk_norm, rotary=rotary,
                             rotary_base=500_000.0, rotary_dims=rotary_dims,
                             rotary_scaling=rotary_scaling and COMMON_ROTARY_SCALINGS[rotary_scaling],
                             sliding_window=sliding_window, alibi=alibi)
    params = make_params(config, seed=21)
    form = "self" if one_x else form
    # Tq != Tk where declared; the causal variant of a layer whose mask is optional is square, while an
    # always-causal layer, all of whose variants are causal, keeps Tq != Tk
    cross = cross_ok(backend) and (not causal or backend.capabilities.always_causal) and not one_x
    # the square causal variant has the causal cases' square shape: a backend compiling per shape shares the
    # program with check_causal_jacobian_zero_for_future_inputs
    # 65 keys in every variant but one_x's (7 x 7, the grid's and search's one-x call), queries 7 where Tq != Tk is
    # declared
    tq = CAUSAL_SQUARE if causal and not cross else 7 if cross or one_x else GRADIENT_KEYS
    tk = GRADIENT_KEYS if cross else tq
    inputs = form_inputs(form, config, 2, tq, tk, seed=21,
                         causal=(backend.capabilities.causal_alignments[0] if causal else None),
                         **_mask(mask, 2, tq, tk, empty_row))
    require(backend, *inputs.features(), f"dtype:{dtype}")
    cotangent = np.random.default_rng(22).standard_normal((2, tq, 32))
    if inputs.key_padding_mask is not None and tq == tk:
        cotangent[inputs.key_padding_mask] = 0.0
    loaded = backend.load(params, dtype=dtype)
    got = loaded.vjp(inputs, cotangent)
    declared = backend.capabilities.inputs  # the gradients come per argument of the module's own call
    # a failure names what the backward got wrong (harness/conformance/gradient_diagnoses.py), or that the call's
    # forward is wrong too (run on a failure only)
    forward = functools.cache(lambda: loaded.forward(inputs).output)  # on a failure only, and then once
    # the strict run of a backend that declares another empty-row output fails, and its declaration is verified
    # next: no diagnosis (its forward call would compile one more program per JAX backend for nothing)
    diagnose = not (empty_row and empty_rows_convention() == "zeros" and _declares_empty_rows(backend))
    try:
        worst = assert_gradients_match_reference(got, params, inputs, cotangent, dtype, declared, forward=forward,
                                                 diagnose=diagnose)
    except CaseFailure as failure:
        if not empty_row or not diagnose:
            raise
        if empty_rows_convention() == "uniform_average":
            # uniform weights from a finite additive minimum: the scores are shifted, not replaced, and the backward
            # still differentiates them (the reference first holds them constant, as a where does)
            with uniform_row_scores_as("shifted"):
                try:
                    worst = assert_gradients_match_reference(got, params, inputs, cotangent, dtype, declared)
                    return Measurement(max_error=worst, observed=SHIFTED_SCORES)
                except CaseFailure:
                    pass
        raise failure.with_hint(*_empty_row_hint(got, forward, params, inputs, dtype, cotangent)) from None
    return Measurement(max_error=worst)


#: what the ``empty_row`` variant observed when the uniform-average backward differentiates the row's scores
SHIFTED_SCORES = "uniform average of V, the scores shifted by a finite minimum (still differentiated)"


def _declares_empty_rows(backend) -> bool:
    """Whether the backend declares a ``fully_masked_rows`` divergence that covers the ``empty_row`` variant."""
    return any(d.behaviour.startswith("fully_masked_rows:")
               and d.matches("check_gradients_match_reference", {"empty_row": True})
               for d in getattr(backend, "divergences", ()) or ())


def _empty_row_hint(got: dict, forward, params, inputs, dtype: str, cotangent: np.ndarray) -> tuple[str, str]:
    """(message suffix, diagnosis or "") for a failed backward of the ``empty_row`` variant, about its row without a
    key: nothing when the same call's forward is wrong on other rows too (the failure says so: the row is not the
    point); NaN gradients with the forward finite there are the backward's own (the double-where trap, a
    diagnosis); otherwise what the reference expects through that row, and which declaration covers another
    convention."""
    empty = _rows_without_keys(inputs)
    others = cotangent.copy()
    others[empty] = 0.0  # the rows the forward is compared on: every weighed one but the empty ones
    if forward_also_wrong(forward, params, inputs, dtype, others):
        return "", ""
    try:
        output = np.asarray(forward(), np.float64)
    except Exception:  # noqa: BLE001 - a diagnosis only: the failure is reported as it is
        return "", ""
    row = (f"query row {EMPTY_ROW} sees no key (the attn_mask masks every key there)" if inputs.attn_mask is not None
           else "batch item 1 has every key padded, so none of its queries sees a key (key_padding_mask all True)")
    if not all(np.all(np.isfinite(np.asarray(g, np.float64))) for g in got.values()):
        if np.all(np.isfinite(output[empty])):
            hint = f"{row} and the forward's output there is finite: the NaN is the backward's own. {DOUBLE_WHERE_TRAP}"
            return f"; {hint}", hint
        return (f"; {row} and the forward's output there is not finite: NaN there spreads through the backward into "
                "every gradient; if that is the layer's convention, nan_fully_masked_divergences covers this variant "
                "too" + ("" if empty_rows_convention() == "zeros" else " (it is declared: the backward is NaN "
                         "where the reference's is not)"), "")
    if empty_rows_convention() == "uniform_average":
        through = ("the uniform average of V there (declared), nothing flows back to that row's scores where a "
                   "where or masked_fill replaces them, and the softmax's backward at uniform weights reaches them "
                   "where a finite minimum is added to them; the backward matches neither")
    else:
        through = ("zeros there (the output is b_o), nothing flows back through that row but b_o's share; a layer "
                   "whose empty rows output the uniform average of V (a finite mask value) declares "
                   "uniform_fully_masked_divergences, which covers this variant too")
    return (f"; {row}: with {through}; the variant without the empty row (the same mask, empty_row absent) says "
            "whether the rest of the backward is right"), ""


def _rows_without_keys(inputs) -> np.ndarray:
    """(batch, Tq) True at the ``empty_row`` variant's rows that see no key: row EMPTY_ROW where an attn_mask
    empties it, else every row of the fully padded item."""
    empty = np.zeros((inputs.batch, inputs.tq), bool)
    if inputs.attn_mask is not None:
        empty[:, EMPTY_ROW] = True
    else:
        empty[np.asarray(inputs.key_padding_mask, bool).all(axis=-1)] = True
    return empty

