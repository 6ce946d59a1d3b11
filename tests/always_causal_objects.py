"""Always-causal modules, the attention decoders are written with, declared with ``Capabilities(always_causal=True)``:
nanoGPT's ``CausalSelfAttention`` (one x, one fused c_attn projection, a causal buffer it always applies), the same
with the two classic mask bugs, and the built-in dense NumPy layer restricted to one alignment (a decode kernel that
always aligns the queries at the end of the keys), which asserts that every call it gets is causal."""
from __future__ import annotations

import dataclasses

import numpy as np

import mha_harness
from mha_harness.contract.numerics import weighted_values
from mha_harness.implementations.numpy_naive import NumpyNaive


class _GPTLoaded(mha_harness.LoadedAttention):
    def __init__(self, params, dtype, future_keys_seen, masked):
        cat = np.concatenate
        self.dtype, self.future_keys_seen, self.masked = np.dtype(dtype), future_keys_seen, masked
        # nanoGPT: c_attn = Linear(d_model, 3 d_model) makes q, k, v at once; c_proj = Linear(d_model, d_model)
        self.c_attn_w = cat([params.W_q, params.W_k, params.W_v], axis=1).astype(self.dtype)
        self.c_proj_w = params.W_o.astype(self.dtype)
        bias = params.config.bias
        self.c_attn_b = cat([params.b_q, params.b_k, params.b_v]).astype(self.dtype) if bias else 0
        self.c_proj_b = params.b_o.astype(self.dtype) if bias else 0

    def compute(self, inputs, *, need_weights=False):
        x = np.asarray(inputs.query, self.dtype)  # one x; no causal flag to read: the module always masks
        b, t, c = x.shape
        h = self.config.num_heads
        q, k, v = np.split(x @ self.c_attn_w + self.c_attn_b, 3, axis=-1)
        q, k, v = (m.reshape(b, t, h, c // h).transpose(0, 2, 1, 3) for m in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(c // h)
        if self.masked:  # the registered buffer: tril(ones(T, T)); future_keys_seen > 0 is the off-by-one bug
            att = np.where(np.tril(np.ones((t, t), bool), k=self.future_keys_seen), att, -np.inf)
        att = np.exp(att - att.max(axis=-1, keepdims=True))
        att = att / att.sum(axis=-1, keepdims=True)
        y = weighted_values(att, v).transpose(0, 2, 1, 3).reshape(b, t, c)
        return mha_harness.AttentionOutput(y @ self.c_proj_w + self.c_proj_b)


class GPTCausalSelfAttention(mha_harness.AttentionBackend):
    """nanoGPT's CausalSelfAttention: one x, biases, always top-left causal; no masks, weights or gradients."""

    name = "gpt-causal-self-attention"
    capabilities = mha_harness.Capabilities(inputs="self", always_causal=True, causal_alignments=("top-left",),
                                            key_padding_mask=False, bool_attn_mask=False, additive_attn_mask=False,
                                            grouped_query=False)
    native_causal = "always: a registered tril buffer (top-left)"
    future_keys_seen, masked = 0, True

    def load_native(self, params, dtype):
        return _GPTLoaded(params, dtype, self.future_keys_seen, self.masked)

    def native_parameter_shapes(self, config):
        d = config.d_model
        shapes = {"c_attn.weight": (3 * d, d), "c_proj.weight": (d, d)}
        return shapes | ({"c_attn.bias": (3 * d,), "c_proj.bias": (d,)} if config.bias else {})


class GPTCausalSelfAttentionSeesNextToken(GPTCausalSelfAttention):
    """The off-by-one mask: tril(..., k=1) lets every position see the next one."""

    name = "gpt-sees-next-token"
    future_keys_seen = 1


class GPTCausalSelfAttentionWithoutMask(GPTCausalSelfAttention):
    """Declares always_causal but never applies its mask (the buffer was dropped in a refactor)."""

    name = "gpt-without-mask"
    masked = False


def gpt_attention(X, W_q, W_k, W_v, W_o, num_heads):
    """A function that always masks top-left and has no causal parameter, for ``function_backend(causal="always")``."""
    t, d_model = X.shape
    d_head = d_model // num_heads
    q, k, v = ((X @ w).reshape(t, num_heads, d_head).transpose(1, 0, 2) for w in (W_q, W_k, W_v))
    scores = np.where(np.tril(np.ones((t, t), bool)), q @ k.transpose(0, 2, 1) / np.sqrt(d_head), -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(t, d_model) @ W_o


GPTFunction = mha_harness.function_backend(gpt_attention, name="gpt-function", causal="always")


class _OneAlignmentLoaded(NumpyNaive.loaded_class):
    def compute(self, inputs, *, need_weights=False):
        if inputs.causal != self.alignment:
            raise AssertionError(f"an always-causal backend got causal={inputs.causal!r}, not {self.alignment!r}")
        return super().compute(inputs, need_weights=need_weights)


def _one_alignment(alignment: str) -> type[NumpyNaive]:
    class OneAlignment(NumpyNaive):
        name = f"numpy-naive-always-{alignment}"
        capabilities = dataclasses.replace(NumpyNaive.capabilities, always_causal=True,
                                           causal_alignments=(alignment,))

        def load_native(self, params, dtype):
            loaded = _OneAlignmentLoaded(params, dtype)
            loaded.alignment = alignment
            return loaded
    OneAlignment.__qualname__ = OneAlignment.__name__ = f"NaiveAlways{alignment.title().replace('-', '')}"
    return OneAlignment


NaiveAlwaysTopLeft = _one_alignment("top-left")
NaiveAlwaysBottomRight = _one_alignment("bottom-right")


class _DecodeLoaded(_OneAlignmentLoaded):
    def compute(self, inputs, *, need_weights=False):
        if inputs.tq > inputs.tk:
            raise AssertionError(f"a layer declaring more_queries_than_keys=False got Tq {inputs.tq} > Tk {inputs.tk}")
        return super().compute(inputs, need_weights=need_weights)


class NaiveDecodeKernel(NumpyNaive):
    """A KV-cache decode kernel: always bottom-right causal and Tq <= Tk only (the queries are the last Tq keys);
    it raises on any call that is not causal bottom-right or has more queries than keys."""

    name = "numpy-naive-decode-kernel"
    capabilities = dataclasses.replace(NumpyNaive.capabilities, always_causal=True, causal_alignments=("bottom-right",),
                                       more_queries_than_keys=False)

    def load_native(self, params, dtype):
        loaded = _DecodeLoaded(params, dtype)
        loaded.alignment = "bottom-right"
        return loaded
