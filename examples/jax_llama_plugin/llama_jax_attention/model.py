"""A hand-written Llama-style attention layer in JAX (model code; knows nothing about mha-harness).

Self-attention, grouped-query heads, rotary position embeddings with Hugging Face's rotate_half pairing,
no biases, jitted with jax.jit. Weights in the x @ W layout:
  wq: (d_model, num_heads * head_dim)      wk, wv: (d_model, num_kv_heads * head_dim)
  wo: (num_heads * head_dim, d_model)
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_cos_sin(positions, head_dim, theta, dtype):
    # angles in float32 as Hugging Face / Meta do (float64 if the layer runs in float64)
    compute = jnp.float64 if dtype == jnp.float64 else jnp.float32
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=compute) / head_dim))   # (head_dim/2,)
    freqs = positions.astype(compute)[..., None] * inv_freq                              # (..., T, head_dim/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)                                      # (..., T, head_dim)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x, cos, sin):
    # x: (B, H, T, D); cos/sin: (B|1, T, D)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "causal"))
def llama_attention(x, wq, wk, wv, wo, positions, mask=None, *, num_heads, num_kv_heads,
                    rope_theta=10000.0, causal=True):
    """x: (B, T, d_model); positions: (B|1, T) int; mask: bool (B|1, 1|H, T, T), True = may attend, or None."""
    b, t, _ = x.shape
    head_dim = wq.shape[1] // num_heads
    group = num_heads // num_kv_heads
    q = (x @ wq).reshape(b, t, num_heads, head_dim).transpose(0, 2, 1, 3)
    k = (x @ wk).reshape(b, t, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = (x @ wv).reshape(b, t, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    cos, sin = rope_cos_sin(positions, head_dim, rope_theta, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k = jnp.repeat(k, group, axis=1)      # query head n uses kv head n // group
    v = jnp.repeat(v, group, axis=1)
    scores = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.asarray(head_dim, x.dtype))
    allowed = jnp.ones((t, t), bool)
    if causal:
        allowed = jnp.tril(allowed)
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask
    scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, num_heads * head_dim)
    return out @ wo


class LlamaAttention:
    """Holds the weights; `layer(x, positions=None, mask=None, causal=True)`."""

    def __init__(self, wq, wk, wv, wo, *, num_heads, num_kv_heads, rope_theta=10000.0):
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.num_heads, self.num_kv_heads, self.rope_theta = num_heads, num_kv_heads, rope_theta

    @property
    def weights(self):
        return (self.wq, self.wk, self.wv, self.wo)

    def __call__(self, x, positions=None, mask=None, causal=True):
        if positions is None:
            positions = jnp.arange(x.shape[1])[None]
        return llama_attention(x, *self.weights, positions, mask, num_heads=self.num_heads,
                               num_kv_heads=self.num_kv_heads, rope_theta=self.rope_theta, causal=causal)
