"""The lesson's NumPy multi-head attention as an mha-harness backend (the full plugin example)."""
from __future__ import annotations

import numpy as np

from mha_harness import AttentionBackend, AttentionOutput, Capabilities, LoadedAttention, causal_offset


def softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class _Loaded(LoadedAttention):
    def __init__(self, params, dtype):
        self.W_q, self.W_k, self.W_v, self.W_o = (w.astype(dtype) for w in (params.W_q, params.W_k, params.W_v,
                                                                             params.W_o))
        self.h = params.config.num_heads
        self.dtype = dtype

    def compute(self, inputs, *, need_weights=False):
        h = self.h
        x_q, x_k, x_v = (np.asarray(a, self.dtype) for a in (inputs.query, inputs.key, inputs.value))
        b, tq, d_model = x_q.shape
        tk, d_head = x_k.shape[1], d_model // h

        def split_heads(m, t):  # (B, T, d_model) -> (B, h, T, d_head): split the FEATURE axis
            return m.reshape(b, t, h, d_head).transpose(0, 2, 1, 3)
        q, k, v = split_heads(x_q @ self.W_q, tq), split_heads(x_k @ self.W_k, tk), split_heads(x_v @ self.W_v, tk)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d_head)
        allowed = np.ones((b, 1, tq, tk), bool)
        if inputs.causal:
            offset = causal_offset(inputs.causal, tq, tk)
            allowed &= np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset
        if inputs.key_padding_mask is not None:
            allowed &= ~inputs.key_padding_mask[:, None, None, :]
        scores = np.where(allowed, scores, -1e30)
        weights = softmax(scores) * allowed  # fully masked rows -> zeros, the harness convention
        # NaN/inf is only accepted where a mask hides it; zero it so 0-weight products stay 0 (0 * NaN = NaN)
        v = np.where(np.isfinite(v), v, 0)
        heads = weights @ v
        concat = heads.transpose(0, 2, 1, 3).reshape(b, tq, d_model)  # glue heads side by side
        return AttentionOutput(concat @ self.W_o, weights if need_weights else None)


class LessonAttention(AttentionBackend):
    name = "lesson-mha"
    capabilities = Capabilities(bool_attn_mask=False, additive_attn_mask=False, grouped_query=False, bias=False,
                                attention_weights=True, dtypes=("float32", "float64"))
    # text for the report's policy table: this layer takes the harness's masks as they are
    native_causal = "explicit masks in both alignments"
    native_mask_polarity = "harness convention (key_padding_mask True = ignore)"

    def native_parameter_shapes(self, config):
        d = config.d_model
        return {"W_q": (d, d), "W_k": (d, d), "W_v": (d, d), "W_o": (d, d)}

    def load_native(self, params, dtype):
        return _Loaded(params, dtype)
