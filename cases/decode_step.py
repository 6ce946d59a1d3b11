"""A decode step over a filled KV cache (``LoadedAttention.prepare_decode_step``) computes the layer's output."""
from __future__ import annotations

from mha_harness.cases._fixtures import KEYS_ACROSS_BLOCKS, small_layer
from mha_harness.conformance.casekit import Measurement, assert_decode_step_close, case, primary_dtype, require
from mha_harness.contract.api import as_kv_cache_call
from mha_harness.contract.conventions import BOTTOM_RIGHT, RotaryScaling
from mha_harness.contract.params import make_inputs

#: name: (new queries Tq, key/value heads or None, biases, cached positions): one query (the token-by-token step)
#: and a few (a speculative or chunked step, where the bottom-right causal mask matters), grouped-query heads where
#: declared, over a cache filled across a tiled kernel's blocks; and a prompt's five tokens into an empty cache (a
#: generate loop's first call: nothing cached, Tq = Tk)
STEPS = {"one_new_query": (1, None, False, KEYS_ACROSS_BLOCKS - 1),
         "five_new_queries": (5, 2, True, KEYS_ACROSS_BLOCKS - 5),
         "prompt_into_empty_cache": (5, None, False, 0)}
#: the sliding-window step's window (Capabilities.sliding_window): 16 keys, against ROTARY_STEP's 65 positions (60
#: cached), so most of the cache is behind every new query's window
WINDOW_STEP = 16
#: the rotary step: a layer with rotary embeddings (each kind it declares, at Llama 3's base) writes its new keys
#: turned at their own positions and turns its queries at theirs, Tk - Tq .. Tk - 1, not from 0
ROTARY_STEP = (5, 2, True, KEYS_ACROSS_BLOCKS - 5, 500_000.0)
#: the decode step's rescaling of a kind where it is not the grid's (COMMON_ROTARY_SCALINGS'): gpt-oss's YaRN (factor
#: 32 over 4,096 positions, its ramp's ends not rounded: "truncate": false), so that a layer which ignores
#: ``truncate`` fails either this or the grid's Qwen 2.5 row (an outside user's wrapper that dropped it passed both
#: Qwen rows)
STEP_SCALINGS = {"yarn": RotaryScaling("yarn", 32.0, original_max_positions=4096, truncate=False)}


def _step_variants(backend):
    caps = backend.capabilities
    if BOTTOM_RIGHT not in caps.causal_alignments:
        if caps.always_causal:
            return [{"unsupported": "declares no bottom-right causal mask: a decode step's new queries are the last "
                                    "positions of the cache"}]
        # one new query sees every cached key: no causal mask is needed, and none is passed (as bench's decode
        # workload calls such a step); a few new queries need the bottom-right mask the backend does not declare
        tq, _, bias, cached = STEPS["one_new_query"]
        return [{"dtype": primary_dtype(backend), "variant": "one_new_query", "tq": tq, "tk": tq + cached,
                 "bias": bias, "causal": False}]
    out = []
    for name, (tq, kv_heads, bias, cached) in STEPS.items():
        v = {"dtype": primary_dtype(backend), "variant": name, "tq": tq, "tk": tq + cached, "bias": bias and caps.bias}
        if kv_heads and caps.grouped_query:
            v["kv_heads"] = kv_heads
        out.append(v)
    tq, kv_heads, bias, cached, base = ROTARY_STEP
    # each pairing declared; then, in the first, a partial rotary (4 of each head's 8 features) and each rescaling
    # declared, where the cache path turns with the layer's width and frequencies too
    rotary_steps = [(f"rotary_{kind}", {"rotary": kind}) for kind in caps.rotary]
    if caps.rotary and caps.partial_rotary:
        rotary_steps.append(("rotary_partial", {"rotary": caps.rotary[0], "rotary_dims": 4}))
    rotary_steps += [(f"rotary_scaled_{kind}", {"rotary": caps.rotary[0], "rotary_scaling": kind})
                     for kind in (caps.rotary_scalings if caps.rotary else ())]
    if caps.sliding_window:  # a window shorter than the cache: the step must count it back from its positions
        out.append({"dtype": primary_dtype(backend), "variant": "sliding_window", "tq": tq, "tk": tq + cached,
                    "bias": bias and caps.bias, "sliding_window": WINDOW_STEP}
                   | ({"kv_heads": kv_heads} if caps.grouped_query else {}))
    for name, rotary in rotary_steps:
        v = {"dtype": primary_dtype(backend), "variant": name, "tq": tq, "tk": tq + cached,
             "bias": bias and caps.bias, "rotary_base": base, **rotary}
        out.append(v | ({"kv_heads": kv_heads} if caps.grouped_query else {}))
    return out


@case(variants=_step_variants, forms=("separate", "shared_kv", "kv_cache"))
def check_decode_step_over_filled_cache_matches_reference(backend, *, dtype, variant, tq, tk, bias, kv_heads=None,
                                                          rotary=None, rotary_base=10_000.0, rotary_dims=None,
                                                          rotary_scaling=None, sliding_window=None, causal=True):
    """A decode step whose cache was filled from the first Tk - Tq positions (65 keys in all, across a tiled
    kernel's blocks; or none, a prompt into an empty cache) returns, on its first and on its second call, the
    output the float64 reference gives for the whole KV-cache call: the step writes x_new's keys and values into
    the cache before its queries attend, and every call attends over the same Tk positions. Skips for a backend
    without a decode step. A layer with rotary embeddings (each kind it declares) turns the cached keys, the new keys
    and the new queries at their own positions, with a partial rotary's width and a rescaling where declared; a layer
    with a sliding window (where declared) counts it back from each new query's position, hiding most of the cache.
    YaRN's step is gpt-oss's (:data:`STEP_SCALINGS`), the grid's Qwen 2.5's. A backend that declares no bottom-right
    causal mask (a layer whose own mask is top-left, with a KV-cache path beside it) runs the one-query step only,
    without a causal mask (``causal`` False): one new query sees every cached key, the same attention."""
    params = small_layer(backend, bias=bias, num_kv_heads=kv_heads, seed=tq, rotary=rotary, rotary_base=rotary_base,
                         rotary_dims=rotary_dims, rotary_scaling=STEP_SCALINGS.get(rotary_scaling, rotary_scaling),
                         sliding_window=sliding_window)
    inputs = as_kv_cache_call(make_inputs(params.config, 2, tq, tk, seed=tq, causal=BOTTOM_RIGHT if causal else None))
    require(backend, *inputs.features(), f"dtype:{dtype}")
    first, second = backend.load(params, dtype=dtype).decode_step(inputs)
    return Measurement(max_error=assert_decode_step_close(backend, params, inputs, dtype, first, second))
