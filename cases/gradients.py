"""Gradients (vector-Jacobian products) against the reference's exact gradients."""
from __future__ import annotations

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
    Measurement,
    assert_gradients_match_reference,
    case,
    require,
)
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_params

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
        out.append({"dtype": "float32" if "float32" in caps.dtypes else caps.dtypes[0],
                    "causal": caps.always_causal, "bias": caps.bias, "kv_heads": 4, "mask": "+".join(masks)})
    return out


#: real keys of batch item 1 in the padding variant (item 0 has all 65): the padded ones start inside a key block
PADDED_ITEM_KEYS = 17


def _mask(kinds: str | None, batch: int, tq: int, tk: int) -> dict:
    """The variant's masks as AttentionInputs fields, for each kind in ``kinds`` ('+'-joined): item 1 padded after
    PADDED_ITEM_KEYS keys; a random attn_mask (every row keeps key 0, so padding never empties a row; bool, or
    finite biases with -inf where masked)."""
    fields = {}
    for kind in (kinds or "").split("+"):
        if kind == "key_padding_mask":
            fields[kind] = np.arange(tk)[None, :] >= np.array([tk, PADDED_ITEM_KEYS][:batch])[:, None]
        elif kind in ("bool_attn_mask", "additive_attn_mask"):
            allowed = random_allowed_mask(tq, tk, seed=23)
            allowed[:, 0] = True
            fields["attn_mask"] = allowed if kind == "bool_attn_mask" else additive_mask_from(allowed, seed=24)
    return fields


@case(requires=("gradients",), variants=_gradient_variants, forms=ALL_FORMS)
def check_gradients_match_reference(backend, *, form, dtype, causal, bias, kv_heads, one_x=False, mask=None):
    """Gradients of sum(output * cotangent) with respect to query, key, value and every parameter equal the
    reference's, within the tolerance rule applied to the naive backward in the same dtype. The input gradients
    follow the backend's declared form: one x (``inputs='self'``) gives d/dx, the sum over its three uses; shared
    K/V gives d/dx_kv, the sum of the key and value parts; a KV-cache step (``inputs='kv_cache'``) gives d/dx_new,
    the sum over its three uses, and d/dx_cached (``key``, absent when nothing is cached); a separate-form backend
    gives d/dquery, d/dkey and d/dvalue, also when it is called with one x (``one_x``, as the grid and search call
    it). With ``mask`` (padding and the attn_mask kind declared, in one call) the backward applies them as the
    forward does: padded and masked keys get exactly the reference's gradient (zero where nothing reaches them);
    the cotangent is zero at padded query positions (Tq = Tk), whose outputs are unspecified."""
    config = AttentionConfig(32, 4, None if kv_heads == 4 else kv_heads, bias=bias)
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
                         **_mask(mask, 2, tq, tk))
    require(backend, *inputs.features(), f"dtype:{dtype}")
    cotangent = np.random.default_rng(22).standard_normal((2, tq, 32))
    if inputs.key_padding_mask is not None and tq == tk:
        cotangent[inputs.key_padding_mask] = 0.0
    loaded = backend.load(params, dtype=dtype)
    got = loaded.vjp(inputs, cotangent)
    declared = backend.capabilities.inputs  # the gradients come per argument of the module's own call
    # a failure names what the backward got wrong (harness/conformance/gradient_diagnoses.py), or that the call's
    # forward is wrong too (run on a failure only)
    worst = assert_gradients_match_reference(got, params, inputs, cotangent, dtype, declared,
                                             forward=lambda: loaded.forward(inputs).output)
    return Measurement(max_error=worst)

