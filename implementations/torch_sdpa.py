"""torch-sdpa: projections in torch, core through torch.nn.functional.scaled_dot_product_attention.

One backend per SDPA kernel (math, flash, efficient, cudnn) and device (cpu, cuda), each pinned
with ``torch.nn.attention.sdpa_kernel([kernel])`` so torch cannot fall back to another kernel.
On the first call for each input signature the dispatched aten ops are recorded and the call
fails unless the pinned kernel's op really ran. A kernel torch refuses for this device or
input raises mha_harness.Unsupported with torch's own message.

Causal masks: top-left through ``is_causal=True`` (SDPA's flag is top-left when Tq != Tk),
bottom-right through ``torch.nn.attention.bias.causal_lower_right``; combined with other masks,
one explicit boolean mask (True = take part in attention).
"""
from __future__ import annotations

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities, Unsupported
from mha_harness.implementations._torch_common import (
    GPU_DTYPES,
    TORCH_DTYPES,
    LinearTorchLoaded,
    TorchBackend,
    torch_reason,
)
from mha_harness.toolkit.divergences import masked_poison_divergences
from mha_harness.toolkit.masks import full_mask

KERNELS = ("math", "flash", "efficient", "cudnn")
#: the aten op whose presence proves the kernel ran (math shows only its decomposition)
KERNEL_OPS = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention",
              "cudnn": "_scaled_dot_product_cudnn_attention"}

POISON_DIVERGENCES = masked_poison_divergences(
    "SDPA multiplies masked (zero-weight) values in P @ V, and 0 * NaN = NaN (observed on torch 2.13.0 CPU, "
    "math and flash kernels)")


def _sdp_backend(kernel: str):
    from torch.nn.attention import SDPBackend
    return {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel]


def _recorder():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpRecorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    return OpRecorder()


class TorchSdpaLoaded(LinearTorchLoaded):
    def setup(self, params: AttentionParams) -> None:
        super().setup(params)
        self.verified: set = set()

    def _mask_arguments(self, inputs: AttentionInputs):
        """SDPA keyword arguments for the masks: is_causal alone, causal_lower_right alone, or one explicit mask."""
        only_causal = inputs.key_padding_mask is None and inputs.attn_mask is None
        if only_causal and inputs.causal == "top-left":
            return {"is_causal": True}
        if only_causal and inputs.causal == "bottom-right":
            import warnings

            from torch.nn.attention.bias import causal_lower_right
            with warnings.catch_warnings():  # its Tq > Tk NaN warning is about older kernels; the cases check rows
                warnings.simplefilter("ignore", UserWarning)
                return {"attn_mask": causal_lower_right(inputs.tq, inputs.tk)}
        if only_causal:
            return {}
        allowed, additive = full_mask(inputs)
        if additive is None:
            return {"attn_mask": self.mask_tensor(allowed)}
        torch = self.torch
        bias = self.mask_tensor(additive)
        return {"attn_mask": bias.masked_fill(~self.mask_tensor(allowed), -torch.inf)}

    def forward_tensors(self, q, k, v, inputs: AttentionInputs, need_weights: bool):
        c = self.config
        out = self.attend_heads(self.split_heads(self.project(q, "q"), c.num_heads),
                                self.split_heads(self.project(k, "k"), c.kv_heads),
                                self.split_heads(self.project(v, "v"), c.kv_heads), inputs)
        b, h, t, dh = out.shape
        return self.project(out.transpose(1, 2).reshape(b, t, h * dh), "o"), None

    def attend_heads(self, qh, kh, vh, inputs: AttentionInputs):
        """SDPA on projected heads in this backend's kernel (the kernel torch ran verified once per signature)."""
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        kwargs = self._mask_arguments(inputs)
        if self.config.group > 1:
            kwargs["enable_gqa"] = True
        signature = (tuple(qh.shape), tuple(kh.shape), tuple(sorted(kwargs)), qh.requires_grad)
        kernel = self.backend.kernel
        try:
            with sdpa_kernel([_sdp_backend(kernel)]):
                if signature in self.verified:
                    out = sdpa(qh, kh, vh, **kwargs)
                else:
                    with _recorder() as recorder:
                        out = sdpa(qh, kh, vh, **kwargs)
                    self._verify_kernel(recorder.ops)
                    self.verified.add(signature)
        except RuntimeError as exc:
            if "No available kernel" in str(exc) or "No viable backend" in str(exc):
                raise Unsupported(f"torch refuses the {kernel} kernel on {self.device} for this input: "
                                  f"{str(exc).splitlines()[0]}") from None
            raise
        return out

    def _verify_kernel(self, ops: list[str]) -> None:
        kernel = self.backend.kernel
        fused = [op for op in ops if "_scaled_dot_product_" in op and "attention" in op]
        if kernel == "math":
            if fused:
                raise RuntimeError(f"the math kernel was requested but torch ran {fused[0]}")
        elif not any(KERNEL_OPS[kernel] in op for op in fused):
            raise RuntimeError(f"the {kernel} kernel was requested but torch ran {fused or 'the math decomposition'}")


class TorchSdpa(TorchBackend):
    native_mask_polarity = "attn_mask bool: True = take part in attention; float: added to scores"
    native_causal = ("is_causal=True is top-left (the top-left variants run through it); "
                     "bottom-right via causal_lower_right")
    divergences = POISON_DIVERGENCES

    def __init__(self, kernel: str = "math", device: str = "cpu"):
        if kernel not in KERNELS:
            raise ValueError(f"kernel: got {kernel!r}; accepted: {', '.join(KERNELS)}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: got {device!r}; accepted: cpu, cuda")
        self.kernel, self.device = kernel, device
        self.name = f"torch-sdpa-{kernel}-{device}"
        self.capabilities = Capabilities(attention_weights=False, gradients=True, devices=(device,),
                                         dtypes=TORCH_DTYPES if device == "cpu" else GPU_DTYPES)
        self._refusal = None

    def availability(self) -> str | None:
        reason = torch_reason(self.device)
        if reason:
            return reason
        if self._refusal is None:
            self._refusal = self._probe()
        return self._refusal or None

    def _probe(self) -> str:
        """'' when the kernel runs a plain call on this device, else torch's refusal.

        On CUDA the flash and cuDNN kernels take only half precision, so float32 is tried first and then
        bfloat16 and float16: the backend is available when any declared dtype runs (a dtype the kernel
        refuses is reported per case with torch's message)."""
        import torch
        from torch.nn.attention import sdpa_kernel
        dtypes = (torch.float32,) if self.device == "cpu" else (torch.float32, torch.bfloat16, torch.float16)
        refusal = ""
        for dtype in dtypes:
            x = torch.randn(1, 2, 8, 16, device=self.device, dtype=dtype)
            try:
                with sdpa_kernel([_sdp_backend(self.kernel)]):
                    torch.nn.functional.scaled_dot_product_attention(x, x, x)
                return ""
            except RuntimeError as exc:
                first_line = str(exc).splitlines()[0]
                refusal = refusal or f"torch refuses the {self.kernel} kernel on {self.device}: {first_line}"
        return refusal

    def native_parameter_shapes(self, config: AttentionConfig):
        from mha_harness.contract.params import make_params
        return {n: tuple(t.shape) for n, t in TorchSdpaLoaded(self, make_params(config), "float32").w.items()}

    def load_native(self, params: AttentionParams, dtype: str) -> TorchSdpaLoaded:
        return TorchSdpaLoaded(self, params, dtype)

    def direct_callable(self, inputs: AttentionInputs, params: AttentionParams, *, dtype: str = "float32"):
        """``x @ W`` projections, ``F.scaled_dot_product_attention`` under this backend's pinned kernel, ``@ W_o``:
        the layer as a user writes it in torch (no masks but top-left causal, no biases, no grouped-query heads)."""
        c = params.config
        if inputs.key_padding_mask is not None or inputs.attn_mask is not None or inputs.causal == "bottom-right":
            raise Unsupported(f"{self.name}: the direct call takes no masks other than top-left causal")
        if c.bias or c.kv_heads != c.num_heads:
            raise Unsupported(f"{self.name}: the direct call takes no biases and no grouped-query heads")
        import torch
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        from mha_harness.implementations._torch_common import synchronize
        loaded = self.load(params, dtype=dtype)
        w = {name: loaded.w[name] for name in ("W_q", "W_k", "W_v", "W_o")}
        xq, xk, xv = (loaded.tensor(getattr(inputs, n)) for n in ("query", "key", "value"))
        b, tq, tk, h, dh = inputs.batch, inputs.tq, inputs.tk, c.num_heads, c.d_head
        is_causal, kernel, device = inputs.causal == "top-left", _sdp_backend(self.kernel), self.device

        def direct():
            with torch.no_grad(), sdpa_kernel([kernel]):
                q = (xq @ w["W_q"]).reshape(b, tq, h, dh).transpose(1, 2)
                k = (xk @ w["W_k"]).reshape(b, tk, h, dh).transpose(1, 2)
                v = (xv @ w["W_v"]).reshape(b, tk, h, dh).transpose(1, 2)
                out = sdpa(q, k, v, is_causal=is_causal).transpose(1, 2).reshape(b, tq, h * dh) @ w["W_o"]
            synchronize(device)
            return out
        return direct


def backends():
    return [TorchSdpa(kernel, device) for device in ("cpu", "cuda") for kernel in KERNELS]
