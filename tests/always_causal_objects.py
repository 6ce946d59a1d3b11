"""Always-causal modules, the attention decoders are written with, declared with ``Capabilities(always_causal=True)``:
nanoGPT's ``CausalSelfAttention`` (one x, one fused c_attn projection, a causal buffer it always applies), the same
with the classic mask and head-split bugs, and the built-in dense NumPy layer restricted to one alignment (a decode
kernel that always aligns the queries at the end of the keys), which asserts that every call it gets is causal."""
from __future__ import annotations

import dataclasses

import numpy as np

import mha_harness
from mha_harness.contract.numerics import weighted_values
from mha_harness.implementations.numpy_naive import NumpyNaive


class _GPTLoaded(mha_harness.LoadedAttention):
    def __init__(self, params, dtype, module):
        cat = np.concatenate
        self.dtype, self.module = np.dtype(dtype), module
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
        m = self.module
        if m.split_tokens:  # x.view(B, h, T, d_head): each head holds a block of tokens, not its features
            q, k, v = (part.reshape(b, h, t, c // h) for part in (q, k, v))
        else:
            q, k, v = (part.reshape(b, t, h, c // h).transpose(0, 2, 1, 3) for part in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(c // h)
        if m.masked:  # the registered buffer: tril(ones(T, T)); future_keys_seen > 0 is the off-by-one bug
            ones = np.ones((t, t), bool)
            keep = np.triu(ones) if m.reversed_mask else np.tril(ones, k=m.future_keys_seen)
            att = np.where(keep, att, -np.inf)
        att = np.exp(att - att.max(axis=-1, keepdims=True))
        att = att / att.sum(axis=-1, keepdims=True)
        y = weighted_values(att, v)
        y = y.reshape(b, t, c) if m.split_tokens else y.transpose(0, 2, 1, 3).reshape(b, t, c)
        return mha_harness.AttentionOutput(y @ self.c_proj_w + self.c_proj_b)


class GPTCausalSelfAttention(mha_harness.AttentionBackend):
    """nanoGPT's CausalSelfAttention: one x, biases, always top-left causal; no masks, weights or gradients."""

    name = "gpt-causal-self-attention"
    capabilities = mha_harness.Capabilities(inputs="self", always_causal=True, causal_alignments=("top-left",),
                                            key_padding_mask=False, bool_attn_mask=False, additive_attn_mask=False,
                                            grouped_query=False)
    native_causal = "always: a registered tril buffer (top-left)"
    future_keys_seen, masked, reversed_mask, split_tokens = 0, True, False, False

    def load_native(self, params, dtype):
        return _GPTLoaded(params, dtype, self)

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


class GPTCausalSelfAttentionReversedMask(GPTCausalSelfAttention):
    """torch.triu where torch.tril belongs: every position sees itself and the future."""

    name = "gpt-reversed-mask"
    reversed_mask = True


class GPTCausalSelfAttentionSplitTokens(GPTCausalSelfAttention):
    """Heads split (and merged) with a plain view, no transpose: tokens instead of features."""

    name = "gpt-split-tokens"
    split_tokens = True


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
