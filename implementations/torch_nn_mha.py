"""torch-nn-mha: an adapter over the real torch.nn.MultiheadAttention.

The canonical x @ W weights are packed into ``in_proj_weight`` (3*d_model x d_model, torch's
(out, in) layout: W_q.T, W_k.T, W_v.T stacked) and ``out_proj.weight`` (W_o.T). Masks are
translated to torch's polarity: its boolean attn_mask and key_padding_mask mark positions to
*ignore* (True = masked out). Causal masks are passed as explicit masks of either alignment.
The parameter count comes from ``module.parameters()``.
"""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities
from mha_harness.implementations._torch_common import GPU_DTYPES, TORCH_DTYPES, TorchBackend, TorchLoaded
from mha_harness.implementations.torch_sdpa import POISON_DIVERGENCES
from mha_harness.toolkit.masks import full_mask


def pack_in_proj(params: AttentionParams) -> np.ndarray:
    """(3*d_model, d_model) in torch's (out, in) layout."""
    return np.concatenate([params.W_q.T, params.W_k.T, params.W_v.T], axis=0)


class TorchNnMhaLoaded(TorchLoaded):
    def setup(self, params: AttentionParams) -> None:
        torch = self.torch
        c = params.config
        self.module = torch.nn.MultiheadAttention(c.d_model, c.num_heads, bias=c.bias, batch_first=True,
                                                  device=self.device, dtype=self.dtype)
        self.module.eval()
        with torch.no_grad():
            self.module.in_proj_weight.copy_(self.tensor(pack_in_proj(params)))
            self.module.out_proj.weight.copy_(self.tensor(params.W_o.T))
            if c.bias:
                self.module.in_proj_bias.copy_(self.tensor(np.concatenate([params.b_q, params.b_k, params.b_v])))
                self.module.out_proj.bias.copy_(self.tensor(params.b_o))

    def parameter_tensors(self):
        d = self.config.d_model
        m = self.module

        def unpack(g):
            return {"W_q": g[:d].T, "W_k": g[d:2 * d].T, "W_v": g[2 * d:].T}
        out = {"in_proj_weight": (m.in_proj_weight, unpack),
               "out_proj.weight": (m.out_proj.weight, lambda g: {"W_o": g.T})}
        if self.config.bias:
            out["in_proj_bias"] = (m.in_proj_bias, lambda g: {"b_q": g[:d], "b_k": g[d:2 * d], "b_v": g[2 * d:]})
            out["out_proj.bias"] = (m.out_proj.bias, lambda g: {"b_o": g})
        return out

    def forward_tensors(self, q, k, v, inputs: AttentionInputs, need_weights: bool):
        c = self.config
        kwargs = {}
        padding = inputs.key_padding_mask  # True = ignore, as torch
        if inputs.causal is not None or inputs.attn_mask is not None:
            # key padding travels separately; causal and attn_mask become one (B*H, Tq, Tk) mask
            allowed, additive = full_mask(inputs.replace(key_padding_mask=None))
            b, tq, tk = inputs.batch, inputs.tq, inputs.tk
            full = (b, c.num_heads, tq, tk)
            if additive is not None:  # float mask: additive where allowed, -inf elsewhere
                mask = np.where(np.broadcast_to(allowed, full), np.broadcast_to(additive, full), -np.inf)
            else:  # torch's bool attn_mask: True = NOT allowed
                mask = ~np.broadcast_to(allowed, full)
            kwargs["attn_mask"] = self.mask_tensor(mask.reshape(b * c.num_heads, tq, tk))
            if padding is not None and additive is not None:
                # the same type for both masks (torch deprecates a bool key_padding_mask next to a float
                # attn_mask, and converts the bool one to -inf where True itself)
                padding = np.where(padding, -np.inf, 0.0)
        if padding is not None:
            kwargs["key_padding_mask"] = self.mask_tensor(padding)
        out, weights = self.module(q, k, v, need_weights=need_weights, average_attn_weights=False, **kwargs)
        return out, weights


class TorchNnMha(TorchBackend):
    native_mask_polarity = ("attn_mask bool: True = NOT allowed (opposite of SDPA); key_padding_mask: True = ignore; "
                            "is_causal only a hint that needs attn_mask")
    divergences = POISON_DIVERGENCES
    native_causal = "is_causal is only a hint that needs attn_mask; causal masks passed explicitly"

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.name = "torch-nn-mha" if device == "cpu" else f"torch-nn-mha-{device}"
        self.capabilities = Capabilities(attention_weights=True, gradients=True, grouped_query=False, devices=(device,),
                                         dtypes=TORCH_DTYPES if device == "cpu" else GPU_DTYPES)

    def native_parameter_shapes(self, config: AttentionConfig):
        from mha_harness.contract.params import make_params
        module = TorchNnMhaLoaded(self, make_params(config), "float32").module
        return {name: tuple(p.shape) for name, p in module.named_parameters()}

    def load_native(self, params: AttentionParams, dtype: str) -> TorchNnMhaLoaded:
        return TorchNnMhaLoaded(self, params, dtype)


def backends():
    return [TorchNnMha("cpu"), TorchNnMha("cuda")]
