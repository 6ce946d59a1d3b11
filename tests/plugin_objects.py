"""Backends defined in a test module: the module:object route, a lesson-style function, and duplicates."""
from __future__ import annotations

import numpy as np

import mha_harness
from mha_harness.implementations.numpy_naive import NumpyNaive


def lesson_mha(query, key, value, W_q, W_k, W_v, W_o, num_heads, causal=False):
    """The lesson's multi_head.py as a plain function of (T, d_model) arrays."""
    t_q, d_model = query.shape
    t_k, d_head = key.shape[0], d_model // num_heads

    def split_heads(m, t):
        return m.reshape(t, num_heads, d_head).transpose(1, 0, 2)
    q, k, v = split_heads(query @ W_q, t_q), split_heads(key @ W_k, t_k), split_heads(value @ W_v, t_k)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(d_head)
    if causal:
        scores = np.where(np.tril(np.ones((t_q, t_k), bool)), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(t_q, d_model) @ W_o


LessonFunction = mha_harness.function_backend(lesson_mha, name="lesson-function", causal=True)


class RenamedNaive(NumpyNaive):
    name = "my-naive"


class DuplicateOfNaive(NumpyNaive):
    name = "numpy-naive"


def two_backends():
    """A factory registering several backends from one entry point."""
    return [type("OtherNaive", (NumpyNaive,), {"name": "other-naive"})(),
            mha_harness.function_backend(lesson_mha, name="lesson-function-2")]


class _OffsetLoaded(NumpyNaive.loaded_class):
    """Every output one too large: a backend that fails the reference comparisons."""

    def compute(self, inputs, *, need_weights=False):
        out = super().compute(inputs, need_weights=need_weights)
        return mha_harness.AttentionOutput(out.output + 1.0, out.weights)


class OffsetOutput(NumpyNaive):
    """A failing backend that pickles (a worker can receive it as an object)."""
    name = "offset-output"
    loaded_class = _OffsetLoaded


class ConfigRefusedWhenCounted(NumpyNaive):
    """A layer whose own config check raises while its parameters are counted (Hugging Face's rotary config at an
    odd head size, as an outside user's Gemma layer did in search)."""
    name = "config-refused-when-counted"

    def native_parameter_shapes(self, config):
        raise RuntimeError("RoPE requires an even rotary dimension")
