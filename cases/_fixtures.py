"""Seeded inputs shared by the cases (NumPy only: cases never import torch or jax)."""
from __future__ import annotations

import numpy as np

from mha_harness.conformance.casekit import primary_dtype
from mha_harness.contract.api import AttentionConfig, AttentionInputs
from mha_harness.contract.conventions import causal_offset
from mha_harness.contract.params import make_inputs, make_params

SMALL = dict(d_model=32, num_heads=4)


def small_layer(backend, *, bias: bool = False, num_kv_heads=None, seed: int = 0, **overrides):
    """A small layer (d_model 32, 4 heads) using biases only where the backend declares them."""
    shape = {**SMALL, **overrides}
    config = AttentionConfig(shape["d_model"], shape["num_heads"], num_kv_heads,
                             bias=bias and backend.capabilities.bias)
    return make_params(config, seed=seed)


def separate_inputs(config: AttentionConfig, batch: int, tq: int, tk: int | None = None, seed: int = 1, **masks):
    """Query, key and value as three distinct arrays, so keys can be perturbed without touching queries."""
    return make_inputs(config, batch, tq, tk, seed=seed, self_attention=False, **masks)


def causal_variants(backend) -> list[dict]:
    """Each declared alignment at Tq == Tk and, where cross-attention is declared, Tq < Tk and Tq > Tk."""
    out = []
    dtype = primary_dtype(backend)
    for alignment in backend.capabilities.causal_alignments:
        shapes = [(9, 9)] + ([(5, 11), (11, 6)] if backend.capabilities.cross_attention else [])
        out += [{"dtype": dtype, "alignment": alignment, "seq": tq, "tk": tk} for tq, tk in shapes]
    return out


def key_limit(alignment: str, row: int, tq: int, tk: int) -> int:
    """Last key index that query ``row`` may see under the causal mask (may be < 0: none)."""
    return row + causal_offset(alignment, tq, tk)


def poison(rng: np.random.Generator, shape, kind: str) -> np.ndarray:
    """Values put where a mask must hide them: large random numbers, NaN or +inf."""
    if kind == "nan":
        return np.full(shape, np.nan)
    if kind == "inf":
        return np.full(shape, np.inf)
    return rng.standard_normal(shape) * 100.0


def with_keys_replaced(inputs: AttentionInputs, positions, kind: str, seed: int = 11, batch=slice(None)):
    """Copy of ``inputs`` whose key and value at ``positions`` (of batch items ``batch``) are poisoned."""
    rng = np.random.default_rng(seed)
    key, value = inputs.key.copy(), inputs.value.copy()
    block = key[batch, positions].shape
    key[batch, positions] = poison(rng, block, kind)
    value[batch, positions] = poison(rng, block, kind)
    return inputs.replace(key=key, value=value)
