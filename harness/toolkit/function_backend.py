"""The few-line adapter: turn a plain NumPy attention function into a backend.

    def my_mha(query, key, value, W_q, W_k, W_v, W_o, num_heads, causal=False):
        ...  # (T, d_model) arrays in, (T, d_model) out -- the lesson's style
    backend = mha_harness.function_backend(my_mha, name="my-mha", causal=True)
    mha_harness.check(backend).ok

With ``batched=True`` the function gets (batch, T, d_model) arrays instead of one item at a time.
Only what the function supports is declared: the cases that need more (padding masks, weights,
biases, parameter count) skip with that reason.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_harness.contract.api import (
    AttentionBackend,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    Capabilities,
    LoadedAttention,
)


class _FunctionLoaded(LoadedAttention):
    def __init__(self, backend: FunctionBackend, params: AttentionParams, dtype: str):
        self.backend, self.dtype = backend, np.dtype(dtype)
        self.weights = [params.W_q, params.W_k, params.W_v, params.W_o]
        self.weights = [w.astype(self.dtype) for w in self.weights]

    def compute(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        options = {"causal": True} if inputs.causal else {}
        arrays = [np.asarray(getattr(inputs, n), self.dtype) for n in ("query", "key", "value")]
        fn, heads = self.backend.fn, self.config.num_heads
        if self.backend.batched:
            out = fn(*arrays, *self.weights, heads, **options)
        else:
            out = np.stack([fn(q, k, v, *self.weights, heads, **options) for q, k, v in zip(*arrays)])
        return AttentionOutput(np.asarray(out))


class FunctionBackend(AttentionBackend):
    def __init__(self, fn: Callable, name: str, capabilities: Capabilities, batched: bool):
        self.fn, self.name, self.capabilities, self.batched = fn, name, capabilities, batched

    def load_native(self, params: AttentionParams, dtype: str) -> LoadedAttention:
        return _FunctionLoaded(self, params, dtype)


def function_backend(fn: Callable, *, name: str, causal: bool = False, cross_attention: bool = True,
                     batched: bool = False, dtypes=("float32", "float64")) -> FunctionBackend:
    """Wrap ``fn(query, key, value, W_q, W_k, W_v, W_o, num_heads[, causal=True])`` as a backend.

    ``causal=True`` declares top-left causal masking, passed to ``fn`` as ``causal=True``.
    """
    if not callable(fn):
        raise TypeError(f"fn: got {type(fn).__name__}; accepted: a callable")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: got {name!r}; accepted: a non-empty string")
    caps = Capabilities(causal_alignments=("top-left",) if causal else (), key_padding_mask=False,
                        bool_attn_mask=False, additive_attn_mask=False, cross_attention=cross_attention,
                        attention_weights=False, gradients=False, grouped_query=False, bias=False,
                        native_parameters=False, dtypes=tuple(dtypes))
    backend = FunctionBackend(fn, name, caps, batched)
    backend.native_causal = "causal=True passed to the function (top-left)" if causal else "none"
    return backend
