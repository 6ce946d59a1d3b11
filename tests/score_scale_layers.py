"""Torch layers built with a score scale other than 1/sqrt(d_head): torch-eager's layer scaling by 1/d_head and
declaring it (muP's attention, ``ScaledByDHead``), unscaled and declaring 1.0 (T5, ``Unscaled``), a fixed 0.1 at
every head width (``FixedScale``, as Gemma's ``query_pre_attn_scalar ** -0.5``), one applying 0.125 where it declares
0.1, one scaling by 1/d_head without declaring it, one declaring 1/d_head while it scales by 1/sqrt(d_head), and
one that declares 1/d_head and applies it but exponentiates its scores without subtracting the row maximum (whose
overflow the large-logits case must reach at the declared scale)."""
from __future__ import annotations

import math

from mha_harness.implementations.torch_eager import eager_attention
from tests.softcap_layers import ScoresLayer

#: the scale rules these layers apply: a head width -> the scale
RULES = {"1/sqrt(d_head)": lambda d: 1 / math.sqrt(d), "1/d_head": lambda d: 1 / d, "1": lambda d: 1.0,
         "0.1": lambda d: 0.1, "0.125": lambda d: 0.125}


def _attention(rule: str, subtract_max: bool = True):
    """torch-eager's per-head core with its scores scaled by ``rule`` instead of 1/sqrt(d_head) (without
    ``subtract_max``: softmax as exp(s) / sum exp(s), which overflows float32 for scores near 90)."""
    def attention(qh, kh, vh, allowed, additive, need_weights):
        d = qh.shape[-1]
        factor = RULES[rule](d) * math.sqrt(d)  # eager_attention has divided by sqrt(d_head) already
        if subtract_max:
            return eager_attention(qh, kh, vh, allowed, additive, need_weights, score_mod=lambda s: s * factor)
        import torch
        scores = (qh @ kh.transpose(-1, -2)) * RULES[rule](d) + (0 if additive is None else additive)
        e = torch.exp(scores if allowed is None else scores.masked_fill(~allowed, -math.inf))
        weights = e / e.sum(dim=-1, keepdim=True)
        return weights @ vh, weights if need_weights else None
    return attention


class _Scaled(ScoresLayer):
    prefix = "scale"
    applied = "1/d_head"  # the scale the layer applies (a key of RULES)
    declared: float | str | None = "1/d_head"  # the one it declares
    subtract_max = True

    def declarations(self) -> dict:
        return {"score_scale": self.declared}

    def attention(self):
        return _attention(self.applied, self.subtract_max)


class ScaledByDHead(_Scaled):
    pass


class Unscaled(_Scaled):
    applied, declared = "1", 1.0


class UnscaledUndeclared(_Scaled):
    applied, declared = "1", None


class FixedScale(_Scaled):
    applied, declared = "0.1", 0.1


class FixedScaleOtherThanDeclared(_Scaled):
    applied, declared = "0.125", 0.1


class ScaledByDHeadUndeclared(_Scaled):
    declared = None


class DeclaredNotApplied(_Scaled):
    applied = "1/sqrt(d_head)"


class ScaledByDHeadWithoutMaxSubtraction(_Scaled):
    subtract_max = False
