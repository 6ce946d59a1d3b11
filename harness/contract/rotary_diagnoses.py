"""Known mistakes of rotary position embeddings (``AttentionConfig.rotary``), computed by the reference, so a failed
comparison can name the one its output matches: the other pairing of features (GPT-J's interleaved pairs where
Hugging Face's rotate_half pairs i with i + d_head/2, or the other way round), another common base, only one of q
and k turned, W_q's or W_k's columns alone permuted between the pairings, the queries of a call with fewer queries
than keys turned from position 0 (with their own keys, or alone), the keys turned one position later or earlier
than the queries, q and k turned before the q/k norm, the wrong
width (a partial rotary's whole head turned, its frequencies over d_head, or a common fraction of each head turned
where the config turns all of it), the frequencies' rescaling (Llama 3.1's rope_type "llama3", a linear one) left
out, another in its place or one kept where the config has none, or no rotary at all; and, for a layer run without
rotary, that its output matches q and k turned anyway (a wrapped Llama-style module given positions 0 .. T - 1 where
the harness's layer has none)."""
from __future__ import annotations

import dataclasses

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.conventions import COMMON_ROTARY_BASES, COMMON_ROTARY_SCALINGS, ROTARY_KINDS, rotary_pairs
from mha_harness.contract.mistakes import closest_mistake
from mha_harness.contract.reference import reference_attention, rotary_mistaken

#: every rotary diagnosis says so (a failure with one drops its guess of a precision from the error's size)
ROTARY_MATCH = "rotary embeddings"
#: what each pairing is, for the failure messages
_PAIRS = {"half_split": "features i and i + d_head/2 (Hugging Face's rotate_half, GPT-NeoX)",
          "interleaved": "features 2i and 2i + 1 (GPT-J, Meta's Llama code with complex numbers)"}
#: what each mistake the reference can make (:func:`~mha_harness.contract.reference.rotary_mistaken`) is
_MISTAKEN = {
    "q_only": "rotary embeddings applied to q only: k is not turned",
    "k_only": "rotary embeddings applied to k only: q is not turned",
    "queries_from_zero": ("the queries' rotary embeddings turned at positions 0 .. Tq - 1 where they are the last "
                          "Tq of the Tk positions, Tk - Tq .. Tk - 1 (a KV-cache step's position_ids not offset by "
                          "the cache length; key j is at position j)"),
    "new_tokens_from_zero": ("the new tokens' rotary embeddings, the queries' and their own keys' (the last Tq of "
                             "the Tk), turned at positions 0 .. Tq - 1 where they are Tk - Tq .. Tk - 1, the cached "
                             "keys at theirs (a KV-cache step given position_ids = arange(Tq): Hugging Face turns q "
                             "and the new k with one cos/sin; offset the positions by the cache length)"),
    "keys_one_later": ("the keys' rotary embeddings turned one position later than the queries' (key j at j + 1 "
                       "where query i is at i + Tk - Tq; a rotary depends only on the two positions' difference, so "
                       "the queries one earlier is the same: an off-by-one in position_ids, a cache length or an "
                       "arange that starts at 1)"),
    "keys_one_earlier": ("the keys' rotary embeddings turned one position earlier than the queries' (key j at j - 1 "
                         "where query i is at i + Tk - Tq; a rotary depends only on the two positions' difference, "
                         "so the queries one later is the same: an off-by-one in position_ids, a cache length "
                         "counted with the new tokens, or the queries' positions starting at 1)"),
    "before_norm": ("q and k turned by their rotary embeddings before their q/k norm where they are normed first, "
                    "then turned (Qwen 3)"),
    "frequencies_over_head": ("a partial rotary's frequencies over all d_head features, base ** (-2i / d_head), "
                              "where they are over the rotary_dims features it turns, base ** (-2i / rotary_dims) "
                              "(an inv_freq built from head_dim: build it from the rotary's width)"),
}
#: the widths a partial rotary commonly has, as fractions of d_head (GPT-NeoX's and StableLM's rotary_pct 0.25,
#: Phi-2's partial_rotary_factor 0.4, ChatGLM's and Phi-3-small's 0.5)
COMMON_PARTIAL_FRACTIONS = (0.25, 0.4, 0.5)


def _candidates(params: AttentionParams, inputs: AttentionInputs):
    """(label, wrong parameters, the reference's mistake or None) for each rotary mistake of this layer."""
    c = params.config
    if c.rotary is None:
        if c.d_head % 2:
            return
        for kind in ROTARY_KINDS:
            for base in COMMON_ROTARY_BASES:
                turned = dataclasses.replace(c, rotary=kind, rotary_base=base)
                yield (f"; the output matches rotary embeddings ({kind!r}, base {base:g}) in a layer built without "
                       "them: give every token, cached and new, one and the same position (a Llama-style module "
                       "then checks everything but positions; \"A layer with rotary position embeddings\" in "
                       f"docs/plugins.md), or declare Capabilities(rotary=({kind!r},)) and build the layer's "
                       "rotary from config.rotary and config.rotary_base", params.replace(config=turned), None)
        return
    other = next(k for k in ROTARY_KINDS if k != c.rotary)
    yield (f"; the output matches rotary embeddings that pair {_PAIRS[other]} where config.rotary {c.rotary!r} pairs "
           f"{_PAIRS[c.rotary]} (Meta's Llama weights in a rotate_half layer need transformers' permutation of W_q "
           "and W_k's rows within each head)", params.replace(config=dataclasses.replace(c, rotary=other)), None)
    for which in ("q", "k"):  # one side's weight permuted between the two pairings (the same sentence either way)
        for inverse in (False, True):
            weight, bias = getattr(params, f"W_{which}"), getattr(params, f"b_{which}")
            order = pairing_permutation(c, inverse)[:weight.shape[1]]  # k's heads are q's first kv_heads
            yield ("; the output matches W_q's and W_k's columns in different orders within each head: one of them "
                   "(with its bias) permuted between the two pairings ([0, 2, 4, ..., 1, 3, 5, ...] per head, as "
                   "transformers' convert_llama_weights_to_hf permutes Meta's weights for rotate_half) and the other "
                   "not: permute W_q and W_k both, or neither",
                   params.replace(**{f"W_{which}": weight[:, order],
                                     f"b_{which}": None if bias is None else bias[order]}), None)
    for base in COMMON_ROTARY_BASES:
        if base != c.rotary_base:
            yield (f"; the output matches rotary embeddings built with base {base:g} where config.rotary_base is "
                   f"{c.rotary_base:g} (build them from config.rotary_base: rope_theta not passed on)",
                   params.replace(config=dataclasses.replace(c, rotary_base=base)), None)
    yield from _width_candidates(params)
    yield from _scaling_candidates(params)
    for mistake, label in _MISTAKEN.items():
        if mistake in ("queries_from_zero", "new_tokens_from_zero") and inputs.tq >= inputs.tk:
            continue  # the same positions (or no new keys of their own)
        if mistake == "before_norm" and c.qk_norm is None:
            continue
        if mistake == "frequencies_over_head" and not c.partial_rotary:
            continue  # the same frequencies
        yield "; the output matches " + label, params, mistake
    none_turned = (f"; or, at this d_head of {c.d_head}, a partial rotary whose fraction is fixed in the layer turns "
                   "no feature: build its width from config.rotary_dims") if _fixed_widths(c.d_head)[0] < 2 else ""
    yield ("; the output matches no rotary embeddings at all (q and k never turned: declare only the rotary the layer "
           f"applies{none_turned})", params.replace(config=dataclasses.replace(c, rotary=None, rotary_dims=None,
                                                                                 rotary_scaling=None)), None)


#: the factors rescaled rotary frequencies commonly have (Llama 3.1's 8, Llama 3.2's 32, position interpolations by
#: 4 or 16): a wrong one is tried in each kind
COMMON_SCALING_FACTORS = (4.0, 8.0, 16.0, 32.0)


def _scaling_candidates(params: AttentionParams):
    """The wrong rescalings of a rotary layer's frequencies: the config's left out, or another in its place (a
    common kind at a common factor or at the config's own: Llama 3.2's factor 32 where 3.1's 8 belongs, linear where
    llama3 does), or one kept in a layer whose config has none (a long-context model's rope_scaling)."""
    c, scaling = params.config, params.config.rotary_scaling
    if scaling is not None and scaling.kind == "yarn":  # the more specific first: where a call's frequencies are all
        yield from _yarn_candidates(params)             # kept, YaRN left out is its attention factor left out
    if scaling is not None:
        yield (f"; the output matches rotary embeddings whose frequencies lack the {scaling.kind!r} rescaling "
               f"config.rotary_scaling asks for ({_scaling_words(scaling)}: rope_scaling never reached the module; "
               "build it from config.rotary_scaling)",
               params.replace(config=dataclasses.replace(c, rotary_scaling=None)), None)
    factors = COMMON_SCALING_FACTORS if scaling is None else (scaling.factor, *COMMON_SCALING_FACTORS)
    for common in COMMON_ROTARY_SCALINGS.values():
        for factor in dict.fromkeys(factors):  # each kind at each distinct factor once
            wrong = dataclasses.replace(common, factor=float(factor))
            if wrong == scaling:
                continue
            yield (f"; the output matches rotary embeddings with frequencies rescaled as {_scaling_words(wrong)} "
                   f"where config.rotary_scaling is "
                   + ("None" if scaling is None else _scaling_words(scaling))
                   + " (a model's rope_scaling kept where the config has another: build it from "
                   "config.rotary_scaling, None meaning none, and declare the kinds in "
                   "Capabilities.rotary_scalings)",
                   params.replace(config=dataclasses.replace(c, rotary_scaling=wrong)), None)


def _yarn_candidates(params: AttentionParams):
    """The wrong YaRN layers: its frequencies rescaled without its attention factor (q and k not multiplied by it: a
    port of the frequencies alone; transformers multiplies cos and sin by ``attention_scaling``), and its ramp's ends
    rounded where the config does not round them (``truncate``: gpt-oss sets it false) or the other way round."""
    c, scaling = params.config, params.config.rotary_scaling
    if scaling.attention_scale != 1.0:
        yield (f"; the output matches YaRN's rescaled rotary embeddings without its attention factor (q and k not "
               f"multiplied by {scaling.attention_scale:.4g}"
               + (", 0.1 * ln(factor) + 1" if scaling.attention_factor is None else "")
               + ": transformers multiplies the rotary cos and sin by attention_scaling; apply it with the rotation)",
               params.replace(config=dataclasses.replace(
                   c, rotary_scaling=dataclasses.replace(scaling, attention_factor=1.0))), None)
    flipped = dataclasses.replace(scaling, truncate=not scaling.truncate)
    if flipped.yarn_ramp(c.rotary_width, c.rotary_base) != scaling.yarn_ramp(c.rotary_width, c.rotary_base):
        yield (f"; the output matches rotary embeddings with YaRN's ramp {'without' if scaling.truncate else 'with'} "
               f"its ends rounded to whole frequency indices where config.rotary_scaling.truncate is "
               f"{scaling.truncate} (rope_parameters' 'truncate': gpt-oss sets it false, transformers' default is "
               "true)",
               params.replace(config=dataclasses.replace(c, rotary_scaling=flipped)), None)


def _scaling_words(scaling) -> str:
    """A rescaling in words, as transformers' rope_parameters name it."""
    if scaling.kind == "linear":
        return f"rope_type 'linear', factor {scaling.factor:g}"
    if scaling.kind == "yarn":
        return (f"rope_type 'yarn', factor {scaling.factor:g}, original_max_position_embeddings "
                f"{scaling.original_max_positions}, beta_fast {scaling.beta_fast:g}, beta_slow {scaling.beta_slow:g}"
                + ("" if scaling.attention_factor is None else f", attention_factor {scaling.attention_factor:g}")
                + ("" if scaling.truncate else ", truncate false"))
    return (f"rope_type 'llama3', factor {scaling.factor:g}, low_freq_factor {scaling.low_freq_factor:g}, "
            f"high_freq_factor {scaling.high_freq_factor:g}, original_max_position_embeddings "
            f"{scaling.original_max_positions}")


def _fixed_widths(d_head: int) -> list[int]:
    """The widths a partial rotary with a common fraction fixed in the layer turns at ``d_head``, as transformers
    computes them (``int(d_head * fraction)``)."""
    return sorted({int(f * d_head + 1e-9) for f in COMMON_PARTIAL_FRACTIONS})


def _width_candidates(params: AttentionParams):
    """The wrong widths of a rotary layer's turn: a partial rotary's ``rotary_dims`` ignored (every feature turned),
    or a layer that always turns a common fraction of each head whatever the config's width (all of it, or another)."""
    c = params.config
    if c.partial_rotary:
        yield (f"; the output matches rotary embeddings that turn every feature of each head where config.rotary_dims "
               f"= {c.rotary_dims} turns only the first {c.rotary_dims} of its {c.d_head} (a partial rotary's width "
               "never passed on: build it from config.rotary_dims; GPT-NeoX's rotary_pct, Phi's "
               "partial_rotary_factor)", params.replace(config=dataclasses.replace(c, rotary_dims=None)), None)
    asks = "turns them all" if c.rotary_dims is None else f"turns the first {c.rotary_dims}"
    for width in _fixed_widths(c.d_head):
        if width < 2 or width % 2 or width >= c.d_head or width == c.rotary_width:
            continue
        yield (f"; the output matches rotary embeddings on the first {width} of each head's {c.d_head} features "
               f"only, where config.rotary_dims = {c.rotary_dims} {asks} (a partial rotary's fraction fixed in the "
               "layer, as GPT-NeoX's rotary_pct and Phi's partial_rotary_factor fix it when the module is not built "
               "from the config: build the layer's width from config.rotary_dims, None meaning all d_head, and "
               "declare Capabilities(partial_rotary=True))",
               params.replace(config=dataclasses.replace(c, rotary_dims=width)), None)


def pairing_permutation(config, inverse: bool = False) -> np.ndarray:
    """The column order, within each head of q's (or k's) projection, that turns Meta's interleaved pairs (2i, 2i +
    1) into rotate_half's (i, i + d_head/2): [0, 2, 4, ..., 1, 3, 5, ...] per head (transformers'
    convert_llama_weights_to_hf), or its inverse; over all num_heads * d_head columns (q's width; k's is a prefix)."""
    d, width = config.d_head, config.rotary_width
    # each interleaved pair's first features, then seconds; a partial rotary's unturned features stay where they are
    within = np.concatenate([*rotary_pairs("interleaved", width), np.arange(width, d)])
    order = (np.arange(config.num_heads)[:, None] * d + within[None, :]).reshape(-1)
    return np.argsort(order) if inverse else order


def rotary_match(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                 compare: np.ndarray | None = None, rows: list[int] | None = None) -> tuple[str, float] | None:
    """The rotary mistake a failing whole output ``got`` matches within ``diagnosis_margin(bound)`` and explains better
    than the correct layer (:func:`~mha_harness.contract.mistakes.explains`), the closest of those that match, as
    (sentence to append, its distance from ``got``); None when none matches. Mistakes that give this call the same
    output (one new query and one cached key: the new tokens turned from 0 is no rotary at all) are named together,
    the more specific first. ``compare``: the (batch, Tq) rows of ``got`` that are specified. ``rows``: ``got`` holds
    only these query rows (a benchmarked call's checked rows), and each reference is computed at them."""
    pick = (lambda a: np.asarray(a, np.float64)) if compare is None \
        else (lambda a: np.asarray(a, np.float64)[np.broadcast_to(compare, np.shape(a)[:2])])
    got = pick(got)
    if not np.all(np.isfinite(got)):
        return None
    truth = pick(reference_attention(params, inputs, rows=rows).output)

    def outputs():
        for label, wrong_params, mistake in _candidates(params, inputs):
            with rotary_mistaken(mistake):
                wrong = pick(reference_attention(wrong_params, inputs, rows=rows).output)
            yield label, wrong
    return closest_mistake(got, truth, outputs(), bound, name_ties=True)


def rotary_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                compare: np.ndarray | None = None, rows: list[int] | None = None) -> str:
    """:func:`rotary_match`'s sentence, or ""."""
    found = rotary_match(got, params, inputs, bound, compare, rows)
    return "" if found is None else found[0]
