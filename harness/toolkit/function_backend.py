"""The few-line adapter: turn a plain NumPy attention function into a backend, in any of three input forms.

    # the lesson's own signature: one X (self-attention), (T, d_model) arrays
    def multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads, causal=False): ...
    backend = mha_harness.function_backend(multi_head_attention, name="lesson-mha", causal=True)

    def cross(x_q, x_kv, W_q, W_k, W_v, W_o, num_heads): ...          # shared K/V: one x_kv makes K and V
    def full(query, key, value, W_q, W_k, W_v, W_o, num_heads): ...   # separate query, key, value

The input form (``Capabilities.inputs``) is read from the number of positional parameters without a default
(6: ``"self"``, 7: ``"shared_kv"``, 8: ``"separate"``) unless ``inputs=`` says it. With ``batched=True`` the
function gets (batch, T, d_model) arrays instead of one item at a time. Only what the function supports is
declared: the cases that need more (padding masks, weights, biases, parameter count) skip with that reason.
"""
from __future__ import annotations

import inspect
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

#: the input arrays a function of each form receives, before the weights
FORM_ARRAYS = {"self": ("query",), "shared_kv": ("query", "key"), "separate": ("query", "key", "value")}
_FORM_BY_ARITY = {6: "self", 7: "shared_kv", 8: "separate"}


class _FunctionLoaded(LoadedAttention):
    def __init__(self, backend: FunctionBackend, params: AttentionParams, dtype: str):
        self.backend, self.dtype = backend, np.dtype(dtype)
        self.weights = [w.astype(self.dtype) for w in (params.W_q, params.W_k, params.W_v, params.W_o)]

    def compute(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        options = {"causal": True} if inputs.causal and not self.backend.capabilities.always_causal else {}
        names = FORM_ARRAYS[self.backend.capabilities.inputs]
        arrays = [np.asarray(getattr(inputs, n), self.dtype) for n in names]
        fn, heads = self.backend.fn, self.config.num_heads
        if self.backend.batched:
            out = fn(*arrays, *self.weights, heads, **options)
        else:
            out = np.stack([fn(*items, *self.weights, heads, **options) for items in zip(*arrays)])
        return AttentionOutput(np.asarray(out))


class FunctionBackend(AttentionBackend):
    def __init__(self, fn: Callable, name: str, capabilities: Capabilities, batched: bool):
        self.fn, self.name, self.capabilities, self.batched = fn, name, capabilities, batched

    def load_native(self, params: AttentionParams, dtype: str) -> LoadedAttention:
        return _FunctionLoaded(self, params, dtype)


def _form_from_signature(fn: Callable) -> str:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise ValueError("inputs: the signature of fn cannot be read; accepted: pass inputs='self', 'shared_kv' "
                         "or 'separate'") from None
    required = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]
    if len(required) not in _FORM_BY_ARITY:
        raise ValueError(f"inputs: fn takes {len(required)} required positional parameters "
                         f"({', '.join(p.name for p in required)}); accepted: 6 (X, W_q, W_k, W_v, W_o, num_heads), "
                         "7 (x_q, x_kv, ...) or 8 (query, key, value, ...), or pass inputs= explicitly")
    return _FORM_BY_ARITY[len(required)]


def function_backend(fn: Callable, *, name: str, inputs: str | None = None, causal: bool | str = False,
                     cross_attention: bool = True, batched: bool = False,
                     dtypes=("float32", "float64")) -> FunctionBackend:
    """Wrap a NumPy attention function as a backend.

    ``fn(X, W_q, W_k, W_v, W_o, num_heads)`` (``inputs="self"``), ``fn(x_q, x_kv, W_q, ...)``
    (``"shared_kv"``) or ``fn(query, key, value, W_q, ...)`` (``"separate"``); ``inputs=None`` reads the form
    from the signature. ``causal=True`` declares top-left causal masking, passed to ``fn`` as ``causal=True``;
    ``causal="always"`` declares a function that always masks top-left and takes no ``causal`` parameter
    (``Capabilities.always_causal``: every case runs causal, those that need attention without a mask skip).
    ``cross_attention=False`` declares that Tq must equal Tk (implied by ``"self"``).
    """
    if not callable(fn):
        raise TypeError(f"fn: got {type(fn).__name__}; accepted: a callable")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: got {name!r}; accepted: a non-empty string")
    if inputs is None:
        inputs = _form_from_signature(fn)
    elif inputs not in FORM_ARRAYS:
        extra = (" (a KV-cache step declares only bottom-right causal masking, which a function backend does not "
                 "offer: subclass AttentionBackend with Capabilities(inputs='kv_cache'), as docs/cases.md's "
                 "'KV-cache layers' shows)" if inputs == "kv_cache" else "")
        raise ValueError(f"inputs: got {inputs!r}; accepted: {', '.join(map(repr, FORM_ARRAYS))} or None "
                         f"(read from fn's signature){extra}")
    if causal not in (True, False, "always"):
        raise ValueError(f"causal: got {causal!r}; accepted: False, True (fn takes causal=True) or 'always' "
                         "(fn always masks top-left and takes no causal parameter)")
    caps = Capabilities(causal_alignments=("top-left",) if causal else (), key_padding_mask=False,
                        bool_attn_mask=False, additive_attn_mask=False, cross_attention=cross_attention,
                        attention_weights=False, gradients=False, grouped_query=False, bias=False,
                        native_parameters=False, dtypes=tuple(dtypes), inputs=inputs,
                        always_causal=causal == "always")
    backend = FunctionBackend(fn, name, caps, batched)
    backend.native_causal = {True: "causal=True passed to the function (top-left)", False: "none",
                             "always": "always top-left (no causal parameter)"}[causal]
    return backend
