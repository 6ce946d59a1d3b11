"""jax-explicit: multi-head attention in jax.numpy, jitted per shape, jax.vjp for gradients.

Masked keys contribute exactly nothing even when they hold NaN or inf: when the projected values
can be non-finite, the product is taken with them zeroed and the poison re-added only to rows
that give them weight. Which of the two programs runs is decided on the host, from the inputs
and parameters (``values_finite``), so each call compiles only the program it runs: a
``lax.cond`` inside one program would compile both and double every compile of the suite.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities
from mha_harness.contract.conventions import MASK_POLARITY
from mha_harness.implementations._jax_common import GPU_DTYPES, JAX_DTYPES, JaxBackend, JaxLoaded, linear_tree
from mha_harness.toolkit.masks import full_mask


def _weighted_values(jnp, p, v, values_finite: bool):
    """``p @ v``, where a NaN or inf value reaches only the outputs whose weight on it is nonzero."""
    if values_finite:
        return p @ v
    finite = jnp.isfinite(v)
    out = p @ jnp.where(finite, v, 0)
    touched = (p != 0).astype(v.dtype)
    # which outputs a NaN, +inf or -inf value reaches with nonzero weight: one product with the three indicator
    # matrices side by side (each column is its own sum, so this equals three separate products; one dot
    # instead of three roughly halves the branch's XLA compile time)
    kinds = jnp.concatenate([jnp.isnan(v), v == jnp.inf, v == -jnp.inf], axis=-1).astype(v.dtype)
    hit = touched @ kinds > 0
    width = v.shape[-1]
    nan_hit, pos_hit, neg_hit = hit[..., :width], hit[..., width:2 * width], hit[..., 2 * width:]
    out = jnp.where(pos_hit, out + jnp.inf, out)
    out = jnp.where(neg_hit, out - jnp.inf, out)
    return jnp.where(nan_hit, jnp.nan, out)


def value_projection_bounds(w_v, b_v) -> tuple[float, float, float]:
    """What bounds the projected values ``value @ w_v + b_v`` besides ``max|value|``: (the largest magnitude of any
    entry of ``w_v`` and ``b_v``, the largest column sum of ``|w_v|``, the largest ``|b_v|`` or 0). A NaN or inf
    entry makes them NaN or inf."""
    w = np.abs(np.asarray(w_v, np.float64))
    b = np.abs(np.asarray(b_v, np.float64)) if b_v is not None else np.zeros(1)
    return float(max(w.max(initial=0.0), b.max(initial=0.0))), float(w.sum(axis=0).max(initial=0.0)), \
        float(b.max(initial=0.0))


def values_are_surely_finite(value, bounds: tuple[float, float, float], dtype_max: float) -> bool:
    """Whether ``value @ w_v + b_v`` is finite for sure in a dtype whose largest value is ``dtype_max``, with the
    ``bounds`` of :func:`value_projection_bounds`: every input and parameter finite and below half of ``dtype_max``
    (so casting cannot overflow), and so is ``max|value| * max column sum |w_v| + max|b_v|``, which bounds every
    projected entry (the half covers the rounding of the product). NaN compares False, so it gives False."""
    largest_parameter, column_sum, bias = bounds
    largest_value = float(np.abs(np.asarray(value, np.float64)).max(initial=0.0))
    limit = dtype_max / 2
    return bool(largest_value < limit and largest_parameter < limit
                and largest_value * column_sum + bias < limit)


@functools.cache
def _compiled(num_heads: int, kv_heads: int, need_weights: bool, values_finite: bool):
    import jax

    def apply(w, query, key, value, allowed, additive):
        def proj(x, which):
            y = x @ w[f"W_{which}"]
            return y + w[f"b_{which}"] if f"b_{which}" in w else y

        def heads(x, n):
            b, t, width = x.shape
            return x.reshape(b, t, n, width // n).transpose(0, 2, 1, 3)
        out, weights = attention_heads(heads(proj(query, "q"), num_heads), heads(proj(key, "k"), kv_heads),
                                       heads(proj(value, "v"), kv_heads), allowed, additive, values_finite)
        b, h, t, dh = out.shape
        return proj(out.transpose(0, 2, 1, 3).reshape(b, t, h * dh), "o"), (weights if need_weights else None)
    return jax.jit(apply)


def attention_heads(q, k, v, allowed, additive, values_finite: bool):
    """Each head's masked softmax(Q K^T / sqrt(d_head)) V from projected heads (B, heads, T, d_head), K and V with
    fewer heads for grouped-query (each repeated for its group): (heads output, weights)."""
    import jax.numpy as jnp
    from jax import lax
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / jnp.asarray(math.sqrt(q.shape[-1]), q.dtype)
    if additive is not None:
        scores = scores + additive
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    e = jnp.exp(scores - row_max)
    total = e.sum(axis=-1, keepdims=True)
    weights = e / jnp.where(total == 0, 1, total)
    return _weighted_values(jnp, weights, v, values_finite), weights


class JaxExplicitLoaded(JaxLoaded):
    def setup(self, params: AttentionParams) -> None:
        self.params = linear_tree(self, params)
        self.value_bounds = value_projection_bounds(params.W_v, params.b_v)  # numbers: the vjp cache keeps a copy

    def native_inputs(self, inputs: AttentionInputs) -> dict:
        allowed, additive = full_mask(inputs)
        dtype_max = float(self.jax.numpy.finfo(self.dtype).max)
        finite = values_are_surely_finite(inputs.value, self.value_bounds, dtype_max)
        return {"query": self.array(inputs.query), "key": self.array(inputs.key), "value": self.array(inputs.value),
                "allowed": self.array(allowed), "additive": self.array(additive), "values_finite": finite}

    def call(self, params, a: dict, need_weights: bool):
        fn = _compiled(self.config.num_heads, self.config.kv_heads, need_weights, a["values_finite"])
        return fn(params, a["query"], a["key"], a["value"], a["allowed"], a["additive"])

    def decode_attention(self, inputs: AttentionInputs):
        allowed, additive = full_mask(inputs)
        finite = values_are_surely_finite(inputs.key, self.value_bounds,
                                          float(self.jax.numpy.finfo(self.dtype).max))

        def core(q, k, v, masks):
            return attention_heads(q, k, v, masks["allowed"], masks["additive"], finite)[0]
        return "heads_first", core, {"allowed": self.array(allowed), "additive": self.array(additive)}

    def canonical_gradients(self, grads) -> dict:
        return dict(grads)


class JaxExplicit(JaxBackend):
    native_causal = "explicit masks in both alignments"
    native_mask_polarity = MASK_POLARITY  # its compute takes the harness's masks as they are
    def __init__(self, device: str = "cpu"):
        self.device = device
        self.name = "jax-explicit" if device == "cpu" else f"jax-explicit-{device}"
        self.capabilities = Capabilities(attention_weights=True, gradients=True, devices=(device,),
                                         dtypes=JAX_DTYPES if device == "cpu" else GPU_DTYPES)

    def native_parameter_shapes(self, config: AttentionConfig):
        from mha_harness.contract.params import make_params
        return {n: tuple(a.shape) for n, a in JaxExplicitLoaded(self, make_params(config), "float32").params.items()}

    def load_native(self, params: AttentionParams, dtype: str) -> JaxExplicitLoaded:
        return JaxExplicitLoaded(self, params, dtype)


def backends():
    return [JaxExplicit("cpu"), JaxExplicit("gpu")]
