"""Known mistakes of a q/k norm (a norm of q and k after their projections: ``AttentionConfig.qk_norm``), computed in
NumPy, so a failed comparison can name the one its output matches: another kind of norm (over the whole projection
where each head's features belong, or the other way round; an RMSNorm where a LayerNorm subtracts the mean, or the
other way round), its gains not applied (a wrapper that never loaded them into the module's norm weights), applied as
``1 + g`` (Gemma's norm, ``x * (1 + weight)``, loaded with the gains themselves), only one of q and k normed, or no
norm at all; and, for a layer run without a norm, that its output matches q and k normed anyway (a wrapped module
that keeps its norms on whatever the config says)."""
from __future__ import annotations

import dataclasses

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.conventions import QK_NORMS, QK_NORMS_PER_HEAD, QK_NORMS_WITH_BIAS
from mha_harness.contract.mistakes import closest_mistake
from mha_harness.contract.reference import qk_norm_mistaken, qk_normed, reference_attention
from mha_harness.contract.validation import qk_norm_bias_shapes, qk_norm_gain_shapes

#: every q/k-norm diagnosis says so (a failure with one drops its guess of a precision from the error's size)
QK_NORM_MATCH = "q/k norm"
#: what each norm is, for the failure messages
_WORDS = {"rms_per_head": "an RMSNorm over each head's d_head features (Qwen 3, Gemma 3)",
          "rms_over_projection": "an RMSNorm over the whole projection (OLMo 2)",
          "layer_per_head": "a LayerNorm over each head's d_head features, its mean subtracted and its bias added "
                            "(timm's qk_norm)",
          "layer_per_head_no_bias": "a LayerNorm over each head's d_head features, its mean subtracted (ViT-22B, "
                                    "flax's normalize_qk)"}
#: the other kinds a layer that declares a norm is likely to compute instead: the same kind of norm over the other
#: axis, or the other kind of norm over the same axis (a LayerNorm's bias left out is ``biases_ignored``)
CONFUSED_WITH = {"rms_per_head": ("rms_over_projection", "layer_per_head_no_bias"),
                 "rms_over_projection": ("rms_per_head",),
                 "layer_per_head": ("rms_per_head",),
                 "layer_per_head_no_bias": ("rms_per_head",)}
#: the epsilons a norm is commonly built with (torch's nn.LayerNorm and timm's 1e-5, flax's and Qwen's 1e-6, ...): a
#: norm built with one of them where the config says another is ``eps:<value>``
COMMON_EPSILONS = (1e-5, 1e-6, 1e-8, 1e-12, 0.0)
#: a LayerNorm's bias not loaded (its initial zeros), named only for a norm with one (k's bias cancels in the softmax,
#: so the output shows q's)
BIASES_IGNORED = ("the q/k LayerNorm without its biases beta_q and beta_k (the biases were not loaded into the "
                  "layer's norms: their initial zeros; or the layer's LayerNorm has no bias, and it declares "
                  "'layer_per_head_no_bias')")
#: what each mistaken norm does, for the failure message
MISTAKES = {
    "gains_ignored": ("the q/k norm without its gains g_q and g_k (every normed feature times 1: the gains were not "
                      "loaded into the layer's norm weights)"),
    "gains_plus_one": ("the q/k norm scaled by 1 + g where the gain g belongs (a Gemma-style norm computes x * (1 + "
                       "weight): load g - 1 into such a norm's weight)"),
    "key_unnormed": "the q/k norm applied to q only: k is not normed",
    "query_unnormed": "the q/k norm applied to k only: q is not normed",
    "none": "no q/k norm at all (the layer's norms are the identity, or never called)",
}


def mistakes_of(kind: str, eps: float = 1e-6) -> dict[str, str]:
    """The mistakes of a layer whose norm is ``kind`` with epsilon ``eps``, by name (``other:<kind>`` for another
    kind of norm, ``eps:<value>`` for another epsilon) and their labels for a failure message."""
    other = {f"other:{k}": f"the q/k norm computed as {_WORDS[k]} where {kind!r} is {_WORDS[kind]}"
             for k in CONFUSED_WITH[kind]}
    if kind in QK_NORMS_WITH_BIAS:  # a module without a bias swapped in (torch.nn.RMSNorm) drops the bias too
        other.update({f"other_unbiased:{k}": f"the q/k norm computed as {_WORDS[k]}, without the LayerNorm's bias "
                                             f"(torch.nn.RMSNorm has none), where {kind!r} is {_WORDS[kind]}"
                      for k in CONFUSED_WITH[kind] if k not in QK_NORMS_WITH_BIAS})
    biases = {"biases_ignored": BIASES_IGNORED} if kind in QK_NORMS_WITH_BIAS else {}
    epsilons = {f"eps:{e!r}": (f"the q/k norm built with epsilon {e:g} where config.qk_norm_eps is {eps:g} (build "
                               "the norms with eps=config.qk_norm_eps: torch's nn.LayerNorm defaults to 1e-5)")
                for e in COMMON_EPSILONS if e != eps}
    return {**other, **biases, **MISTAKES, **epsilons}


#: the gains loaded into each other's norms: named only in a layer with rotary, whose forward shows it (without
#: rotary each score sums g_q[i] * g_k[i] terms, the same either way: the gradient case names it there)
GAINS_SWAPPED = ("the q/k norms' gains loaded into each other's norms (q_norm holds g_k and k_norm g_q; rotary pairs "
                 "mix the features, so the scores show it)")


def mistaken_qk_norm(params: AttentionParams, mistake: str):
    """The norm for :func:`~mha_harness.contract.reference.qk_norm_mistaken`: the layer's norm
    (``params.config.qk_norm``) with ``mistake`` (a key of :func:`mistakes_of`, or ``"gains_swapped"``), computed by
    the reference's norm."""
    c = params.config
    other = mistake.startswith(("other:", "other_unbiased:"))
    config = dataclasses.replace(c, qk_norm=mistake.split(":", 1)[1]) if other else c
    unbiased = mistake == "biases_ignored" or mistake.startswith("other_unbiased:")
    if mistake.startswith("eps:"):
        config = dataclasses.replace(c, qk_norm_eps=float(mistake.split(":", 1)[1]))

    def per_feature(a, width, n_heads):  # a head's vector, shared by all heads, as the norm's groups broadcast it
        if a.size != width:
            a = np.tile(a, width // a.size)
        return a.reshape(n_heads, width // n_heads) if config.qk_norm in QK_NORMS_PER_HEAD else a

    def normed(y, which, n_heads):
        if mistake == "none" or (mistake, which) in (("key_unnormed", "k"), ("query_unnormed", "q")):
            return y
        gain = np.asarray(getattr(params, f"g_{'k' if which == 'q' else 'q'}" if mistake == "gains_swapped"
                                  else f"g_{which}"), np.float64)
        gain = {"gains_ignored": np.ones_like(gain), "gains_plus_one": 1.0 + gain}.get(mistake, gain)
        bias = getattr(params, f"beta_{which}")
        if bias is not None and not unbiased:  # a bias the mistaken norm keeps, wherever it is
            bias = per_feature(np.asarray(bias, np.float64), y.shape[-1], n_heads)
        return qk_normed(y, per_feature(gain, y.shape[-1], n_heads), config, n_heads, bias=None if unbiased else bias)
    return normed


def with_unit_qk_norm(params: AttentionParams, kind: str) -> AttentionParams:
    """``params`` of a layer without a norm, given the norm ``kind`` with gains 1 (a module's norm weights as
    initialised: ones, or Gemma's zeros in ``x * (1 + weight)``)."""
    config = dataclasses.replace(params.config, qk_norm=kind)
    return dataclasses.replace(params, config=config,
                               **{n: np.ones(shape) for n, shape in qk_norm_gain_shapes(config).items()},
                               **{n: np.zeros(shape) for n, shape in qk_norm_bias_shapes(config).items()})


def qk_norm_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                 compare: np.ndarray | None = None, rows: list[int] | None = None) -> str:
    """The q/k-norm mistake a failing output ``got`` matches within ``diagnosis_margin(bound)`` and explains
    better than the correct layer (:func:`~mha_harness.contract.mistakes.explains`), as a sentence to append; "".
    A layer with a norm: each of :data:`MISTAKES`; a layer without one: q and k normed anyway (gains 1), each kind.
    ``compare``: the (batch, Tq) rows of ``got`` that are specified (padded queries' are not). ``rows``: ``got``
    holds only these query rows (a benchmarked call's checked rows), and each reference is computed at them."""
    found = qk_norm_match(got, params, inputs, bound, compare, rows)
    return "" if found is None else found[0]


def qk_norm_match(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                  compare: np.ndarray | None = None, rows: list[int] | None = None) -> tuple[str, float] | None:
    """:func:`qk_norm_hint`'s sentence and its candidate's distance from ``got`` (on the compared rows), for choosing
    between it and another diagnosis; None when no mistake matches. Of several that match (in half precision a
    LayerNorm and an RMSNorm kept on can both be within the margin), the closest."""
    pick = (lambda a: np.asarray(a, np.float64)) if compare is None \
        else (lambda a: np.asarray(a, np.float64)[np.broadcast_to(compare, np.shape(a)[:2])])
    got = pick(got)
    if not np.all(np.isfinite(got)):
        return None
    c = params.config
    truth = pick(reference_attention(params, inputs, rows=rows).output)

    def outputs():
        if c.qk_norm is None:
            for kind in QK_NORMS:
                yield (f"; the output matches a q/k norm, {_WORDS[kind]}, in a layer built without one: a layer "
                       f"with such a norm declares it, Capabilities(qk_norms=({kind!r},)), and builds its norms from "
                       "config.qk_norm (the identity when it is None): \"A layer with a norm on q and k\" in "
                       "docs/plugins.md", pick(reference_attention(with_unit_qk_norm(params, kind), inputs,
                                                                  rows=rows).output))
            return
        mistakes = mistakes_of(c.qk_norm, c.qk_norm_eps)
        if c.rotary is not None and np.shape(params.g_q) == np.shape(params.g_k):
            mistakes["gains_swapped"] = GAINS_SWAPPED
        for mistake, label in mistakes.items():
            with np.errstate(divide="ignore", invalid="ignore"), \
                    qk_norm_mistaken(mistake, mistaken_qk_norm(params, mistake)):  # epsilon 0 over a constant group:
                wrong = pick(reference_attention(params, inputs, rows=rows).output)  # 0 / 0, no match
            yield "; the output matches " + label, wrong
    return closest_mistake(got, truth, outputs(), bound)
