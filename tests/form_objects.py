"""Self-attention and shared-K/V modules, correct and without a causal mask, wrapped the two documented ways:
``function_backend`` with the lesson's own signature, and an ``AttentionBackend`` subclass declaring its form."""
from __future__ import annotations

import numpy as np

import mha_harness
from mha_harness.contract.numerics import weighted_values


def _softmax(z):
    z = np.where(np.isnan(z), -np.inf, z) if np.isnan(z).any() and np.isneginf(z).any() else z
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _attention(x_q, x_kv, W_q, W_k, W_v, W_o, num_heads, causal, apply_causal=True):
    t_q, d_model = x_q.shape
    t_k, d_head = x_kv.shape[0], d_model // num_heads

    def split_heads(m, t):  # (T, d_model) -> (h, T, d_head): split the FEATURE axis
        return m.reshape(t, num_heads, d_head).transpose(1, 0, 2)
    q, k, v = split_heads(x_q @ W_q, t_q), split_heads(x_kv @ W_k, t_k), split_heads(x_kv @ W_v, t_k)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(d_head)
    if causal and apply_causal:
        scores = np.where(np.tril(np.ones((t_q, t_k), bool)), scores, -np.inf)
    # weighted_values: a masked key holding NaN/inf contributes nothing (a dense P @ V would give 0 * NaN = NaN)
    return weighted_values(_softmax(scores), v).transpose(1, 0, 2).reshape(t_q, d_model) @ W_o


def multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads, causal=False):
    """The lesson's multi_head.py as a function of one X (self-attention)."""
    return _attention(X, X, W_q, W_k, W_v, W_o, num_heads, causal)


def multi_head_attention_no_mask(X, W_q, W_k, W_v, W_o, num_heads, causal=False):
    """The same module with the classic bug: it accepts causal=True and never applies the mask."""
    return _attention(X, X, W_q, W_k, W_v, W_o, num_heads, causal, apply_causal=False)


def cross_attention(x_q, x_kv, W_q, W_k, W_v, W_o, num_heads, causal=False):
    """Encoder-decoder attention: one x_kv makes both K and V."""
    return _attention(x_q, x_kv, W_q, W_k, W_v, W_o, num_heads, causal)


LessonSelf = mha_harness.function_backend(multi_head_attention, name="lesson-self", causal=True)
LessonSelfNoMask = mha_harness.function_backend(multi_head_attention_no_mask, name="lesson-self-no-mask", causal=True)
LessonSharedKV = mha_harness.function_backend(cross_attention, name="lesson-shared-kv", causal=True)


class _SelfLoaded(mha_harness.LoadedAttention):
    def __init__(self, params, dtype, apply_causal):
        self.w = [np.asarray(a, dtype) for a in (params.W_q, params.W_k, params.W_v, params.W_o)]
        self.dtype, self.apply_causal = dtype, apply_causal

    def compute(self, inputs, *, need_weights=False):
        assert inputs.query is inputs.key is inputs.value  # one x, by the declared form
        x = np.asarray(inputs.query, self.dtype)
        out = np.stack([_attention(item, item, *self.w, self.config.num_heads, bool(inputs.causal), self.apply_causal)
                        for item in x])
        return mha_harness.AttentionOutput(out)


class SelfAttentionModule(mha_harness.AttentionBackend):
    """A self-attention module as a full backend: declares inputs='self' and top-left causal masking."""

    name = "self-module"
    capabilities = mha_harness.Capabilities(inputs="self", causal_alignments=("top-left",), key_padding_mask=False,
                                            bool_attn_mask=False, additive_attn_mask=False, attention_weights=False,
                                            grouped_query=False, bias=False, native_parameters=False)
    apply_causal = True

    def load_native(self, params, dtype):
        return _SelfLoaded(params, dtype, self.apply_causal)


class SelfAttentionModuleNoMask(SelfAttentionModule):
    name = "self-module-no-mask"
    apply_causal = False
