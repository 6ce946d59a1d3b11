"""Each mutant: numpy-naive (or its gradients) with one deliberate, realistic bug, built by subclassing one step of
:class:`NumpyNaiveLoaded` (never by patching module globals). Bugs that make sense in every input form also come
as a GPT-2-style self-attention module (one x, packed c_attn projection) and a shared-K/V module (x_q, x_kv with a
packed K/V projection), by composing the bug class with the module class."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, Capabilities
from mha_harness.contract.conventions import (
    ALIBI_KINDS,
    ROTARY_KINDS,
    ROTARY_SCALING_KINDS,
    TOP_LEFT,
    alibi_bias_from,
    alibi_slopes,
    causal_offset,
    rotary_pairs,
    rotary_positions,
)
from mha_harness.contract.mistakes import padding_over_query_length
from mha_harness.contract.reference import mistaken_vjp, reference_vjp
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from mha_harness.implementations.numpy_tiled import NumpyTiledLoaded
from mha_harness.toolkit.masks import block_mask, full_mask, sliding_window_mask


@dataclass(frozen=True)
class Mutant:
    """A broken backend, the bug it carries, and what a catching failure message must mention."""

    name: str
    bug: str
    loaded: type
    message_mentions: str
    gradients: bool = False
    parameter_shapes: object = None
    #: the input form the mutant module takes (Capabilities.inputs)
    inputs: str = "separate"
    #: whether it declares Tq != Tk calls (Capabilities.cross_attention); a mutant whose shapes only fit at Tq = Tk
    #: declares no cross_attention, as such a layer's author would, so it is caught by a named failure, not a crash
    cross_attention: bool = True
    #: the norms on q and k it declares (Capabilities.qk_norms): a q/k-norm mutant declares the norm it gets wrong
    qk_norms: tuple[str, ...] = ()
    #: whether it declares grouped-query heads (a mutant whose shapes fit only full-width K/V declares none)
    grouped_query: bool = True
    #: the rotary embeddings it declares (Capabilities.rotary): a rotary mutant declares the ones it gets wrong
    rotary: tuple[str, ...] = ()
    #: whether it declares a partial rotary (Capabilities.partial_rotary)
    partial_rotary: bool = False
    #: the rescalings of the rotary frequencies it declares (Capabilities.rotary_scalings)
    rotary_scalings: tuple[str, ...] = ()
    #: whether it declares a sliding window (Capabilities.sliding_window): a window mutant declares the one it breaks
    sliding_window: bool = False
    #: the ALiBi biases it declares (Capabilities.alibi): an ALiBi mutant declares the ones it gets wrong
    alibi: tuple[str, ...] = ()
    #: whether it declares attn_masks (bool and additive): a padding-only mutant (BERT's masks) declares none
    attn_masks: bool = True


class SelfAttentionModule(NumpyNaiveLoaded):
    """GPT-2-style self-attention: one x, one packed projection c_attn = [W_q | W_k | W_v] (only x is read)."""

    def heads(self, inputs):
        c, w = self.config, self.weights
        kv = c.kv_heads * c.d_head
        c_attn = np.concatenate([w["W_q"], w["W_k"], w["W_v"]], axis=1)
        qkv = np.asarray(inputs.query, self.dtype) @ c_attn
        if "b_q" in w:
            qkv = qkv + np.concatenate([w["b_q"], w["b_k"], w["b_v"]])
        d = c.d_model
        return (self.split_heads(qkv[..., :d], c.num_heads), self.split_heads(qkv[..., d:d + kv], c.kv_heads),
                self.split_heads(qkv[..., d + kv:], c.kv_heads))


class FusedQKVBlocksIntoPerHead(NumpyNaiveLoaded):
    """A GPT-NeoX-style self-attention layer, whose fused query_key_value is read per head (qkv.view(B, T, heads,
    3 * d_head), then q, k, v from each head's three slices), loaded with [W_q | W_k | W_v] in blocks, as GPT-2's
    c_attn is packed (an outside user's GPT-NeoX copy)."""

    def heads(self, inputs):
        c, w = self.config, self.weights
        qkv = np.asarray(inputs.query, self.dtype) @ np.concatenate([w["W_q"], w["W_k"], w["W_v"]], axis=1)
        if "b_q" in w:
            qkv = qkv + np.concatenate([w["b_q"], w["b_k"], w["b_v"]])
        per_head = qkv.reshape(*qkv.shape[:2], c.num_heads, 3 * c.d_head).transpose(0, 2, 1, 3)
        return tuple(per_head[..., j * c.d_head:(j + 1) * c.d_head] for j in range(3))


class SharedKVModule(NumpyNaiveLoaded):
    """Encoder-decoder cross-attention: x_q and one x_kv through a packed [W_k | W_v] (inputs.value is never read)."""

    def heads(self, inputs):
        c, w = self.config, self.weights
        kv = c.kv_heads * c.d_head
        packed = np.asarray(inputs.key, self.dtype) @ np.concatenate([w["W_k"], w["W_v"]], axis=1)
        if "b_k" in w:
            packed = packed + np.concatenate([w["b_k"], w["b_v"]])
        q = self.project(np.asarray(inputs.query, self.dtype), "q")
        return (self.split_heads(q, c.num_heads), self.split_heads(packed[..., :kv], c.kv_heads),
                self.split_heads(packed[..., kv:], c.kv_heads))


MODULES = {"shared_kv": SharedKVModule, "self": SelfAttentionModule}


class SplitTokens(NumpyNaiveLoaded):
    def split_heads(self, x, n_heads):
        b, t, w = x.shape
        return x.reshape(b, n_heads, t, w // n_heads)

    def merge_heads(self, heads):
        b, h, t, dh = heads.shape
        return heads.reshape(b, t, h * dh)


class ScaleByDModel(NumpyNaiveLoaded):
    def scale(self):
        return 1.0 / np.sqrt(self.config.d_model)


class ScaleByDHead(NumpyNaiveLoaded):
    def scale(self):
        return 1.0 / self.config.d_head


class NoScale(NumpyNaiveLoaded):
    def scale(self):
        return 1.0


class NoOutputProjection(NumpyNaiveLoaded):
    def output_projection(self, concat):
        return concat


def _with_mask(allowed, extra):
    return extra if allowed is None else allowed & extra


def _one_future_token_masks(inputs):
    """The masks with the causal limit moved one key into the future."""
    allowed, additive = full_mask(inputs.replace(causal=None))
    if inputs.causal:
        offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
        allowed = _with_mask(allowed, np.arange(inputs.tk)[None, :] <= np.arange(inputs.tq)[:, None] + offset + 1)
    return allowed, additive


class CausalOneFutureToken(NumpyNaiveLoaded):
    def masks(self, inputs):
        return _one_future_token_masks(inputs)


#: the query chunk of :class:`CausalFromChunkRelativeQueries`
QUERY_CHUNK = 256


class CausalFromChunkRelativeQueries(NumpyNaiveLoaded):
    """Processes its queries in chunks of QUERY_CHUNK (an xformers-style memory-efficient layer: an outside user's)
    and builds each chunk's causal mask from the chunk-relative query index (arange(0, end - start)) instead of the
    absolute one: right on every call of up to 256 queries; past it, query i sees the keys up to i mod 256."""

    def masks(self, inputs):
        allowed, additive = full_mask(inputs.replace(causal=None))
        if inputs.causal:
            offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
            relative = np.arange(inputs.tq) % QUERY_CHUNK
            allowed = _with_mask(allowed, np.arange(inputs.tk)[None, :] <= relative[:, None] + offset)
        return allowed, additive


class CausalExcludesDiagonal(NumpyNaiveLoaded):
    def masks(self, inputs):
        allowed, additive = full_mask(inputs.replace(causal=None))
        if inputs.causal:
            offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
            allowed = _with_mask(allowed, np.arange(inputs.tk)[None, :] < np.arange(inputs.tq)[:, None] + offset)
        return allowed, additive


class CausalMaskReversed(NumpyNaiveLoaded):
    def masks(self, inputs):  # torch.triu where torch.tril belongs: query i sees key i and every later key
        allowed, additive = full_mask(inputs.replace(causal=None))
        if inputs.causal:
            offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
            allowed = _with_mask(allowed, np.arange(inputs.tk)[None, :] >= np.arange(inputs.tq)[:, None] + offset)
        return allowed, additive


class CausalOffsetNegated(NumpyNaiveLoaded):
    def masks(self, inputs):  # tril(diagonal=Tq - Tk) where diagonal=Tk - Tq belongs: bottom-right with Tq != Tk
        allowed, additive = full_mask(inputs.replace(causal=None))
        if inputs.causal:
            offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
            allowed = _with_mask(allowed, np.arange(inputs.tk)[None, :] <= np.arange(inputs.tq)[:, None] - offset)
        return allowed, additive


class CausalAlwaysTopLeft(NumpyNaiveLoaded):
    def masks(self, inputs):
        return full_mask(inputs.replace(causal="top-left" if inputs.causal else None))


class PaddingIgnored(NumpyNaiveLoaded):
    def masks(self, inputs):
        return full_mask(inputs.replace(key_padding_mask=None))


class PaddingOnQueryAxis(NumpyNaiveLoaded):
    """Broadcasts the key padding mask along the query axis (``mask[:, None, :, None]`` where ``mask[:, None, None,
    :]`` belongs): padded positions' queries see no key, and every query sees the padded keys. With Tq != Tk that
    broadcast cannot run (a real module raises): it masks correctly there, so only square calls show the bug."""

    def masks(self, inputs):
        if inputs.key_padding_mask is None or inputs.tq != inputs.tk:
            return super().masks(inputs)
        allowed, additive = full_mask(inputs.replace(key_padding_mask=None))
        rows = ~np.asarray(inputs.key_padding_mask)[:, None, :, None]
        return (rows if allowed is None else allowed & rows), additive


class PaddingLoopOverQueryLength(NumpyNaiveLoaded):
    """Masks padded keys in a loop over the query length (``for j in range(T)`` with T = q.shape[1], written for
    self-attention): keys at positions >= Tq are never masked. At Tq = Tk it is right; a cross-attention call with
    fewer queries than keys sees the padded keys behind them."""

    def masks(self, inputs):
        short = padding_over_query_length(inputs)
        return super().masks(inputs) if short is None else full_mask(short)


class CausalMaskNeverApplied(NumpyNaiveLoaded):
    """Declares causal masking, builds the other masks, never applies the causal one."""

    def masks(self, inputs):
        return full_mask(inputs.replace(causal=None))


class _DenominatorMask(NumpyNaiveLoaded):
    """Masked keys get weight 0 in the numerator, but the keys of :meth:`denominator_inputs`'s masks (a superset)
    all enter the softmax normaliser: the kept weights no longer sum to 1 and depend on hidden keys."""

    def denominator_mask(self, inputs: AttentionInputs):
        """Keys counted in the normaliser (bool, True = counted; None = every key)."""
        raise NotImplementedError

    def masks(self, inputs):
        self._denominator = self.denominator_mask(inputs)
        return super().masks(inputs)

    def masked_softmax(self, scores, allowed, additive):
        if additive is not None:
            scores += additive.astype(self.dtype)
        if allowed is None:
            return self.softmax(scores)
        counted = np.ones_like(allowed) if self._denominator is None else self._denominator | allowed
        counted = np.broadcast_to(counted, scores.shape)
        s = np.where(counted, scores, -np.inf)
        row_max = s.max(axis=-1, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(row_max), row_max, 0))
        total = e.sum(axis=-1, keepdims=True)
        return np.where(allowed, e, 0) / np.where(total == 0, 1, total)


class MaskAfterSoftmax(_DenominatorMask):
    """softmax over every key, then the mask multiplied in, without renormalising."""

    def denominator_mask(self, inputs):
        return None


class FutureKeyInDenominator(_DenominatorMask):
    """The causal numerator is right, but the normaliser also sums key i + 1 (an off-by-one in its mask)."""

    def denominator_mask(self, inputs):
        return _one_future_token_masks(inputs)[0]


class PaddedKeysInDenominator(_DenominatorMask):
    """Padded keys get weight 0, but the normaliser sums over them too."""

    def denominator_mask(self, inputs):
        return full_mask(inputs.replace(key_padding_mask=None))[0]


class PaddingDroppedWhenCausal(NumpyNaiveLoaded):
    """Combines masks wrongly: with causal on, the key padding mask is forgotten."""

    def masks(self, inputs):
        return full_mask(inputs.replace(key_padding_mask=None) if inputs.causal else inputs)


class AttnMaskReplacesCausal(NumpyNaiveLoaded):
    """Combines masks wrongly: an explicit attn_mask replaces the causal mask instead of joining it."""

    def masks(self, inputs):
        return full_mask(inputs.replace(causal=None) if inputs.attn_mask is not None else inputs)


class AdditiveMaskIgnored(NumpyNaiveLoaded):
    def masks(self, inputs):
        allowed, _ = full_mask(inputs)
        return allowed, None


class MaskPolarityInverted(NumpyNaiveLoaded):
    def masks(self, inputs):
        m = inputs.attn_mask
        return full_mask(inputs.replace(attn_mask=~m) if m is not None and m.dtype == np.bool_ else inputs)


class AttnMaskTransposed(NumpyNaiveLoaded):
    """Reads its (Tq, Tk) attn_mask transposed (a mask built as (Tk, Tq), or one .T too many): its shapes fit only
    at Tq = Tk, so it declares no cross_attention, as its author would have found."""

    def masks(self, inputs):
        m = inputs.attn_mask
        return full_mask(inputs if m is None else inputs.replace(attn_mask=np.swapaxes(m, -1, -2)))


class SoftmaxWithoutMaxSubtraction(NumpyNaiveLoaded):
    def softmax(self, scores):
        e = np.exp(scores)
        total = e.sum(axis=-1, keepdims=True)
        return e / np.where(total == 0, 1, total)


class FullyMaskedRowsNaN(NumpyNaiveLoaded):
    def softmax(self, scores):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


class AdditiveMaskedRowNaN(NumpyNaiveLoaded):
    """Adds a float attn_mask to the scores as it is (its -inf included) and zeroes only the rows the causal,
    padding and bool masks empty, with a softmax that does not guard them: a row of -inf biases gives 0/0 = NaN.
    The layer a JAX user wrote first (bool masks through ``allowed``, float masks added)."""

    def masks(self, inputs):
        if inputs.attn_mask is None or np.asarray(inputs.attn_mask).dtype == bool:
            return super().masks(inputs)
        allowed, _ = super().masks(inputs.replace(attn_mask=None))
        return allowed, np.asarray(inputs.attn_mask, np.float64)

    def masked_softmax(self, scores, allowed, additive):
        if additive is not None:
            scores += additive.astype(self.dtype)
        if allowed is not None:
            np.copyto(scores, -np.inf, where=~allowed)
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights = e / e.sum(axis=-1, keepdims=True)
        if allowed is not None:  # rows that the bool masks leave without a key: zeros
            weights = np.where(np.broadcast_to(allowed, weights.shape).any(axis=-1, keepdims=True), weights, 0)
        return weights


class HeadsConcatenatedReversed(NumpyNaiveLoaded):
    def merge_heads(self, heads):
        return super().merge_heads(heads[:, ::-1])


class OutputKernelHeadsSwapped(NumpyNaiveLoaded):
    """W_o read per head as reshape(d_head, heads, d_model).transpose(1, 0, 2) where reshape(heads, d_head, d_model)
    belongs (an einsum port of a per-head output kernel): feature j of head h meets row j * heads + h of W_o instead
    of row h * d_head + j, as if the heads were concatenated feature-major."""

    def output_projection(self, concat):
        c = self.config
        b, t, _ = concat.shape
        kernel = self.weights["W_o"].reshape(c.d_head, c.num_heads, c.d_model).transpose(1, 0, 2)
        out = np.einsum("bthj,hjd->btd", concat.reshape(b, t, c.num_heads, c.d_head), kernel)
        bias = self.weights.get("b_o")
        return out if bias is None else out + bias


class KeysFromQuery(NumpyNaiveLoaded):
    """An encoder-decoder cross-attention that projects its keys from x_q where x_kv belongs (``k = W_k(x_q)``; the
    values from x_kv): right for self-attention, where x_q is x_kv; with Tq != Tk its shapes do not fit (it raises),
    so its mutant declares no cross_attention, as its author would have found."""

    def heads(self, inputs):
        c = self.config
        return tuple(self.split_heads(self.project(np.asarray(x, self.dtype), which), n)
                     for x, which, n in ((inputs.query, "q", c.num_heads), (inputs.query, "k", c.kv_heads),
                                         (inputs.value, "v", c.kv_heads)))


class KVHeadsTiled(NumpyNaiveLoaded):
    """Grouped-query key/value heads expanded by tiling (torch ``k.repeat(1, group, 1, 1)``, ``np.tile``) where
    each belongs to its group of consecutive query heads (``repeat_interleave``): query head h reads key/value head
    h % kv_heads instead of h // group. Right for multi-head (group 1) and multi-query (one key/value head)."""

    def expand_kv_heads(self, kv):
        return np.tile(kv, (1, self.config.group, 1, 1))


class BatchNormalisedTogether(NumpyNaiveLoaded):
    def softmax(self, scores):
        e = np.exp(scores - scores.max(axis=(0, -1), keepdims=True))
        total = e.sum(axis=(0, -1), keepdims=True) / scores.shape[0]
        return e / np.where(total == 0, 1, total)


class ValueBiasDropped(NumpyNaiveLoaded):
    def project(self, x, which):
        if which == "v":
            return x @ self.weights["W_v"]
        return super().project(x, which)


class DropoutAtInference(NumpyNaiveLoaded):
    def softmax(self, scores):
        weights = super().softmax(scores)
        keep = np.random.default_rng().random(weights.shape) >= 0.1
        return weights * keep / 0.9


class NaNPoisonLeaks(NumpyNaiveLoaded):
    """Masked keys get weight 0, but P @ V still multiplies 0 by the NaN stored there."""

    def weighted_values(self, weights, v):
        return weights @ v


class NoInputValidation(NumpyNaiveLoaded):
    def forward(self, inputs, *, need_weights=False):
        try:
            return self.compute(inputs, need_weights=need_weights)
        except Exception as exc:  # an IndexError / broadcasting error leaks out instead of a named ValueError
            raise RuntimeError(f"broadcast failure: {exc}") from None


class QueryReusedAsScratch(NumpyNaiveLoaded):
    def heads(self, inputs):  # projects, then reuses the caller's query array as scratch space: right output
        out = super().heads(inputs)
        if isinstance(inputs.query, np.ndarray) and inputs.query.flags.writeable:
            inputs.query[...] = 0.0
        return out


class KVWeightsSwapped(NumpyNaiveLoaded):
    """A wrapper that loads W_k (and b_k) into the value projection and W_v (b_v) into the key projection."""

    #: the two projections whose weights (and biases) are loaded into each other
    swapped = ("k", "v")

    def __init__(self, params, dtype):
        super().__init__(params, dtype)
        w, (a, b) = self.weights, self.swapped
        w[f"W_{a}"], w[f"W_{b}"] = w[f"W_{b}"], w[f"W_{a}"]
        if f"b_{a}" in w:
            w[f"b_{a}"], w[f"b_{b}"] = w[f"b_{b}"], w[f"b_{a}"]


class QKWeightsSwapped(KVWeightsSwapped):
    """A wrapper that splits a fused qkv weight in the wrong order: W_q (and b_q) into the key projection, W_k (b_k)
    into the query projection."""

    swapped = ("q", "k")


class WeightsUntransposed(NumpyNaiveLoaded):
    """A wrapper that loads each projection weight W into an (out, in) Linear as it is, where W.T belongs: the layer
    computes x @ W.T (its shapes fit only where W is square: it declares no grouped-query heads)."""

    def __init__(self, params, dtype):
        super().__init__(params, dtype)
        for name in ("W_q", "W_k", "W_v", "W_o"):
            self.weights[name] = self.weights[name].T.copy()


class QKNormOverProjection(NumpyNaiveLoaded):
    """A per-head q/k norm (Qwen 3's, Gemma 3's) taken over the whole projection (OLMo 2's axis): one mean square
    over all heads' features, each head's gains tiled across the width."""

    def qk_norm(self, y, which):
        c = self.config
        if c.qk_norm != "rms_per_head":
            return super().qk_norm(y, which)
        gain = np.tile(self.weights[f"g_{which}"], y.shape[-1] // c.d_head)
        return y / np.sqrt(np.mean(np.square(y), axis=-1, keepdims=True) + c.qk_norm_eps) * gain


class QKLayerNormNotCentred(NumpyNaiveLoaded):
    """A LayerNorm on q and k (ViT-22B's, flax's normalize_qk) computed as an RMSNorm: the mean is never subtracted
    (a port that mapped the norm to RMSNorm)."""

    def norm_centred(self, groups):
        return groups


class QKRMSNormModuleForLayerNorm(QKLayerNormNotCentred):
    """torch.nn.RMSNorm swapped in for a LayerNorm with a bias (timm's): the mean is never subtracted and there is no
    bias (an outside user's timm copy)."""

    def norm_bias(self, which):
        return None


class QKLayerNormBiasesNotLoaded(NumpyNaiveLoaded):
    """A wrapper that never loads the q/k LayerNorms' biases (timm's): the norms keep their initial zeros."""

    def norm_bias(self, which):
        return None


class QKNormEpsDefault(NumpyNaiveLoaded):
    """q/k LayerNorms built with torch's default epsilon, 1e-5, whatever config.qk_norm_eps says (an outside user's
    timm copy: nn.LayerNorm(d_head) as timm builds it)."""

    def qk_norm(self, y, which):
        config = self.config
        self.config = dataclasses.replace(config, qk_norm_eps=1e-5)
        try:
            return super().qk_norm(y, which)
        finally:
            self.config = config


class QKRMSNormCentred(NumpyNaiveLoaded):
    """An RMSNorm on q and k (Qwen 3's) computed as a LayerNorm: each head's mean is subtracted first (a port that
    mapped the norm to nn.LayerNorm)."""

    def norm_centred(self, groups):
        return groups - np.mean(groups, axis=-1, keepdims=True)


class QKNormGainsNotLoaded(NumpyNaiveLoaded):
    """A wrapper that never loads the q/k norms' gains: the module's norm weights keep their initial ones."""

    def norm_gain(self, which):
        return np.ones_like(super().norm_gain(which))


class QKNormGainPlusOne(NumpyNaiveLoaded):
    """A Gemma-style norm (``x * (1 + weight)``) loaded with the gains themselves: each normed feature is scaled
    by 1 + g where g belongs."""

    def norm_gain(self, which):
        return 1.0 + super().norm_gain(which)


class QKNormKeyForgotten(NumpyNaiveLoaded):
    """Normalises q but not k (a k_norm built and never called)."""

    def qk_norm(self, y, which):
        return y if which == "k" else super().qk_norm(y, which)


class RotaryOtherPairing(NumpyNaiveLoaded):
    """Rotary embeddings that pair the other features: GPT-J's (2i, 2i + 1) where Hugging Face's rotate_half pairs i
    with i + d_head/2, or the other way round (Meta's Llama weights loaded into a rotate_half layer without
    transformers' permutation of W_q and W_k)."""

    def rotary_pairs(self):
        other = {"half_split": "interleaved", "interleaved": "half_split"}[self.config.rotary]
        return rotary_pairs(other, self.rotary_width())


class RotaryBaseDefault(NumpyNaiveLoaded):
    """Rotary embeddings built with the common default base 10,000 whatever config.rotary_base says (a Llama 3 or
    Qwen layer whose rope_theta was never passed on)."""

    def rotary_base(self):
        return 10_000.0


class RotaryPartialWholeHead(NumpyNaiveLoaded):
    """A partial rotary (config.rotary_dims of each head's features) that turns every feature of the head, over
    d_head's frequencies: GPT-NeoX's rotary_pct, Phi's partial_rotary_factor or GPT-J's rotary_dim never passed on."""

    def rotary_width(self):
        return self.config.d_head


class RotaryPartialFrequenciesOverHead(NumpyNaiveLoaded):
    """A partial rotary that turns the right features, but with the frequencies of a full one: base ** (-2i /
    d_head) where they are over the r features turned, base ** (-2i / r) (the inv_freq built from head_dim)."""

    def rotary_frequencies(self, work):
        width, d_head = self.rotary_width(), self.config.d_head
        return work(1.0) / work(self.rotary_base()) ** (np.arange(0, width, 2, dtype=work) / work(d_head))


class RotaryScalingIgnored(NumpyNaiveLoaded):
    """Rotary frequencies never rescaled whatever config.rotary_scaling says (a Llama 3.1 layer built without its
    rope_scaling: rope_type "llama3" lost on the way to the module)."""

    def rotary_scaling(self):
        return None


class YarnWithoutAttentionFactor(NumpyNaiveLoaded):
    """YaRN's frequencies rescaled, but q and k never multiplied by its attention factor (0.1 * ln(factor) + 1: a
    port of YaRN's inv_freq that drops the attention_scaling transformers multiplies cos and sin by)."""

    def rotary_scaling(self):
        scaling = self.config.rotary_scaling
        if scaling is None or scaling.kind != "yarn":
            return scaling
        return dataclasses.replace(scaling, attention_factor=1.0)


class SlidingWindowIgnored(NumpyNaiveLoaded):
    """Declares a sliding window but never applies it: every key up to the query is seen (a Mistral layer whose
    config.sliding_window never reaches its mask, as with an attention implementation that drops it)."""

    def masks(self, inputs: AttentionInputs):
        return full_mask(inputs)


class SlidingWindowOneKeyTooWide(NumpyNaiveLoaded):
    """A window of w + 1 keys: each query sees its own position and the w before it (key j when j >= p - w:
    flash-attn's window_size=(w, 0) where (w - 1, 0) belongs)."""

    def masks(self, inputs: AttentionInputs):
        w = self.config.sliding_window
        return full_mask(inputs, sliding_window=None if w is None else w + 1)


class SlidingWindowFromQueryIndex(NumpyNaiveLoaded):
    """Counts the window back from each query's index in the call, i, not its position i + Tk - Tq: in a KV-cache
    step the window ignores the cached positions (right when Tq = Tk)."""

    def masks(self, inputs: AttentionInputs):
        allowed, additive = full_mask(inputs)
        w = self.config.sliding_window
        if w is None:
            return allowed, additive
        from_index = sliding_window_mask(inputs.tq, inputs.tk, w, TOP_LEFT)[None, None]
        return (from_index if allowed is None else allowed & from_index), additive


def _alibi_of(kind: str, slopes: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """(1, H, Tq, Tk): the bias of ``kind`` with these (wrong) slopes or positions."""
    return alibi_bias_from(kind, slopes, q_pos, k_pos)[None]


class AlibiSlopesReversed(NumpyNaiveLoaded):
    """ALiBi with the paper's slopes in reverse head order: head 0 gets the smallest slope (a slope list built
    from the small end, or read back to front)."""

    def alibi(self, tq, tk):
        if self.config.alibi is None:
            return None
        return _alibi_of(self.config.alibi, alibi_slopes(self.config.num_heads)[::-1], *rotary_positions(tq, tk))


class AlibiSlopesPowerOfTwoFormula(NumpyNaiveLoaded):
    """ALiBi slopes ``2 ** (-8 h / n)`` at every head count: right for 8 or 16 heads, wrong at 6 or 12, where the
    paper interleaves the slopes of the next power of two."""

    def alibi(self, tq, tk):
        if self.config.alibi is None:
            return None
        n = self.config.num_heads
        return _alibi_of(self.config.alibi, 2.0 ** (-8.0 * np.arange(1, n + 1) / n), *rotary_positions(tq, tk))


class AlibiQueriesFromIndex(NumpyNaiveLoaded):
    """ALiBi with query i at position i, not i + Tk - Tq: the bias of a KV-cache step or cross-attention call that
    ignores the keys before the queries (right when Tq = Tk)."""

    def alibi(self, tq, tk):
        if self.config.alibi is None:
            return None
        return _alibi_of(self.config.alibi, alibi_slopes(self.config.num_heads), np.arange(tq), np.arange(tk))


class AlibiAlwaysSymmetric(NumpyNaiveLoaded):
    """ALiBi as ``-m |p - s|`` whatever config.alibi says: a layer built with the paper's ``-m (p - s)`` (BLOOM's)
    penalises the keys after the query, where it favours them (seen only where such keys are visible)."""

    def alibi(self, tq, tk):
        if self.config.alibi is None:
            return None
        return _alibi_of("symmetric", alibi_slopes(self.config.num_heads), *rotary_positions(tq, tk))


class RotaryKeysNotTurned(NumpyNaiveLoaded):
    """Turns q by its rotary embeddings but not k (the key's rotary call dropped in a rewrite)."""

    def rotate(self, x, positions, which):
        return x if which == "k" else super().rotate(x, positions, which)


class CausalPathLoaded(NumpyNaiveLoaded):
    """numpy-naive whose steps know whether the call carries a causal mask (``causal``): the base of a decoder layer
    with a separate causal path (a fast kernel called only under the mask) that leaves a step out."""

    causal = False

    def attend(self, inputs, need_weights):
        self.causal = inputs.causal is not None
        return super().attend(inputs, need_weights)


class RotaryLeftOutOnCausalPath(CausalPathLoaded):
    """A decoder layer whose causal calls go through a fast path that never turns q and k (the rotary applied only on
    the general path: an outside user's Qwen 3 layer passed every case that had no causal mask)."""

    def rotate(self, x, positions, which):
        return x if self.causal else super().rotate(x, positions, which)


class RotaryQueriesFromZero(NumpyNaiveLoaded):
    """Turns the queries at positions 0 .. Tq - 1 whatever the keys before them: in a KV-cache step (or any call with
    fewer queries than keys) the new tokens get the cache's first positions, not their own (position_ids never
    offset by the cache length)."""

    def positions(self, tq, tk):
        _, keys = super().positions(tq, tk)
        return np.arange(tq), keys


class RotaryBeforeNorm(NumpyNaiveLoaded):
    """Turns q and k before their q/k norm instead of after it (Qwen 3 norms each head, then applies rotary)."""

    def heads(self, inputs):
        self._positions = dict(zip("qk", self.positions(inputs.tq, inputs.tk)))
        return super().heads(inputs)

    def qk_norm(self, y, which):
        b, t, width = y.shape
        heads = y.reshape(b, t, width // self.config.d_head, self.config.d_head).transpose(0, 2, 1, 3)
        turned = super().rotate(heads, self._positions[which], which).transpose(0, 2, 1, 3).reshape(b, t, width)
        return super().qk_norm(turned, which)

    def rotate(self, x, positions, which):  # with a norm, already turned before it
        return x if self.config.qk_norm else super().rotate(x, positions, which)

    def prepare_decode_step(self, inputs):
        raise NotImplementedError("no decode step: its keys are turned inside the projection")


class _GradientMutant(NumpyNaiveLoaded):
    """numpy-naive forward with reference gradients, so gradient cases have something to catch."""

    def compute_vjp(self, inputs: AttentionInputs, cotangent):
        return reference_vjp(self._params, inputs, cotangent)


class OneXGradientSummed(_GradientMutant):
    def compute_vjp(self, inputs, cotangent):
        grads = super().compute_vjp(inputs, cotangent)
        if inputs.query is inputs.key is inputs.value:  # one leaf used three times: each gets the total d/dx
            grads["query"] = grads["key"] = grads["value"] = grads["query"] + grads["key"] + grads["value"]
        return grads


class GradientFlowsToFutureKeys(_GradientMutant):
    def compute_vjp(self, inputs, cotangent):
        return reference_vjp(self._params, inputs.replace(causal=None), cotangent)


class GradientIgnoresPadding(_GradientMutant):
    def compute_vjp(self, inputs, cotangent):  # the forward masks padded keys, the backward does not
        return reference_vjp(self._params, inputs.replace(key_padding_mask=None), cotangent)


class GradientOfWoTransposed(_GradientMutant):
    def compute_vjp(self, inputs, cotangent):
        grads = super().compute_vjp(inputs, cotangent)
        grads["W_o"] = grads["W_o"].T.copy()
        return grads


class RotaryBackwardTurnsForward(_GradientMutant):
    """A hand-written rotary backward that turns the gradients of q and k by the forward's angles again (it reuses the
    forward's sin where the transpose of the rotation needs -sin). Its forward is right."""

    def compute_vjp(self, inputs, cotangent):
        return mistaken_vjp(self._params, inputs, cotangent, rotary_turned_forward=True)


class DecodeStepAttendsBeforeWriting(NumpyNaiveLoaded):
    """A KV-cache decode step that attends over its cache first and writes x_new's keys and values into it after:
    the new queries miss their own keys and values (a fresh cache's zeros on the first step; in a model, the
    previous step's). Its forward is right."""

    def write_then_attend(self, write, attend):
        out = attend()
        write()
        return out


class _TiledLoaded(NumpyTiledLoaded):
    """numpy-tiled with 16-query and 16-key blocks (a FlashAttention kernel's BLOCK_M = BLOCK_N = 16): a bug in how
    blocks combine shows only where the keys span more than one block."""

    def __init__(self, params, dtype):
        super().__init__(params, dtype, block_q=16, block_k=16)


class TiledKeyBlocksTopLeft(_TiledLoaded):
    def key_limit(self, inputs, q1):  # the top-left diagonal's bound, also under bottom-right alignment
        return min(inputs.tk, q1) if inputs.causal else inputs.tk


class TiledBlockMaskOfFirstItem(_TiledLoaded):
    """Classifies each key block by batch item 0's masks and shares that for the batch (FlexAttention's
    ``create_block_mask(mask_mod, B=None, ...)`` with a mask_mod that reads the batch index): a block every key of
    which item 0 sees runs unmasked for every item, one item 0 sees none of is skipped for every item; a partly
    visible one applies each item's own mask. At 10 keys, one short block, partial for every item, it is right."""

    def block_mask(self, inputs, q0, q1, k0, k1):
        allowed, additive = super().block_mask(inputs, q0, q1, k0, k1)
        if allowed is None:
            return allowed, additive
        first = allowed[0]
        if first.all() and k1 - k0 == self.block_k:  # a "full" block for item 0 (a short last block, whose missing
            return None, additive                     # keys count as masked, is partial): no mask_mod evaluated
        if not first.any():  # an empty block for item 0: skipped
            return np.zeros_like(allowed), additive
        return allowed, additive


class TiledRunningMaxFromZero(_TiledLoaded):
    """Starts the online softmax's running maximum at 0 instead of -inf: right while a row has a score above about
    -80 (float32), since the first block's maximum then replaces 0 or the exps stay representable; a row whose
    every score is far below 0 underflows every exp(s - 0) and outputs zeros (0 / a guarded 1)."""

    initial_max = 0.0


class TiledNoRescale(_TiledLoaded):
    """Never rescales the accumulator and row sum when the running maximum grows: each 16-key block stays in the
    units of the maximum seen when it was added, so rows whose keys span blocks weigh the early blocks too much."""

    def rescale(self, m, m_new):
        m_safe, _ = super().rescale(m, m_new)
        return m_safe, np.ones_like(m_safe)


class TiledAccumulatorNotRescaled(_TiledLoaded):
    """Rescales the row sum but not the accumulator when the running maximum grows (an outside user's JAX kernel):
    each 16-key block's values stay weighted in the units of the maximum seen when it was added, over a right row
    sum."""

    def accumulator_rescale(self, correction):
        return np.ones_like(correction)


class TiledMaskedBlockNaN(_TiledLoaded):
    """Shifts and rescales by the running maximum unguarded (a stranger's kernel): in a 16-key block with no visible
    key, while the row has seen none, -inf - -inf is NaN, and the NaN stays in the row whatever keys follow."""

    def rescale(self, m, m_new):
        with np.errstate(invalid="ignore"):
            return m_new, np.exp(m - m_new)


class QKNormGainsSwapped(_GradientMutant):
    """A wrapper that loads g_q into the k norm and g_k into the q norm: the same forward (each score sums
    g_q[i] * g_k[i] terms), each gain's gradient the other's."""

    def __init__(self, params, dtype):
        super().__init__(params, dtype)
        if params.config.qk_norm is not None:
            self.weights["g_q"], self.weights["g_k"] = self.weights["g_k"], self.weights["g_q"]

    def compute_vjp(self, inputs: AttentionInputs, cotangent):
        p = self._params
        return reference_vjp(p if p.config.qk_norm is None else p.replace(g_q=p.g_k, g_k=p.g_q), inputs, cotangent)


class _HandWrittenBackward(NumpyTiledLoaded):
    """numpy-tiled (16-query blocks) with a FlashAttention-2-style backward written by hand over key blocks, each
    block's weights its own softmax: right while one block holds every key, as its default 4096-key blocks do at
    the mutants' lengths; each mutant below changes one step of it."""

    def __init__(self, params, dtype, block_k: int = 4096):
        super().__init__(params, dtype, block_q=16, block_k=block_k)

    def score_gradient(self, p, d_p, row):
        """The softmax's backward: dS = P * (dP - rowsum(dO * O)), zero where a weight is zero."""
        return np.where(p != 0, p * (d_p - row), 0)

    def backward_masks(self, inputs, tq, k0, k1):
        """The masks the backward recomputes the weights of keys k0..k1 with: the forward's."""
        return block_mask(inputs, 0, tq, k0, k1)

    def recompute_weights(self, scores, allowed, additive):
        """The weights the backward recomputes from a key block's scores and the masks: the block's softmax."""
        return self.masked_softmax(scores, allowed, additive)

    def masked_scores(self, scores, allowed, additive):
        """A key block's scores with the additive mask added and the keys it may not see at -inf (a new array)."""
        if additive is not None:
            scores = scores + additive.astype(self.dtype)
        return scores if allowed is None else np.where(allowed, scores, -np.inf)

    def head_gradients(self, d_q, d_k, d_v):
        """The heads' dQ, dK and dV as the backward returns them, before the projections."""
        return d_q, d_k, d_v

    def value_gradient(self, p, d_o):
        """dV of a key block: P^T @ dO."""
        return p.swapaxes(-1, -2) @ d_o

    def compute_vjp(self, inputs, cotangent):
        c, w, dt = self.config, self.weights, self.dtype
        b, tq = inputs.batch, inputs.tq
        with np.errstate(invalid="ignore", over="ignore"):
            q, k, v = self.grouped_heads(inputs)
            o = self.attend_heads(q, k, v, inputs)
            g = np.asarray(cotangent, dt)
            d_o = self.split_heads(g @ w["W_o"].T, c.num_heads).reshape(o.shape)
            row = (d_o * o).sum(axis=-1, keepdims=True)
            d_q, d_k, d_v = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
            for k0 in range(0, self.key_limit(inputs, tq), self.block_k):
                k1 = min(inputs.tk, k0 + self.block_k)
                masks = self.backward_masks(inputs, tq, k0, k1)
                p = self.recompute_weights(q @ k[..., k0:k1, :].swapaxes(-1, -2),
                                           *(None if m is None else self._group_view(m) for m in masks))
                d_p = d_o @ v[..., k0:k1, :].swapaxes(-1, -2)
                d_s = self.score_gradient(p, d_p, row)
                d_v[..., k0:k1, :] = self.value_gradient(p, d_o).sum(axis=2, keepdims=True)
                d_k[..., k0:k1, :] = (d_s.swapaxes(-1, -2) @ q).sum(axis=2, keepdims=True)
                d_q += d_s @ k[..., k0:k1, :]
            heads = dict(zip("qkv", self.head_gradients(d_q.reshape(b, c.num_heads, tq, c.d_head)
                                                        * dt.type(self.scale()), d_k[:, :, 0], d_v[:, :, 0])))
            grads = {"W_o": np.einsum("btd,bte->de", self.merge_heads(o.reshape(heads["q"].shape)), g)}
            for name, which in (("query", "q"), ("key", "k"), ("value", "v")):
                d_proj = self.merge_heads(heads[which])
                grads[f"W_{which}"] = np.einsum("btd,bte->de", np.asarray(getattr(inputs, name), dt), d_proj)
                grads[name] = d_proj @ w[f"W_{which}"].T
                if f"b_{which}" in w:
                    grads[f"b_{which}"] = d_proj.sum(axis=(0, 1))
            if "b_o" in w:
                grads["b_o"] = g.sum(axis=(0, 1))
        return grads


class TiledBackwardBlockSoftmax(_HandWrittenBackward):
    """A FlashAttention-2-style backward over 16-key blocks whose weights are each block's own softmax (the block's
    maximum and sum) where they must be exp(s - lse) with the row's log-sum-exp: exact while one block holds
    every key."""

    def __init__(self, params, dtype):
        super().__init__(params, dtype, block_k=16)


class GradientWithoutSoftmaxRowTerm(_HandWrittenBackward):
    def score_gradient(self, p, d_p, row):  # the softmax differentiated as if each weight saw only its own score
        return p * d_p


class GradientScoreScaleLeftOut(_HandWrittenBackward):
    def score_gradient(self, p, d_p, row):  # dQ = dS K and dK = dS^T Q, the forward's 1/sqrt(d_head) left out
        return super().score_gradient(p, d_p, row) / self.dtype.type(self.scale())


class GradientWeightsFromRowMax(_HandWrittenBackward):
    """Recomputes the weights as exp(s - m) with the row maximum where the log-sum-exp belongs (a forward that saves
    its running maximum without + log(rowsum)): unnormalised, each row's weights sum to its rowsum."""

    def recompute_weights(self, scores, allowed, additive):
        scores = self.masked_scores(scores, allowed, additive)
        top = scores.max(axis=-1, keepdims=True)
        return np.exp(scores - np.where(np.isfinite(top), top, 0))


class GradientKeyValueSwapped(_HandWrittenBackward):
    """Returns the heads' dK where dV belongs and dV where dK belongs (a stranger's custom_vjp returned its results
    in the wrong order)."""

    def head_gradients(self, d_q, d_k, d_v):
        return d_q, d_v, d_k


class GradientNaNInRowsWithoutKeys(_HandWrittenBackward):
    """Recomputes the weights of a row without a visible key as 0 / 0 (NaN) while the forward outputs zeros there:
    the backward's own NaN, which reaches every key's gradient (as autodiff through a where that selects 0 over a
    NaN branch does: the double-where trap)."""

    def recompute_weights(self, scores, allowed, additive):
        scores = self.masked_scores(scores, allowed, additive)
        with np.errstate(invalid="ignore"):
            e = np.exp(scores - scores.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)


class GradientRecomputedWithoutMasks(_HandWrittenBackward):
    def backward_masks(self, inputs, tq, k0, k1):  # the forward masks; the backward's recomputed softmax does not
        return None, None


class GradientRecomputedWithoutWindow(_HandWrittenBackward):
    """A hand-written backward that recomputes its softmax with the call's masks but not the layer's sliding window,
    which its forward applies: every key behind a query's window gets a gradient from it."""

    def block_mask(self, inputs, q0, q1, k0, k1):
        return block_mask(inputs, q0, q1, k0, k1, sliding_window=self.config.sliding_window)


def _full_width_kv(config: AttentionConfig):
    d = config.d_model
    shapes = {"W_q": (d, d), "W_k": (d, d), "W_v": (d, d), "W_o": (d, d)}
    if config.bias:
        shapes.update(b_q=(d,), b_k=(d,), b_v=(d,), b_o=(d,))
    return shapes


MUTANTS = (
    Mutant("mutant-split-tokens", "splits tokens instead of features (reshape(h, T, d_head))", SplitTokens, "head"),
    Mutant("mutant-scale-sqrt-d-model", "divides scores by sqrt(d_model)", ScaleByDModel, "sqrt(d_model)"),
    Mutant("mutant-scale-inverse-d-head", "divides scores by d_head instead of sqrt(d_head)", ScaleByDHead,
           "1/d_head"),
    Mutant("mutant-no-scale", "leaves scores unscaled", NoScale, "no scaling"),
    Mutant("mutant-no-output-projection", "forgets W_o", NoOutputProjection, "W_o"),
    Mutant("mutant-causal-one-future-token", "causal mask lets one future token through", CausalOneFutureToken,
           "causal leak"),
    Mutant("mutant-causal-excludes-diagonal", "causal mask hides the diagonal (query i cannot see key i)",
           CausalExcludesDiagonal, "diagonal"),
    Mutant("mutant-causal-chunk-relative-queries", "processes queries in chunks of 256 and builds each chunk's causal "
           "mask from chunk-relative query indices (query i >= 256 sees keys 0..i mod 256)",
           CausalFromChunkRelativeQueries, "chunk-relative query index"),
    Mutant("mutant-causal-always-top-left", "bottom-right causal treated as top-left when Tq != Tk",
           CausalAlwaysTopLeft, "top-left alignment"),
    Mutant("mutant-causal-offset-negated", "builds the bottom-right causal mask with its diagonal offset negated "
           "(tril(diagonal=Tq - Tk) where diagonal=Tk - Tq belongs)", CausalOffsetNegated, "offset negated"),
    Mutant("mutant-padding-ignored", "ignores the key padding mask", PaddingIgnored, "padding"),
    Mutant("mutant-padding-on-query-axis", "broadcasts the key padding mask along the query axis (padded positions' "
           "queries see no key; every query sees the padded keys)", PaddingOnQueryAxis, "along the query axis"),
    Mutant("mutant-padding-masked-to-query-length", "masks padded keys in a loop over the query length (for j in "
           "range(q.shape[1])): with fewer queries than keys, the padded keys behind them are seen",
           PaddingLoopOverQueryLength, "first Tq"),
    Mutant("mutant-additive-mask-ignored", "drops the finite values of a float attn_mask (keeps only -inf)",
           AdditiveMaskIgnored, "additive-masked output"),
    Mutant("mutant-mask-polarity-inverted", "reads attn_mask True as 'masked out'", MaskPolarityInverted, "INVERTED"),
    Mutant("mutant-softmax-no-max-subtraction", "softmax without subtracting the row maximum",
           SoftmaxWithoutMaxSubtraction, "row maximum"),
    Mutant("mutant-attn-mask-transposed", "reads its attn_mask transposed (an outside user's Equinox copy; Tq = Tk "
           "only, where its shapes fit)", AttnMaskTransposed, "attn_mask transposed", cross_attention=False),
    Mutant("mutant-fully-masked-rows-nan", "fully masked rows divide 0 by 0 (NaN)", FullyMaskedRowsNaN,
           "fully masked rows"),
    Mutant("mutant-additive-masked-row-nan", "a row of -inf float-mask biases divides 0 by 0 (NaN); rows the bool and "
           "padding masks empty are zeros", AdditiveMaskedRowNaN, "fully masked rows"),
    Mutant("mutant-heads-reversed", "concatenates heads in reverse order", HeadsConcatenatedReversed, "head"),
    Mutant("mutant-heads-merged-feature-major", "reads W_o per head as reshape(d_head, heads, d_model) transposed: "
           "feature j of head h meets row j * heads + h of W_o (the heads concatenated feature-major)",
           OutputKernelHeadsSwapped, "heads concatenated in the wrong order"),
    Mutant("mutant-kv-heads-tiled", "expands grouped-query key/value heads by tiling (query head h reads key/value "
           "head h % kv_heads; torch .repeat where repeat_interleave belongs)", KVHeadsTiled, "h % kv_heads"),
    Mutant("mutant-keys-from-query", "a shared-K/V attention layer projects its keys from x_q instead of x_kv (k = "
           "W_k(x_q); the values from x_kv; Tq = Tk only, where its shapes fit)", KeysFromQuery,
           "keys projected from the query input", inputs="shared_kv", cross_attention=False),
    Mutant("mutant-batch-normalised-together", "softmax normaliser shared across batch items",
           BatchNormalisedTogether, "batch"),
    Mutant("mutant-value-bias-dropped", "drops the bias of the V projection", ValueBiasDropped, "output"),
    Mutant("mutant-dropout-at-inference", "leaves dropout on at inference", DropoutAtInference, "determinism"),
    Mutant("mutant-nan-poison-leaks", "masked keys holding NaN poison outputs via 0 * NaN in P @ V",
           NaNPoisonLeaks, "nan"),
    Mutant("mutant-no-input-validation", "skips input validation (bad shapes crash or pass silently)",
           NoInputValidation, "bad input"),
    Mutant("mutant-query-reused-as-scratch", "reuses the caller's query array as scratch space after projecting it "
           "(its outputs are right)", QueryReusedAsScratch, "wrote into its inputs"),
    Mutant("mutant-kv-not-shrunk", "allocates full-width K/V projections for grouped-query heads",
           NumpyNaiveLoaded, "parameter count", parameter_shapes=_full_width_kv),
    Mutant("mutant-gradient-flows-to-future", "backward ignores the causal mask", GradientFlowsToFutureKeys,
           "causal leak in gradients", gradients=True),
    Mutant("mutant-gradient-ignores-padding", "backward ignores the key padding mask the forward applies (a "
           "stranger's Flax copy passed check before the gradient case had mask variants)", GradientIgnoresPadding,
           "ignores the key padding mask", gradients=True),
    Mutant("mutant-gradient-w-o-transposed", "returns the W_o gradient transposed", GradientOfWoTransposed,
           "W_o is the reference's transposed", gradients=True),
    Mutant("mutant-one-x-gradient-summed", "a separate-form layer given one x (query is key is value) returns the "
           "total d/dx as each of the query, key and value gradients (one leaf used three times)", OneXGradientSummed,
           "total d/dx", gradients=True),
    Mutant("mutant-tiled-causal-blocks-top-left", "a tiled kernel (16-key blocks) skips the key blocks past the "
           "top-left diagonal also under bottom-right alignment", TiledKeyBlocksTopLeft, "bottom-right causal output"),
    Mutant("mutant-tiled-backward-block-softmax", "a tiled backward (16-key blocks) recomputes each block's weights "
           "as that block's own softmax instead of exp(s - lse) with the row's log-sum-exp",
           TiledBackwardBlockSoftmax, "gradient of", gradients=True),
    Mutant("mutant-gradient-no-softmax-row-term", "a hand-written backward takes the softmax's backward as dS = P * "
           "dP, leaving out its row term - P * rowsum(dP * P) (the forward is right)", GradientWithoutSoftmaxRowTerm,
           "no row term", gradients=True),
    Mutant("mutant-gradient-score-scale-left-out", "a hand-written backward leaves the 1/sqrt(d_head) score scale "
           "out of dQ and dK (the forward applies it)", GradientScoreScaleLeftOut, "leaves out the 1/sqrt(d_head)",
           gradients=True),
    Mutant("mutant-gradient-recomputed-without-masks", "a hand-written backward recomputes the softmax weights "
           "without the masks the forward applied (its forward output is right)", GradientRecomputedWithoutMasks,
           "recomputes the weights without", gradients=True),
    Mutant("mutant-sliding-window-backward-without-window", "a hand-written backward recomputes the softmax "
           "weights with the call's masks but without the layer's sliding window (its forward output is right)",
           GradientRecomputedWithoutWindow, "recomputes the weights without the layer's sliding window",
           gradients=True, sliding_window=True),
    Mutant("mutant-tiled-no-rescale", "a tiled kernel (16-key blocks) never rescales its accumulator and row sum "
           "when the running maximum grows", TiledNoRescale, "never rescales its accumulator"),
    Mutant("mutant-tiled-accumulator-not-rescaled", "a tiled kernel (16-key blocks) rescales its row sum but not its "
           "accumulator when the running maximum grows", TiledAccumulatorNotRescaled,
           "never rescales its accumulator (the row sum is rescaled)"),
    Mutant("mutant-tiled-masked-block-nan", "a tiled kernel (16-key blocks) shifts and rescales by an unguarded "
           "running maximum: a block with no visible key makes -inf - -inf = NaN (a stranger's kernel)",
           TiledMaskedBlockNaN, "a key block with no visible key corrupts"),
    Mutant("mutant-gradient-weights-from-row-max", "a hand-written backward recomputes the weights as exp(s - m) with "
           "the row maximum where the log-sum-exp belongs (the forward is right)", GradientWeightsFromRowMax,
           "exp(s - m) with the row maximum", gradients=True),
    Mutant("mutant-gradient-key-value-swapped", "a hand-written backward returns the heads' dK where dV belongs and "
           "dV where dK belongs (a stranger's custom_vjp)", GradientKeyValueSwapped, "key and value gradients swapped",
           gradients=True),
    Mutant("mutant-gradient-nan-in-rows-without-keys", "a hand-written backward recomputes the weights of a row "
           "without a visible key as 0 / 0 (NaN) while the forward outputs zeros there", GradientNaNInRowsWithoutKeys,
           "the NaN is the backward's own", gradients=True),
    # a padding-only layer (no attn_mask declared) has no row emptied by an attn_mask: its rows without a key come
    # from a batch item whose keys are all padded (an outside user's custom_vjp took exp(s - lse) with lse = -inf)
    Mutant("mutant-gradient-nan-in-fully-padded-item", "a padding-only layer (BERT's masks, no attn_mask) whose "
           "hand-written backward recomputes the weights of a batch item with every key padded as 0 / 0 (NaN) while "
           "the forward outputs zeros there", GradientNaNInRowsWithoutKeys, "every key padded", gradients=True,
           attn_masks=False),
    Mutant("mutant-tiled-block-mask-of-first-item", "a tiled kernel (16-key blocks) classifies its key blocks by batch "
           "item 0's masks for the whole batch (FlexAttention's create_block_mask(B=None) with a mask_mod that reads "
           "the batch index: an outside user's layer)", TiledBlockMaskOfFirstItem, "padding"),
    Mutant("mutant-tiled-running-max-from-zero", "a tiled kernel (16-key blocks) starts its running row maximum at 0 "
           "instead of -inf (a stranger's kernel): rows whose every score is far below 0 underflow to zeros",
           TiledRunningMaxFromZero, "far below 0"),
    Mutant("mutant-kv-weights-swapped", "a wrapper that loads W_k into the value projection and W_v into the key "
           "projection (an outside user's Equinox copy)", KVWeightsSwapped, "W_k and W_v loaded into each other's"),
    Mutant("mutant-qk-weights-swapped", "a wrapper that splits a fused qkv weight as [W_k | W_q | W_v] (an outside "
           "user's timm copy)", QKWeightsSwapped, "W_q and W_k loaded into each other's", grouped_query=False),
    Mutant("mutant-fused-qkv-blocks-into-per-head", "a GPT-NeoX-style self-attention layer (query_key_value read "
           "per head) loaded with [W_q | W_k | W_v] in blocks (an outside user's GPT-NeoX copy)",
           FusedQKVBlocksIntoPerHead, "a fused qkv weight loaded as", inputs="self", grouped_query=False),
    Mutant("mutant-weights-untransposed", "a wrapper that loads W into an (out, in) Linear where W.T belongs (an "
           "outside user's Equinox copy)", WeightsUntransposed, "loaded untransposed", grouped_query=False),
    Mutant("mutant-qk-norm-over-projection", "a per-head q/k norm (Qwen 3's) taken over the whole projection (OLMo "
           "2's axis)", QKNormOverProjection, "over the whole projection", qk_norms=("rms_per_head",)),
    Mutant("mutant-qk-norm-gains-not-loaded", "a wrapper that never loads the q/k norms' gains (the module keeps "
           "its initial ones)", QKNormGainsNotLoaded, "without its gains", qk_norms=("rms_per_head",)),
    Mutant("mutant-qk-norm-gain-plus-one", "a Gemma-style q/k norm, x * (1 + weight), loaded with the gains "
           "themselves", QKNormGainPlusOne, "1 + g", qk_norms=("rms_per_head",)),
    Mutant("mutant-qk-norm-gains-swapped", "a wrapper that loads g_q into the k norm and g_k into the q norm (an "
           "outside user's Qwen 3 copy: the forward is the same)", QKNormGainsSwapped, "loaded into each other's norms",
           gradients=True, qk_norms=("rms_per_head",)),
    Mutant("mutant-qk-layer-norm-not-centred", "a LayerNorm on q and k (timm's) computed as an RMSNorm: the mean "
           "is never subtracted", QKLayerNormNotCentred, "an RMSNorm over each head's", qk_norms=("layer_per_head",)),
    Mutant("mutant-qk-rms-norm-module-for-layer-norm", "torch.nn.RMSNorm swapped in for timm's q/k LayerNorms (no "
           "mean subtracted, no bias; an outside user's timm copy)", QKRMSNormModuleForLayerNorm,
           "without the LayerNorm's bias", qk_norms=("layer_per_head",)),
    Mutant("mutant-qk-layer-norm-biases-not-loaded", "a wrapper that never loads the q/k LayerNorms' biases (timm's: "
           "the norms keep their initial zeros)", QKLayerNormBiasesNotLoaded, "without its biases beta_q and beta_k",
           qk_norms=("layer_per_head",)),
    Mutant("mutant-qk-norm-eps-default", "q/k LayerNorms built with torch's default epsilon 1e-5 where the config "
           "says 1e-6 (timm's nn.LayerNorm)", QKNormEpsDefault, "built with epsilon 1e-05",
           qk_norms=("layer_per_head",)),
    Mutant("mutant-qk-rms-norm-centred", "an RMSNorm on q and k (Qwen 3's) computed as a LayerNorm: each head's mean "
           "is subtracted first", QKRMSNormCentred, "a LayerNorm over each head's", qk_norms=("rms_per_head",)),
    Mutant("mutant-qk-norm-key-forgotten", "normalises q but never calls its k norm", QKNormKeyForgotten,
           "k is not normed", qk_norms=("rms_over_projection",)),
    Mutant("mutant-rotary-other-pairing", "rotary embeddings that pair features 2i and 2i + 1 where the layer's "
           "rotate_half pairs i and i + d_head/2, and the other way round (Meta's Llama weights in a Hugging Face "
           "layer without the W_q/W_k permutation)", RotaryOtherPairing, "pairs features", rotary=ROTARY_KINDS),
    Mutant("mutant-rotary-base-default", "rotary embeddings built with base 10,000 whatever config.rotary_base says "
           "(Llama 3's rope_theta never passed on)", RotaryBaseDefault, "base 10000", rotary=ROTARY_KINDS),
    Mutant("mutant-rotary-partial-whole-head", "a partial rotary (rotary_dims of each head's features) that turns "
           "the whole head (rotary_pct or partial_rotary_factor never passed on)", RotaryPartialWholeHead,
           "turn every feature of each head", rotary=ROTARY_KINDS, partial_rotary=True),
    Mutant("mutant-rotary-partial-frequencies-over-head", "a partial rotary whose frequencies are over d_head, base ** "
           "(-2i / d_head), where they are over the rotary_dims features turned", RotaryPartialFrequenciesOverHead,
           "frequencies over all d_head", rotary=ROTARY_KINDS, partial_rotary=True),
    Mutant("mutant-rotary-scaling-ignored", "rotary frequencies never rescaled whatever config.rotary_scaling says "
           "(Llama 3.1's rope_type 'llama3' lost on the way to the module)", RotaryScalingIgnored,
           "frequencies lack the", rotary=ROTARY_KINDS, rotary_scalings=ROTARY_SCALING_KINDS),
    Mutant("mutant-yarn-without-attention-factor", "YaRN's frequencies rescaled but q and k not multiplied by its "
           "attention factor (transformers' attention_scaling on cos and sin left out)", YarnWithoutAttentionFactor,
           "without its attention factor", rotary=ROTARY_KINDS, rotary_scalings=("yarn",)),
    Mutant("mutant-sliding-window-ignored", "declares a sliding window but never applies it (every key up to the "
           "query seen)", SlidingWindowIgnored, "without its sliding window", sliding_window=True),
    Mutant("mutant-sliding-window-one-key-too-wide", "a sliding window of w + 1 keys where config.sliding_window = w "
           "(flash-attn's window_size=(w, 0) where (w - 1, 0) belongs)", SlidingWindowOneKeyTooWide,
           "one key too wide", sliding_window=True),
    Mutant("mutant-sliding-window-from-query-index", "counts the sliding window back from each query's index in "
           "the call, not its position (a KV-cache step's window ignores the cached positions)",
           SlidingWindowFromQueryIndex, "measured from each query's index", sliding_window=True),
    Mutant("mutant-alibi-slopes-reversed", "ALiBi with the paper's slopes in reverse head order",
           AlibiSlopesReversed, "slopes in reverse head order", alibi=ALIBI_KINDS),
    Mutant("mutant-alibi-slopes-power-of-two-formula", "ALiBi slopes 2 ** (-8 h / n) at every head count (wrong "
           "where n is not a power of two)", AlibiSlopesPowerOfTwoFormula, "2 ** (-8 h / n)", alibi=ALIBI_KINDS),
    Mutant("mutant-alibi-queries-from-index", "ALiBi with query i at position i, not i + Tk - Tq (a KV-cache "
           "step's bias that ignores the cached positions)", AlibiQueriesFromIndex, "puts query i at position i",
           alibi=ALIBI_KINDS),
    Mutant("mutant-alibi-always-symmetric", "ALiBi as -m |p - s| where config.alibi = 'linear' asks for the "
           "paper's -m (p - s)", AlibiAlwaysSymmetric, "where config.alibi = 'linear'", alibi=ALIBI_KINDS),
    Mutant("mutant-rotary-keys-not-turned", "turns q by its rotary embeddings but not k", RotaryKeysNotTurned,
           "k is not turned", rotary=ROTARY_KINDS),
    Mutant("mutant-rotary-left-out-on-causal-path", "a decoder layer whose causal calls take a fast path that never "
           "turns q and k (rotary applied only on the general path)", RotaryLeftOutOnCausalPath,
           "no rotary embeddings at all", rotary=ROTARY_KINDS, qk_norms=("rms_per_head",)),
    Mutant("mutant-rotary-queries-from-zero", "turns the queries of a call with fewer queries than keys (a KV-cache "
           "step) at positions 0 .. Tq - 1, not Tk - Tq .. Tk - 1 (position_ids never offset by the cache length)",
           RotaryQueriesFromZero, "positions 0 .. Tq - 1", rotary=ROTARY_KINDS),
    Mutant("mutant-rotary-before-norm", "turns q and k by rotary before their per-head RMSNorm, not after it (Qwen 3 "
           "norms, then turns)", RotaryBeforeNorm, "before their q/k norm", qk_norms=("rms_per_head",),
           rotary=ROTARY_KINDS),
    Mutant("mutant-rotary-backward-turns-forward", "a hand-written rotary backward turns the gradients of q and k by "
           "the forward's angles again, not back (the forward's sin where -sin belongs; its forward is right)",
           RotaryBackwardTurnsForward, "turned by the rotary angles again", gradients=True, rotary=ROTARY_KINDS),
    Mutant("mutant-decode-step-attends-before-writing", "a KV-cache decode step attends over its cache before it "
           "writes x_new's keys and values into it (its forward is right)", DecodeStepAttendsBeforeWriting,
           "attends before it writes"),
)


FORM_WORDS = {"shared_kv": "shared-K/V module (x_q, x_kv)", "self": "GPT-2-style self-attention module (one x)"}


def in_every_form(mutant: Mutant, forms=("separate", *MODULES)) -> tuple[Mutant, ...]:
    """The mutant as given (separate query/key/value) plus, for each other form, the same bug composed with the
    module of that form, named ``<name>-shared-kv`` / ``<name>-self``."""
    out = []
    for form in forms:
        if form == "separate":
            out.append(mutant)
            continue
        module = MODULES[form]
        loaded = type(f"{mutant.loaded.__name__}{module.__name__}", (mutant.loaded, module), {})
        globals()[loaded.__name__] = loaded  # picklable by name: the isolated workers receive the backend pickled
        out.append(Mutant(f"{mutant.name}-{form.replace('_', '-')}", f"{mutant.bug}, in a {FORM_WORDS[form]}", loaded,
                          mutant.message_mentions, mutant.gradients, mutant.parameter_shapes, inputs=form))
    return tuple(out)


#: bugs the suite once caught only at T = 8192 (or not at all for one-x modules), now named and in every form
MUTANTS += (
    *in_every_form(Mutant("mutant-causal-mask-never-applied", "declares causal masking but never applies it",
                          CausalMaskNeverApplied, "causal leak")),
    *in_every_form(Mutant("mutant-mask-after-softmax", "applies the masks after the softmax without renormalising",
                          MaskAfterSoftmax, "without renormalising")),
    *in_every_form(Mutant("mutant-future-key-in-denominator", "the softmax normaliser also sums key i + 1 "
                          "(the numerator is causal)", FutureKeyInDenominator, "causal leak")),
    *in_every_form(Mutant("mutant-padded-keys-in-denominator", "padded keys get weight 0 but enter the softmax "
                          "normaliser", PaddedKeysInDenominator, "padding leak")),
    *in_every_form(Mutant("mutant-softmax-no-max-subtraction", "softmax without subtracting the row maximum",
                          SoftmaxWithoutMaxSubtraction, "row maximum"), forms=("self",)),
    *in_every_form(Mutant("mutant-causal-mask-reversed", "builds the causal mask with triu instead of tril (query i "
                          "sees the future, keys i and later)", CausalMaskReversed, "reversed causal mask"),
                   forms=("separate", "self")),
    Mutant("mutant-padding-dropped-when-causal", "forgets the key padding mask when causal masking is on",
           PaddingDroppedWhenCausal, "without key_padding_mask: that mask is dropped"),
    Mutant("mutant-attn-mask-replaces-causal", "an explicit attn_mask replaces the causal mask instead of joining it",
           AttnMaskReplacesCausal, "without the causal mask (top-left): that mask is dropped"),
)


class MutantBackend(NumpyNaive):
    """A registered-looking backend that carries one mutant's bug."""

    def __init__(self, mutant: Mutant, *, weights: bool = True):
        self.mutant = mutant
        self.name = mutant.name
        # float32 only and T <= 512 keep the zoo fast: no mutant's bug depends on float64 or on T = 1000
        self.capabilities = Capabilities(dtypes=("float32",), gradients=mutant.gradients, max_seq_len=512,
                                         inputs=mutant.inputs, attention_weights=weights,
                                         cross_attention=mutant.cross_attention, qk_norms=mutant.qk_norms,
                                         grouped_query=mutant.grouped_query, rotary=mutant.rotary,
                                         partial_rotary=mutant.partial_rotary,
                                         rotary_scalings=mutant.rotary_scalings,
                                         sliding_window=mutant.sliding_window, alibi=mutant.alibi,
                                         bool_attn_mask=mutant.attn_masks, additive_attn_mask=mutant.attn_masks)
        self.loaded_class = mutant.loaded

    def native_parameter_shapes(self, config):
        if self.mutant.parameter_shapes:
            return self.mutant.parameter_shapes(config)
        return super().native_parameter_shapes(config)

    def load_native(self, params, dtype):
        loaded = self.loaded_class(params, dtype)
        loaded._params = params
        return loaded


def mutant_backends(*, weights: bool = True) -> list[MutantBackend]:
    """Every mutant as a backend (an entry-point-style factory; not registered by default). ``weights=False``
    gives mutants that declare no attention weights, like most fast kernels: they must be caught on outputs."""
    return [MutantBackend(m, weights=weights) for m in MUTANTS]
