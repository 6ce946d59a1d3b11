"""torch-flex: projections in torch, core through FlexAttention compiled with torch.compile.

``torch.nn.attention.flex_attention.flex_attention`` is compiled once per process (``torch.compile``,
``fullgraph=True``, static shapes; dynamo's recompile limit is raised so the conformance grid's shapes do not
fall back to the unfused eager path) and called as ``attend(q, k, v, block_mask, bias, enable_gqa)``:

* causal masks (both alignments) and key padding are ``mask_mod`` functions in closed form, turned into a
  ``BlockMask`` with ``create_block_mask`` (fully masked blocks are skipped by the kernel);
* boolean ``attn_mask`` (any broadcast over batch and heads), combined with the others, is a ``mask_mod`` that
  looks the allowed tensor up;
* additive masks are a ``score_mod`` adding the bias tensor, defined inside the compiled function so it is
  traced with the bias as an input (no recompilation per mask);
* grouped-query heads go through ``enable_gqa=True``;
* a call without any mask still gets a BlockMask (every key allowed), built for its real lengths: with
  ``block_mask=None`` FlexAttention on torch 2.13.0 CPU returned wrong outputs (max error 0.07, static shapes)
  or NaN (dynamic shapes) whenever Tk is not a multiple of its 128-key block, e.g. Tq = 129, Tk = 1000
  (observed against SDPA; with the explicit mask the error is 4e-7).

Compilation happens on the first call of each shape and dtype, outside the prepared callable's timings
(``prepare`` warms it up); inductor's on-disk cache makes later processes reuse the kernels. On CPU inductor
writes C++, so the backend needs a C++ compiler; on CUDA it writes Triton kernels.
"""
from __future__ import annotations

import functools
import os
import shutil

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities, Unsupported
from mha_harness.contract.conventions import causal_offset
from mha_harness.implementations._torch_common import (
    GPU_DTYPES,
    LinearTorchLoaded,
    TorchBackend,
    torch_reason,
)
from mha_harness.toolkit.divergences import masked_poison_divergences
from mha_harness.toolkit.masks import full_mask

# float64 on CPU: "`torch.float`, `torch.float16` and `torch.bfloat16` are supported in FlexAttention for CPU device"
CPU_DTYPES = ("float32", "bfloat16", "float16")
POISON_DIVERGENCES = masked_poison_divergences(
    "FlexAttention sets masked scores to -inf inside a partly masked block and still multiplies their zero "
    "weights with V, and 0 * NaN = NaN (observed on torch 2.13.0 CPU)")
RECOMPILE_LIMIT = 512


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU ($CXX, else g++, c++, clang++), or None."""
    for name in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++")):
        path = shutil.which(name)
        if path:
            return path
    return None


def flex_reason(device: str) -> str | None:
    reason = torch_reason(device)
    if reason:
        return reason
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as exc:
        import torch
        return f"torch {torch.__version__} has no FlexAttention (torch.nn.attention.flex_attention: {exc})"
    if device == "cpu" and cxx_compiler() is None:
        return "no C++ compiler for torch.compile's CPU code (set CXX, or install g++ / clang++)"
    if device == "cuda":
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (torch.compile's CUDA code generator)"
    return None


def raise_recompile_limit(torch) -> None:
    """Let dynamo keep RECOMPILE_LIMIT graphs per function (the conformance grid has many shapes and dtypes)."""
    dynamo = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo, knob):
            setattr(dynamo, knob, max(getattr(dynamo, knob), RECOMPILE_LIMIT))


@functools.cache
def compiled_attend():
    """The one compiled FlexAttention call of this process (dynamo caches one graph per shape and dtype)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    raise_recompile_limit(torch)

    def attend(q, k, v, block_mask, bias, enable_gqa: bool):
        score_mod = None
        if bias is not None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[b, h, q_idx, kv_idx]
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
    # dynamic=None: the first shape compiles static, a second shape recompiles with dynamic sizes, so the
    # conformance grid compiles a handful of graphs instead of one per shape
    return torch.compile(attend, fullgraph=True)


def mask_mod_for(torch, inputs: AttentionInputs, allowed, padding):
    """A mask_mod (True = take part) for the call's masks; every key when nothing is masked."""
    if allowed is not None:  # a boolean attn_mask is part of the call: one lookup covers every mask
        return lambda b, h, q_idx, kv_idx: allowed[b, h, q_idx, kv_idx]
    mods = []
    if inputs.causal:
        offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
        mods.append(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx)
    if padding is not None:
        mods.append(lambda b, h, q_idx, kv_idx: ~padding[b, kv_idx])
    if not mods:  # never block_mask=None: see the module docstring
        return lambda b, h, q_idx, kv_idx: kv_idx >= 0
    if len(mods) == 1:
        return mods[0]
    return lambda b, h, q_idx, kv_idx: mods[0](b, h, q_idx, kv_idx) & mods[1](b, h, q_idx, kv_idx)


class TorchFlexLoaded(LinearTorchLoaded):
    def setup(self, params: AttentionParams) -> None:
        super().setup(params)
        self.attend = compiled_attend()

    def masks(self, inputs: AttentionInputs):
        """(block_mask, bias tensor or None) in FlexAttention's terms, expanded to (B, H, Tq, Tk)."""
        torch, c = self.torch, self.config
        from torch.nn.attention.flex_attention import create_block_mask
        shape = (inputs.batch, c.num_heads, inputs.tq, inputs.tk)
        allowed = bias = padding = None
        if inputs.attn_mask is not None:  # one lookup table covers attn_mask, causal and padding together
            allowed_np, additive = full_mask(inputs)
            if allowed_np is not None:
                allowed = self.mask_tensor(allowed_np).expand(shape)
            if additive is not None:
                bias = self.mask_tensor(additive).expand(shape)
        elif inputs.key_padding_mask is not None:
            padding = self.mask_tensor(inputs.key_padding_mask)
        mod = mask_mod_for(torch, inputs, allowed, padding)
        block_mask = create_block_mask(mod, inputs.batch if (allowed is not None or padding is not None) else None,
                                       c.num_heads if allowed is not None else None, inputs.tq, inputs.tk,
                                       device=self.device)
        return block_mask, bias

    def forward_tensors(self, q, k, v, inputs: AttentionInputs, need_weights: bool):
        c = self.config
        qh = self.split_heads(self.project(q, "q"), c.num_heads)
        kh = self.split_heads(self.project(k, "k"), c.kv_heads)
        vh = self.split_heads(self.project(v, "v"), c.kv_heads)
        block_mask, bias = self.masks(inputs)
        try:
            out = self.attend(qh, kh, vh, block_mask, bias, c.group > 1)
        except Exception as exc:  # noqa: BLE001 - inductor's refusals (dtype, head size) become skips
            text = str(exc)
            if any(s in text for s in ("NYI", "not supported", "Unsupported", "must be")):
                raise Unsupported(f"FlexAttention refuses this input on {self.device} in {self.dtype_name}: "
                                  f"{text.strip().splitlines()[-1][:200]}") from None
            raise
        b, h, t, dh = out.shape
        return self.project(out.transpose(1, 2).reshape(b, t, h * dh), "o"), None


class TorchFlex(TorchBackend):
    divergences = POISON_DIVERGENCES
    native_mask_polarity = "mask_mod returns True = take part in attention; additive masks through score_mod"
    native_causal = "no flag: causal is a mask_mod (q_idx + offset >= kv_idx) in a BlockMask, both alignments"

    def __init__(self, device: str = "cpu"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: got {device!r}; accepted: cpu, cuda")
        self.device = device
        self.name = f"torch-flex-{device}"
        self.capabilities = Capabilities(attention_weights=False, gradients=True, devices=(device,),
                                         dtypes=CPU_DTYPES if device == "cpu" else GPU_DTYPES)

    def availability(self) -> str | None:
        return flex_reason(self.device)

    def native_parameter_shapes(self, config: AttentionConfig):
        from mha_harness.contract.params import make_params
        return {n: tuple(t.shape) for n, t in TorchFlexLoaded(self, make_params(config), "float32").w.items()}

    def load_native(self, params: AttentionParams, dtype: str) -> TorchFlexLoaded:
        return TorchFlexLoaded(self, params, dtype)


def backends():
    return [TorchFlex("cpu"), TorchFlex("cuda")]
