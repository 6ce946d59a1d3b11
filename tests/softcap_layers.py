"""Torch layers whose scores are soft-capped, ``c * tanh(s / c)`` (Gemma 2's ``attn_logit_softcapping``): torch-eager's
layer with the cap taken on the scaled scores before the masks (``SoftCapped``, declared), the same undeclared, one
capping at another value than it declares, one that declares a cap it does not apply, and one that caps after the
mask has set the masked scores to -inf (which turns them into -c: the masked keys keep a weight)."""
from __future__ import annotations

import dataclasses
import functools
import math

from mha_harness.implementations.torch_eager import TorchEager, TorchEagerLoaded, eager_attention, eager_layer
from mha_harness.toolkit.masks import full_mask

#: the cap of these layers: small enough that the scores of the cases' random layers (a few units) are bent by it
CAP = 20.0


def _attention(cap: float | None, after_mask: bool = False):
    """torch-eager's per-head core with the scaled scores capped at ``cap`` before the masks, or (``after_mask``)
    after them: the masks applied here, where a masked score is -inf until the cap makes it -cap."""
    def capped(scores):
        import torch
        return scores if cap is None else torch.tanh(scores / cap) * cap

    def attention(qh, kh, vh, allowed, additive, need_weights):
        if not after_mask:
            return eager_attention(qh, kh, vh, allowed, additive, need_weights, score_mod=capped)

        def masked_then_capped(scores):
            scores = scores if additive is None else scores + additive
            return capped(scores if allowed is None else scores.masked_fill(~allowed, -math.inf))
        return eager_attention(qh, kh, vh, None, None, need_weights, score_mod=masked_then_capped)
    return attention


class AttentionLoaded(TorchEagerLoaded):
    """torch-eager's layer with the per-head core ``backend.attention()`` returns (here and in
    tests/score_scale_layers.py)."""

    def __init__(self, backend, params, dtype):
        super().__init__(backend, params, dtype)
        self.attention = backend.attention()
        self.layer = functools.partial(eager_layer, attention=self.attention)

    def attend_heads(self, qh, kh, vh, inputs):  # the decode step's path, with the layer's window as torch-eager's
        allowed, additive = full_mask(inputs, sliding_window=self.config.sliding_window)
        return self.attention(qh, kh, vh, self.mask_tensor(allowed), self.mask_tensor(additive), False)[0]


class ScoresLayer(TorchEager):
    """torch-eager's layer with a per-head core of its own (:meth:`attention`) and torch-eager's capabilities with
    :meth:`declarations` replaced, named ``<prefix>-<class name>``."""
    prefix = "scores"

    def __init__(self):
        super().__init__()
        self.name = f"{self.prefix}-{type(self).__name__.lower()}"
        self.capabilities = dataclasses.replace(TorchEager.capabilities, **self.declarations())

    def declarations(self) -> dict:
        return {}

    def attention(self):
        raise NotImplementedError

    def load_native(self, params, dtype):
        return AttentionLoaded(self, params, dtype)


class _Capped(ScoresLayer):
    prefix = "softcap"
    applied: float | None = CAP  # the cap the layer applies
    declared: float | None = CAP  # the cap it declares
    after_mask = False

    def declarations(self) -> dict:
        return {"logit_softcap": self.declared}

    def attention(self):
        return _attention(self.applied, self.after_mask)


class SoftCapped(_Capped):
    pass


class SoftCappedUndeclared(_Capped):
    declared = None


class CapOtherThanDeclared(_Capped):
    declared = 50.0


class CapDeclaredNotApplied(_Capped):
    applied = None


class CapAfterMask(_Capped):
    after_mask = True
