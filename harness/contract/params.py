"""Seeded, deterministic canonical parameters and inputs for cases, tests and benchmarks."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams
from mha_harness.contract.validation import (
    qk_norm_bias_shapes,
    qk_norm_gain_shapes,
    require_config,
    validate_causal,
    validate_seed,
    validate_sizes,
)


def make_params(config: AttentionConfig, seed: int = 0, scale: float | None = None) -> AttentionParams:
    """Random parameters with std ``scale`` (default 1/sqrt(d_model), which keeps activations O(1)); a q/k norm's
    gains uniform in [0.5, 1.5] (a gain that is not 1 everywhere shows whether the layer applies it, and where), a
    LayerNorm's biases uniform in [-0.5, 0.5]."""
    require_config(config)
    rng = np.random.default_rng(validate_seed(seed))
    s = 1.0 / np.sqrt(config.d_model) if scale is None else scale
    kv = config.kv_heads * config.d_head
    d = config.d_model
    arrays = {"W_q": rng.standard_normal((d, d)) * s, "W_k": rng.standard_normal((d, kv)) * s,
              "W_v": rng.standard_normal((d, kv)) * s, "W_o": rng.standard_normal((d, d)) * s}
    if config.bias:
        arrays.update(b_q=rng.standard_normal(d) * 0.5, b_k=rng.standard_normal(kv) * 0.5,
                      b_v=rng.standard_normal(kv) * 0.5, b_o=rng.standard_normal(d) * 0.5)
    for name, shape in qk_norm_gain_shapes(config).items():  # drawn last: the other arrays stay as without a norm
        arrays[name] = rng.uniform(0.5, 1.5, shape)
    for name, shape in qk_norm_bias_shapes(config).items():
        arrays[name] = rng.uniform(-0.5, 0.5, shape)
    return AttentionParams(config, **arrays)


def make_inputs(config: AttentionConfig, batch: int, tq: int, tk: int | None = None, seed: int = 1,
                self_attention: bool | None = None, **masks) -> AttentionInputs:
    """Standard-normal query/key/value of shape (batch, T, d_model); self-attention shares one array."""
    require_config(config)
    validate_sizes(batch=batch, tq=tq, tk=tk)
    validate_causal(masks.get("causal"))
    rng = np.random.default_rng(validate_seed(seed))
    tk = tq if tk is None else tk
    x = rng.standard_normal((batch, tq, config.d_model))
    if self_attention is None:
        self_attention = tk == tq
    if self_attention and tk == tq:
        return AttentionInputs(x, x, x, **masks)
    return AttentionInputs(x, rng.standard_normal((batch, tk, config.d_model)),
                           rng.standard_normal((batch, tk, config.d_model)), **masks)
