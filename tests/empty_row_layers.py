"""Torch layers that differ only in what a query row with every key masked does: the ways attention written today
handles it. ``Held``: the masked scores replaced by the dtype's most negative value (masked_fill, as flax and
jax.nn.dot_product_attention do): uniform weights, nothing flows back to that row's scores. ``Shifted``: that value
added to the scores (Hugging Face's additive masks): uniform weights in the forward, where rounding absorbs the
scores, while the backward still differentiates them. ``DoubleWhere``: -inf added as a float mask, then NaN weights
replaced by zeros after the softmax: zeros in the forward, NaN in the backward (the double-where trap); ``NaNRows``
keeps the NaN (and declares it). ``Held`` and ``Shifted`` declare the uniform average; ``HeldUndeclared`` is
``Held`` without the declaration, ``HeldUnscaled`` that without the 1/sqrt(d_head) score scale as well (wrong on
every row)."""
from __future__ import annotations

import dataclasses
import functools
import math

from mha_harness.implementations.torch_eager import TorchEager, TorchEagerLoaded, eager_layer, weighted_values
from mha_harness.toolkit.divergences import (
    nan_fully_masked_divergences,
    precision_divergences,
    uniform_fully_masked_divergences,
)


def _masks(torch, scores, allowed, additive):
    """The scores with the additive mask's finite biases added, and where a key may be seen (both masks)."""
    visible = torch.ones_like(scores, dtype=torch.bool)
    if additive is not None:
        finite = torch.isfinite(additive)
        scores = scores + torch.where(finite, additive, torch.zeros_like(additive))
        visible = visible & finite
    if allowed is not None:
        visible = visible & allowed
    return scores, visible


def _attention(mode: str, scaled: bool = True, float32_softmax: bool = False):
    def attention(qh, kh, vh, allowed, additive, need_weights):
        import torch
        group = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        scale = math.sqrt(qh.shape[-1]) if scaled else 1.0
        scores, visible = _masks(torch, (qh @ kh.transpose(-1, -2)) / scale, allowed, additive)
        if mode == "held":
            weights = torch.softmax(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), dim=-1)
        elif mode == "shifted":
            bias = torch.zeros_like(scores).masked_fill(~visible, torch.finfo(scores.dtype).min)
            if float32_softmax:  # as Hugging Face's eager layers take it: float64's minimum is -inf in float32
                weights = torch.softmax(scores + bias, dim=-1, dtype=torch.float32).to(scores.dtype)
            else:
                weights = torch.softmax(scores + bias, dim=-1)
        else:  # a float mask of -inf added: the softmax of a row of -inf is NaN (kept, or replaced by zeros after it
            # in the double where; a masked_fill's backward would have zeroed the NaN)
            bias = torch.zeros_like(scores).masked_fill(~visible, -math.inf)
            weights = torch.softmax(scores + bias, dim=-1)
            if mode == "double_where":
                weights = torch.where(torch.isnan(weights), torch.zeros_like(weights), weights)
        return weighted_values(torch, weights, vh), weights if need_weights else None
    return attention


class _Loaded(TorchEagerLoaded):
    """torch-eager's layer with the backend's attention (its ``mode`` and ``scaled``)."""

    def __init__(self, backend, params, dtype):
        super().__init__(backend, params, dtype)
        self.layer = functools.partial(eager_layer, attention=_attention(backend.mode, backend.scaled,
                                                                         backend.float32_softmax))


class _Variant(TorchEager):
    mode, scaled, divergences, float32_softmax = "held", True, (), False

    def __init__(self):
        super().__init__()
        self.name = f"empty-row-{type(self).__name__.lower()}"

    def load_native(self, params, dtype):
        return _Loaded(self, params, dtype)


_UNIFORM = uniform_fully_masked_divergences("the layer masks with the dtype's most negative finite value")


class Held(_Variant):
    divergences = _UNIFORM


class HeldUndeclared(_Variant):
    pass


class HeldAlwaysCausal(_Variant):
    """``Held`` as an always top-left causal layer: its one finite minimum masks future and padded keys alike, so a
    row with every key padded averages every key, future ones too (Hugging Face's eager Llama does so)."""
    divergences = _UNIFORM
    capabilities = dataclasses.replace(TorchEager.capabilities, always_causal=True, causal_alignments=("top-left",))


class HeldUnscaled(_Variant):
    scaled = False


class Shifted(_Variant):
    mode, divergences = "shifted", _UNIFORM


class DoubleWhere(_Variant):
    mode = "double_where"


class NaNRows(_Variant):
    mode, divergences = "nan", nan_fully_masked_divergences("the softmax of a row of -inf is 0 / 0")


class HeldInBfloat16(_Variant):
    """``Held`` computing a float32 call in bfloat16 (a half-precision kernel behind a float32 API), declaring both:
    its float32 rows without a key match both declarations, and are verified under the two at once."""
    divergences = _UNIFORM + precision_divergences("float32", "bfloat16", "the layer computes in bfloat16",
                                                   cases=["check_gradients_match_reference",
                                                          "check_fully_masked_rows_output_zeros"])

    def load_native(self, params, dtype):
        return _Loaded(self, params, "bfloat16" if dtype == "float32" else dtype)


class ShiftedFloat32Softmax(_Variant):
    """``Shifted`` with the softmax taken in float32 (Hugging Face's eager layers): the float64 minimum it adds is
    -inf there, so its float64 rows without a key are NaN while its float32 ones average (an outside user's Gemma
    layer); it declares the uniform average, which the float64 variants disprove."""
    mode, float32_softmax = "shifted", True
    divergences = _UNIFORM + precision_divergences("float64", "float32", "the softmax is taken in float32",
                                                   cases=["check_fully_masked_rows_output_zeros"])


class ShiftedFloat32SoftmaxDeclared(ShiftedFloat32Softmax):
    """``ShiftedFloat32Softmax`` declaring what it does per dtype: NaN rows in float64, the uniform average else."""
    divergences = (uniform_fully_masked_divergences("a finite minimum", dtypes=("float32", "bfloat16", "float16"))
                   + nan_fully_masked_divergences("float64's minimum is -inf in the float32 softmax",
                                                  dtypes=("float64",)))
