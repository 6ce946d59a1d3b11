"""torch-eager: multi-head attention written with explicit torch ops (matmul, softmax, masks).

Autograd gives the gradients. Masked keys contribute exactly nothing, even when they hold
NaN or inf (the zero-weight trick of harness.numerics, in torch).
"""
from __future__ import annotations

import math

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities
from mha_harness.contract.conventions import (
    ALIBI_KINDS,
    MASK_POLARITY,
    QK_NORMS,
    ROTARY_KINDS,
    ROTARY_SCALING_KINDS,
    alibi_bias,
)
from mha_harness.implementations._torch_common import (
    GPU_DTYPES,
    TORCH_DTYPES,
    LinearTorchLoaded,
    TorchBackend,
    call_positions,
    qk_normed,
    rotary_turned,
)
from mha_harness.toolkit.masks import full_mask


def weighted_values(torch, weights, values):
    """weights @ values where zero weights ignore non-finite values (see harness.numerics.weighted_values)."""
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return weights @ values
    out = weights @ torch.where(finite, values, torch.zeros((), dtype=values.dtype, device=values.device))
    touched = (weights != 0).to(values.dtype)
    nan_hit = touched @ torch.isnan(values).to(values.dtype) > 0
    pos_hit = touched @ (values == math.inf).to(values.dtype) > 0
    neg_hit = touched @ (values == -math.inf).to(values.dtype) > 0
    out = torch.where(pos_hit, out + math.inf, out)
    out = torch.where(neg_hit, out - math.inf, out)
    return torch.where(nan_hit, torch.full_like(out, math.nan), out)


def eager_layer(q, k, v, w: dict, allowed, additive, num_heads: int, kv_heads: int, need_weights: bool,
                attention=None, qk_norm: str | None = None, qk_norm_eps: float = 1e-6, rotary: str | None = None,
                rotary_base: float = 10_000.0, rotary_dims: int | None = None, rotary_scaling=None):
    """The whole layer on tensors: projections, head split, masked softmax, weighted values, W_o.

    ``w`` maps canonical names (W_q, b_q, ...) to x @ W tensors; ``allowed`` (True = attend) and ``additive``
    are mask tensors broadcastable to (B, H, Tq, Tk) or None. A pure function of its tensors, so torch.compile
    can trace it once per shape (torch-compile-cpu). ``attention``: the per-head core, :func:`eager_attention`
    when None (a test swaps in another). ``qk_norm``: the q and k projections then go through that norm
    (:func:`~mha_harness.implementations._torch_common.qk_normed`) with the gains ``w["g_q"]``, ``w["g_k"]`` (and a
    LayerNorm's biases ``w["beta_q"]``, ``w["beta_k"]``). ``rotary``: each head of q and k is then turned by rotary
    embeddings of that kind and base (:func:`~mha_harness.implementations._torch_common.rotary_turned`) at the
    call's positions (the queries the last Tq of the Tk positions), only its first ``rotary_dims`` features when
    that is set (a partial rotary), its frequencies rescaled by ``rotary_scaling`` when that is set."""
    attention = attention or eager_attention
    def project(x, which):
        y = x @ w[f"W_{which}"]
        bias = w.get(f"b_{which}")
        y = y if bias is None else y + bias
        if qk_norm and which in ("q", "k"):
            y = qk_normed(y, w[f"g_{which}"], qk_norm, q.shape[-1] // num_heads, qk_norm_eps, w.get(f"beta_{which}"))
        return y

    def split(x, n):
        b, t, width = x.shape
        return x.reshape(b, t, n, width // n).transpose(1, 2)
    qh, kh = split(project(q, "q"), num_heads), split(project(k, "k"), kv_heads)
    if rotary is not None:
        q_pos, k_pos = call_positions(q.shape[1], k.shape[1], q.device)
        qh = rotary_turned(qh, q_pos, rotary, rotary_base, rotary_dims, rotary_scaling)
        kh = rotary_turned(kh, k_pos, rotary, rotary_base, rotary_dims, rotary_scaling)
    out, weights = attention(qh, kh, split(project(v, "v"), kv_heads), allowed, additive, need_weights)
    b, h, t, dh = out.shape
    return project(out.transpose(1, 2).reshape(b, t, h * dh), "o"), weights


def eager_attention(qh, kh, vh, allowed, additive, need_weights: bool, score_mod=None):
    """Each head's masked softmax(Q K^T / sqrt(d_head)) V from projected heads (B, heads, T, d_head), K and V with
    fewer heads for grouped-query (each repeated for its group): (heads output, weights or None). ``score_mod``: a
    function of the scaled scores applied before the masks (a soft cap, in a test's layer)."""
    import torch
    group = qh.shape[1] // kh.shape[1]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(qh.shape[-1])
    if score_mod is not None:
        scores = score_mod(scores)
    if additive is not None:
        scores = scores + additive
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(scores - row_max)
    total = e.sum(dim=-1, keepdim=True)
    weights = e / torch.where(total == 0, torch.ones_like(total), total)
    return weighted_values(torch, weights, vh), weights if need_weights else None


class TorchEagerLoaded(LinearTorchLoaded):
    layer = staticmethod(eager_layer)

    def masks(self, inputs: AttentionInputs):
        """The call's masks and the layer's own: its sliding window in ``allowed``, its ALiBi bias (computed in
        float64, rounded once to the layer's dtype by ``mask_tensor``) added to the float mask."""
        c = self.config
        allowed, additive = full_mask(inputs, sliding_window=c.sliding_window)
        if c.alibi is not None:
            bias = alibi_bias(c.alibi, c.num_heads, inputs.tq, inputs.tk)[None]
            additive = bias if additive is None else bias + additive
        return allowed, additive

    def attend_heads(self, qh, kh, vh, inputs: AttentionInputs):
        allowed, additive = self.masks(inputs)
        return eager_attention(qh, kh, vh, self.mask_tensor(allowed), self.mask_tensor(additive), False)[0]

    def forward_tensors(self, q, k, v, inputs: AttentionInputs, need_weights: bool):
        c = self.config
        allowed, additive = self.masks(inputs)
        return self.layer(q, k, v, self.w, self.mask_tensor(allowed), self.mask_tensor(additive), c.num_heads,
                          c.kv_heads, need_weights, qk_norm=c.qk_norm, qk_norm_eps=c.qk_norm_eps, rotary=c.rotary,
                          rotary_base=c.rotary_base, rotary_dims=c.rotary_dims, rotary_scaling=c.rotary_scaling)


class TorchEager(TorchBackend):
    name = "torch-eager"
    native_causal = "explicit masks in both alignments"
    native_mask_polarity = MASK_POLARITY  # its compute takes the harness's masks as they are
    capabilities = Capabilities(attention_weights=True, gradients=True, dtypes=TORCH_DTYPES, qk_norms=QK_NORMS,
                                rotary=ROTARY_KINDS, partial_rotary=True,
                                rotary_scalings=ROTARY_SCALING_KINDS, sliding_window=True, alibi=ALIBI_KINDS)

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.name = "torch-eager" if device == "cpu" else f"torch-eager-{device}"
        if device != "cpu":
            self.capabilities = Capabilities(attention_weights=True, gradients=True, dtypes=GPU_DTYPES,
                                             devices=(device,), qk_norms=QK_NORMS, rotary=ROTARY_KINDS,
                                             partial_rotary=True, rotary_scalings=ROTARY_SCALING_KINDS,
                                             sliding_window=True, alibi=ALIBI_KINDS)

    def native_parameter_shapes(self, config: AttentionConfig):
        from mha_harness.contract.params import make_params
        loaded = TorchEagerLoaded(self, make_params(config), "float32")
        return {name: tuple(t.shape) for name, t in loaded.w.items()}

    def load_native(self, params: AttentionParams, dtype: str) -> TorchEagerLoaded:
        return TorchEagerLoaded(self, params, dtype)


def backends():
    return [TorchEager("cpu"), TorchEager("cuda")]
