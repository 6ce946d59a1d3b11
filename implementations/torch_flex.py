"""torch-flex: projections in torch, core through FlexAttention compiled with torch.compile.

``torch.nn.attention.flex_attention.flex_attention`` is compiled once per process (``torch.compile``,
``fullgraph=True``, ``dynamic=False``; dynamo's recompile limit is raised so the conformance grid's shapes never
fall back to the unfused eager path) and called as ``attend(q, k, v, block_mask, bias, enable_gqa)``:

* lengths are padded to whole 128-position blocks (:func:`bucket`): padded keys are masked out by the
  mask_mod, padded query rows are dropped, so every length of a bucket shares one compiled graph. (Off-block
  lengths once gave wrong outputs here, which a fresh process does not reproduce: docs/backends.md, "FlexAttention
  on torch 2.13.0 CPU".);
* causal masks (both alignments, the diagonal from ``conventions.causal_offset``) and key padding are
  ``mask_mod`` functions in closed form; the offset and the real key count are 0-d tensors captured by the
  mask_mod, so a new length in the same bucket does not recompile. ``create_block_mask`` turns them into a
  ``BlockMask`` (fully masked blocks are skipped by the kernel);
* a boolean ``attn_mask`` (any broadcast over batch and heads), with causal and padding folded in, is a
  ``mask_mod`` that indexes a captured (B, H, Tq, Tk) table of allowed positions;
* additive masks are a ``score_mod`` adding a (B, H, Tq, Tk) bias, defined inside the compiled function so
  it is traced with the bias as an input (no recompilation per mask);
* grouped-query heads go through ``enable_gqa=True``;
* the BlockMask of the last call's inputs is kept, as FlexAttention users keep theirs across layers and
  steps: a prepared (benchmarked) call builds it once, in its warm-up.

Gradients: CUDA only. torch 2.13.0 refuses FlexAttention's backward on CPU ("FlexAttention does not support
backward on CPU", torch/nn/attention/flex_attention.py ``_validate_device``; CPU inductor lowers it for
inference only, pytorch/pytorch#148752), so torch-flex-cpu declares no gradients. float64 is not supported on
CPU either (only float32, bfloat16 and float16).

Compilation happens on the first call of each bucketed shape, mask kind and dtype, outside the prepared
callable's timings (``prepare``'s first call compiles; the bench and asv warm up before timing), and inductor's
on-disk cache (a private folder, :func:`~mha_harness.implementations._torch_common.use_private_inductor_cache`)
serves later processes. On CPU inductor writes C++, so the backend needs a C++ compiler; on CUDA it writes
Triton kernels.
"""
from __future__ import annotations

import functools
import os
import shutil

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities, Unsupported
from mha_harness.contract.conventions import causal_offset
from mha_harness.implementations._torch_common import (
    GPU_DTYPES,
    LinearTorchLoaded,
    TorchBackend,
    torch_reason,
    use_private_inductor_cache,
)
from mha_harness.toolkit.divergences import masked_poison_divergences
from mha_harness.toolkit.masks import full_mask

# float64 on CPU: "`torch.float`, `torch.float16` and `torch.bfloat16` are supported in FlexAttention for CPU device"
CPU_DTYPES = ("float32", "bfloat16", "float16")
POISON_DIVERGENCES = masked_poison_divergences(
    "FlexAttention sets masked scores to -inf inside a partly masked block and still multiplies their zero "
    "weights with V, and 0 * NaN = NaN (observed on torch 2.13.0 CPU)")
RECOMPILE_LIMIT = 512
#: FlexAttention's block (BlockMask's default BLOCK_SIZE); lengths are padded to whole blocks (module docstring)
BLOCK = 128
#: torch 2.13.0's own refusal, raised for any CPU input that requires grad (torch.nn.attention.flex_attention.
#: _validate_device); CPU inductor lowers FlexAttention for inference only (pytorch/pytorch#148752, PR #169646)
CPU_NO_BACKWARD = ("FlexAttention does not support backward on CPU (torch 2.13.0: inference only; "
                   "pytorch/pytorch#148752)")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU ($CXX, else g++, c++, clang++), or None."""
    for name in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++")):
        path = shutil.which(name)
        if path:
            return path
    return None


def torch_older_than(major: int, minor: int) -> bool:
    import torch
    try:
        found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return found < (major, minor)


def flex_reason(device: str) -> str | None:
    reason = torch_reason(device)
    if reason:
        return reason
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as exc:
        import torch
        return f"torch {torch.__version__} has no FlexAttention (torch.nn.attention.flex_attention: {exc})"
    if device == "cpu" and torch_older_than(2, 6):
        import torch
        return f"torch {torch.__version__} has no FlexAttention for CPU (its C++ lowering came in torch 2.6)"
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


def bucket(length: int) -> int:
    """``length`` rounded up to a whole number of FlexAttention blocks (BLOCK, 128 positions)."""
    return -(-length // BLOCK) * BLOCK


@functools.cache
def compiled_attend():
    """The one compiled FlexAttention call of this process. Static shapes (``dynamic=False``): dynamo keeps one
    graph per (bucketed shape, mask kind, dtype, GQA) under its guards, and inductor's on-disk cache
    (:func:`use_private_inductor_cache`) serves later processes."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    use_private_inductor_cache()
    raise_recompile_limit(torch)

    def attend(q, k, v, block_mask, bias, enable_gqa: bool):
        score_mod = None
        if bias is not None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[b, h, q_idx, kv_idx]
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
    return torch.compile(attend, fullgraph=True, dynamic=False)


def closed_form_mask_mod(kv_len, offset, padding):
    """(kind, mask_mod) for calls without attn_mask: real keys (kv_idx < kv_len), causal when ``offset`` (a 0-d
    tensor, so every length in a bucket shares the graph) is given, key padding when ``padding`` (B, Tk
    bucketed; True = padding) is given. One mask_mod per kind: what each call needs, nothing more."""
    if offset is None and padding is None:
        return "keys", lambda b, h, q_idx, kv_idx: kv_idx < kv_len
    if padding is None:
        return "causal", lambda b, h, q_idx, kv_idx: (kv_idx < kv_len) & (q_idx + offset >= kv_idx)
    if offset is None:
        return "padding", lambda b, h, q_idx, kv_idx: ~padding[b, kv_idx]
    return "causal+padding", lambda b, h, q_idx, kv_idx: (q_idx + offset >= kv_idx) & ~padding[b, kv_idx]


class TorchFlexLoaded(LinearTorchLoaded):
    def setup(self, params: AttentionParams) -> None:
        super().setup(params)
        self.attend = compiled_attend()
        self._masks = (None, None)  # (inputs, masks) of the last call: a prepared callable reuses its BlockMask

    def masks(self, inputs: AttentionInputs):
        """(kind, block_mask, bias or None) in FlexAttention's terms for the bucketed lengths.

        Queries and keys are padded to whole blocks; padded keys are masked out (their values are zeros),
        padded query rows see the real keys and are cut off afterwards. The BlockMask of the last ``inputs``
        is kept, as FlexAttention users keep theirs across layers and steps (building it evaluates the
        mask_mod over the whole Tq x Tk grid)."""
        if self._masks[0] is inputs:
            return self._masks[1]
        torch, c = self.torch, self.config
        from torch.nn.attention.flex_attention import create_block_mask
        tq, tk, b = inputs.tq, inputs.tk, inputs.batch
        tq_b, tk_b = bucket(tq), bucket(tk)
        bias = None
        if inputs.attn_mask is not None:  # one lookup table covers attn_mask, causal and padding together
            allowed_np, additive = full_mask(inputs)
            table = np.zeros((b, c.num_heads, tq_b, tk_b), bool)
            table[:, :, :tq, :tk] = allowed_np
            table[:, :, tq:, :tk] = True  # padded query rows: any real key (their outputs are dropped)
            allowed = torch.as_tensor(table, device=self.device)
            kind, mod = "lookup", lambda b, h, q_idx, kv_idx: allowed[b, h, q_idx, kv_idx]
            if additive is not None:
                full = np.zeros((b, c.num_heads, tq_b, tk_b))
                full[:, :, :tq, :tk] = additive
                bias = self.mask_tensor(full)
                kind = "lookup+bias"
            block_mask = create_block_mask(mod, b, c.num_heads, tq_b, tk_b, device=self.device)
        else:
            kv_len = torch.tensor(tk, device=self.device)
            offset = (torch.tensor(causal_offset(inputs.causal, tq, tk), device=self.device)
                      if inputs.causal else None)
            padding = None
            if inputs.key_padding_mask is not None:
                table = np.ones((b, tk_b), bool)
                table[:, :tk] = inputs.key_padding_mask
                padding = torch.as_tensor(table, device=self.device)
            kind, mod = closed_form_mask_mod(kv_len, offset, padding)
            block_mask = create_block_mask(mod, b if padding is not None else None, None, tq_b, tk_b,
                                           device=self.device)
        self._masks = (inputs, (kind, block_mask, bias))
        return self._masks[1]

    def pad(self, x, length: int):
        """(B, H, T, d) -> (B, H, bucket(T), d), zeros after T."""
        extra = bucket(length) - length
        return x if not extra else self.torch.nn.functional.pad(x, (0, 0, 0, extra))

    def forward_tensors(self, q, k, v, inputs: AttentionInputs, need_weights: bool):
        c = self.config
        qh = self.pad(self.split_heads(self.project(q, "q"), c.num_heads), inputs.tq)
        kh = self.pad(self.split_heads(self.project(k, "k"), c.kv_heads), inputs.tk)
        vh = self.pad(self.split_heads(self.project(v, "v"), c.kv_heads), inputs.tk)
        _, block_mask, bias = self.masks(inputs)
        try:
            out = self.attend(qh, kh, vh, block_mask, bias, c.group > 1)
        except Exception as exc:  # noqa: BLE001 - inductor's refusals (dtype, head size) become skips
            text = str(exc)
            if any(s in text for s in ("NYI", "not supported", "Unsupported", "must be")):
                raise Unsupported(f"FlexAttention refuses this input on {self.device} in {self.dtype_name}: "
                                  f"{text.strip().splitlines()[-1][:200]}") from None
            raise
        out = out[:, :, :inputs.tq]
        b, h, t, dh = out.shape
        return self.project(out.transpose(1, 2).reshape(b, t, h * dh), "o"), None


class TorchFlex(TorchBackend):
    opt_in = "compiles one FlexAttention graph per shape bucket and mask kind: minutes on 2 cores the first time"
    compiles_per_shape = True  # one FlexAttention graph per shape bucket and mask kind
    divergences = POISON_DIVERGENCES
    native_mask_polarity = "mask_mod returns True = take part in attention; additive masks through score_mod"
    native_causal = "no flag: causal is a mask_mod (q_idx + offset >= kv_idx) in a BlockMask, both alignments"

    def __init__(self, device: str = "cpu"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: got {device!r}; accepted: cpu, cuda")
        self.device = device
        self.name = f"torch-flex-{device}"
        # gradients: CUDA only (CPU_NO_BACKWARD); float64: not on CPU (CPU_DTYPES)
        self.capabilities = Capabilities(attention_weights=False, gradients=device == "cuda", devices=(device,),
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
