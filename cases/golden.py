"""The lesson's worked example as a golden case (shared/seeds: multi_head.py)."""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams

#: printed by the lesson for default_rng(7), T=4, d_model=8, h=2, weights scaled by 0.5
LESSON_HEAD_WEIGHTS = np.array([
    [[0.05, 0.04, 0.37, 0.53], [0.11, 0.14, 0.39, 0.36], [0.01, 0.01, 0.51, 0.47], [0.12, 0.05, 0.66, 0.17]],
    [[0.17, 0.18, 0.29, 0.36], [0.11, 0.09, 0.68, 0.12], [0.09, 0.18, 0.04, 0.69], [0.22, 0.20, 0.37, 0.21]],
])


def lesson_example() -> tuple[AttentionParams, AttentionInputs]:
    """Parameters and self-attention input drawn exactly as the lesson's multi_head.py draws them."""
    rng = np.random.default_rng(7)
    t, d_model, h = 4, 8, 2
    x = rng.standard_normal((t, d_model))
    w_q, w_k, w_v, w_o = (rng.standard_normal((d_model, d_model)) * 0.5 for _ in range(4))
    x = x[None]
    return AttentionParams(AttentionConfig(d_model, h), w_q, w_k, w_v, w_o), AttentionInputs(x, x, x)
