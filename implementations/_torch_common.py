"""What every torch backend shares: availability, dtypes, devices, masks, autograd and timing.

torch is imported lazily, so listing backends never fails where torch is missing.
"""
from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import warnings

import numpy as np

from mha_harness.contract.api import (
    AttentionBackend,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    LoadedAttention,
)
from mha_harness.contract.conventions import QK_NORMS_CENTRED, QK_NORMS_PER_HEAD, rotary_positions
from mha_harness.util.install import install_hint

TORCH_DTYPES = ("float32", "float64", "bfloat16", "float16")
#: where the compiled torch backends keep inductor's on-disk cache (empty: leave inductor's own default)
CACHE_ENV = "MHA_HARNESS_TORCH_CACHE"
_INDUCTOR_CACHE: list[str] = []
GPU_DTYPES = ("float32", "bfloat16", "float16")


def torch_reason(device: str = "cpu") -> str | None:
    """None when torch (and, for device 'cuda', a CUDA device) is usable, else the reason."""
    if importlib.util.find_spec("torch") is None:
        return f"torch is not installed ({install_hint('torch')})"
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def inductor_cache_dir() -> str | None:
    """``$MHA_HARNESS_TORCH_CACHE``, default ``~/.cache/mha-harness/torchinductor``; None when set empty."""
    cache = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "mha-harness", "torchinductor"))
    return cache or None


def use_private_inductor_cache() -> str | None:
    """Once per process, before the first torch.compile: point inductor's on-disk cache (compiled C++/Triton
    kernels and FX graphs that later runs load and execute) at a folder only this user can write.

    Inductor's default, ``/tmp/torchinductor_$USER``, sits in a shared folder another user could create
    first. An explicit ``$TORCHINDUCTOR_CACHE_DIR`` other than that default is the user's choice and is kept;
    otherwise
    :func:`inductor_cache_dir` made private by :func:`mha_harness.util.private_dir.private_dir` (mode 0700),
    and when that folder is refused (a warning says why) a fresh private temporary folder. Returns the folder."""
    if _INDUCTOR_CACHE:
        return _INDUCTOR_CACHE[0]
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from mha_harness.util.private_dir import private_dir
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder == os.path.abspath(default_cache_dir()):
        folder = None  # importing torch._dynamo writes inductor's default there: not the user's choice
    wanted = inductor_cache_dir()
    if folder is None and wanted:
        folder, refused = private_dir(wanted)
        if refused:
            warnings.warn(f"mha-harness: inductor cache not used: {refused}; compiling into a private temporary "
                          "folder", RuntimeWarning, stacklevel=2)
            folder = tempfile.mkdtemp(prefix="mha-harness-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    _INDUCTOR_CACHE.append(folder)
    return folder


def torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def qk_normed(y, gain, kind: str | None, d_head: int, eps: float, bias=None):
    """The q or k projection ``y`` (B, T, width) through its norm: torch's RMSNorm, ``y * rsqrt(mean(y^2) + eps) *
    gain``, over each head's ``d_head`` features (``kind="rms_per_head"``, Qwen 3's and Gemma 3's q_norm/k_norm) or
    the whole width (``"rms_over_projection"``, OLMo 2's); torch's LayerNorm over each head's features, with
    ``bias`` (``"layer_per_head"``, timm's) or without (``"layer_per_head_no_bias"``, ViT-22B's); unchanged for
    ``kind=None``. In the
    tensors' dtype (torch's kernels, not the formula written out: autograd through a float16 ``rsqrt`` overflows
    at a projection near 0, where d rsqrt(v)/dv = -v^-1.5 / 2 is about 5e8 at eps = 1e-6)."""
    import torch.nn.functional as F
    if kind is None:
        return y
    b, t, width = y.shape
    groups = y.reshape(b, t, width // d_head, d_head) if kind in QK_NORMS_PER_HEAD else y
    if kind in QK_NORMS_CENTRED:
        normed = F.layer_norm(groups, (groups.shape[-1],), weight=gain, bias=bias, eps=eps)
    else:
        normed = F.rms_norm(groups, (groups.shape[-1],), weight=gain, eps=eps)
    return normed.reshape(b, t, width)


def scaled_frequencies(inv_freq, scaling, base: float = 10_000.0):
    """The rotary frequencies ``inv_freq`` (at ``base``) rescaled as transformers' ``rope_type`` of ``scaling.kind``
    does (:class:`~mha_harness.contract.conventions.RotaryScaling`): ``"linear"`` divides them all by the factor;
    ``"llama3"`` divides those whose wavelength exceeds ``original_max_positions / low_freq_factor``, keeps those below
    ``original_max_positions / high_freq_factor`` and blends the ones between; ``"yarn"`` blends the divided and the
    kept ones with a linear ramp over the frequency index (its attention factor: :func:`rotary_turned`)."""
    import torch
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        low, high = scaling.yarn_ramp(2 * inv_freq.shape[-1], base)
        high = high + 0.001 if high == low else high
        index = torch.arange(inv_freq.shape[-1], device=inv_freq.device, dtype=inv_freq.dtype)
        ramp = ((index - low) / (high - low)).clamp(0, 1)
        return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)
    old = scaling.original_max_positions
    wavelength = 2 * math.pi / inv_freq
    low, high = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    llama = torch.where(wavelength > low, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * llama / scaling.factor + smooth * llama
    return torch.where(~(wavelength < high) & ~(wavelength > low), smoothed, llama)


def rotary_turned(x, positions, kind: str | None, base: float, dims: int | None = None, scaling=None):
    """Heads ``x`` (B, n, T, d_head) at ``positions`` (T,) turned by rotary embeddings of ``kind``: Hugging Face's
    ``rotate_half`` form, ``x * cos + rotate_half(x) * sin`` with the angles repeated over both halves, for
    ``"half_split"``; the pairs (2i, 2i + 1) for ``"interleaved"``; ``x`` for None. ``dims`` (None: all d_head): a
    partial rotary turns only each head's first ``dims`` features and passes the rest, as GPT-NeoX's and Phi's
    layers split ``x[..., :rotary_ndims]`` from ``x[..., rotary_ndims:]``. The angles ``p / base ** (2i / dims)``
    (rescaled by ``scaling``: :func:`scaled_frequencies`) in float32 (float64 for a float64 layer), as transformers
    computes them, cos and sin (times YaRN's attention factor) then cast to the heads' dtype."""
    import torch
    if kind is None:
        return x
    width = x.shape[-1] if dims is None else dims
    if width < x.shape[-1]:
        return torch.cat([rotary_turned(x[..., :width], positions, kind, base, scaling=scaling), x[..., width:]],
                         dim=-1)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (base ** (torch.arange(0, width, 2, dtype=torch.int64, device=x.device).to(work) / width))
    inv_freq = scaled_frequencies(inv_freq, scaling, base)
    angles = positions.to(device=x.device, dtype=work)[:, None] * inv_freq[None, :]
    scale = 1.0 if scaling is None else scaling.attention_scale  # YaRN's attention factor, as transformers applies it
    cos, sin = (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)
    if kind == "half_split":
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        rotate_half = torch.cat([-x[..., width // 2:], x[..., :width // 2]], dim=-1)
        return x * cos + rotate_half * sin
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def call_positions(tq: int, tk: int, device=None):
    """The rotary positions of a call's queries and keys as int64 tensors
    (:func:`~mha_harness.contract.conventions.rotary_positions`: the queries are the last Tq of Tk positions)."""
    import torch
    return tuple(torch.as_tensor(p, device=device) for p in rotary_positions(tq, tk))


class TorchLoaded(LoadedAttention):
    """Parameters as torch tensors on the backend's device; subclasses implement ``forward_tensors``."""

    def __init__(self, backend: TorchBackend, params: AttentionParams, dtype: str):
        import torch
        self.torch = torch
        self.backend, self.device, self.dtype_name = backend, backend.device, dtype
        self.dtype = torch_dtype(dtype)
        self.config = params.config
        self.setup(params)

    def setup(self, params: AttentionParams) -> None:
        raise NotImplementedError

    def tensor(self, array, requires_grad: bool = False):
        t = self.torch.as_tensor(np.asarray(array, np.float64), device=self.device).to(self.dtype)
        return t.requires_grad_(requires_grad)

    def mask_tensor(self, array):
        if array is None:
            return None
        array = np.array(array)  # a writable, contiguous copy (broadcast views are read-only)
        if array.dtype == np.bool_:
            return self.torch.as_tensor(array, device=self.device)
        return self.torch.as_tensor(array, device=self.device).to(self.dtype)

    def forward_tensors(self, q, k, v, inputs: AttentionInputs, need_weights: bool):
        """Return (output tensor, weights tensor or None)."""
        raise NotImplementedError

    def to_numpy(self, t):
        return None if t is None else t.detach().to(self.torch.float64 if self.dtype != self.torch.float64
                                                      else self.dtype).cpu().numpy()

    def compute(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        with self.torch.no_grad():
            q, k, v = (self.tensor(getattr(inputs, n)) for n in ("query", "key", "value"))
            out, weights = self.forward_tensors(q, k, v, inputs, need_weights)
        return AttentionOutput(self.to_numpy(out), self.to_numpy(weights) if need_weights else None)

    def parameter_tensors(self) -> dict:
        """Canonical name -> leaf tensor, and how to turn its gradient into the canonical layout."""
        raise NotImplementedError

    def native_gradients(self, value) -> dict[str, np.ndarray]:
        """What the forward + backward call returned (each leaf's ``.grad`` after its backward: the inputs', and the
        parameters' under :meth:`parameter_tensors`' names) in the canonical names and layout."""
        params = self.parameter_tensors()
        out = {n: self.to_numpy(value[n]) for n in ("query", "key", "value")}
        for name, (tensor, to_canonical) in params.items():
            g = value[name]
            out.update(to_canonical(np.zeros(tuple(tensor.shape)) if g is None else self.to_numpy(g)))
        return out

    def compute_vjp(self, inputs: AttentionInputs, cotangent: np.ndarray) -> dict[str, np.ndarray]:
        torch = self.torch
        leaves = {n: self.tensor(getattr(inputs, n), requires_grad=True) for n in ("query", "key", "value")}
        params = self.parameter_tensors()
        with torch.enable_grad():
            out, _ = self.forward_tensors(leaves["query"], leaves["key"], leaves["value"], inputs, False)
            tensors = list(leaves.values()) + [t for t, _ in params.values()]
            grads = torch.autograd.grad(out, tensors, self.tensor(cotangent), allow_unused=True)
        result = {n: self.to_numpy(g) for n, g in zip(leaves, grads[:3])}
        for (tensor, to_canonical), g in zip(params.values(), grads[3:]):
            result.update(to_canonical(np.zeros(tuple(tensor.shape)) if g is None else self.to_numpy(g)))
        return result

    def prepare(self, inputs: AttentionInputs, *, backward: bool = False):
        torch = self.torch
        q, k, v = (self.tensor(getattr(inputs, n), requires_grad=backward) for n in ("query", "key", "value"))
        device = self.device
        if not backward:
            def run():
                with torch.no_grad():
                    out, _ = self.forward_tensors(q, k, v, inputs, False)
                synchronize(device)
                return out
            run.native_inputs = (q, k, v)  # so a direct baseline can run on the very same tensors
            return run
        params = self.parameter_tensors()  # parameters take gradients too, as in training
        leaves = [q, k, v] + [t for t, _ in params.values()]
        grad = torch.ones((inputs.batch, inputs.tq, self.config.d_model), dtype=self.dtype, device=device)

        def run_backward():
            out, _ = self.forward_tensors(q, k, v, inputs, False)
            out.backward(grad)
            synchronize(device)
            grads = {"query": q.grad, "key": k.grad, "value": v.grad,
                     **{name: t.grad for name, (t, _) in params.items()}}
            for leaf in leaves:  # the caller holds them alone, as after zero_grad(set_to_none=True): the next call
                leaf.grad = None  # starts with none resident, so its peak memory counts the gradients it makes
            return grads
        return run_backward


class TorchBackend(AttentionBackend):
    device = "cpu"

    @property
    def memory_method(self) -> str:
        return "cuda" if self.device == "cuda" else "rss"

    def availability(self) -> str | None:
        return torch_reason(self.device)

    def versions(self) -> dict[str, str]:
        import torch
        out = {"numpy": np.__version__, "torch": torch.__version__}
        if self.device == "cuda" and torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
        return out


class LinearTorchLoaded(TorchLoaded):
    """Parameters kept in the canonical x @ W layout; projections and head split with explicit torch ops."""

    def setup(self, params: AttentionParams) -> None:
        self.w = {name: self.tensor(array) for name, array in params.arrays().items()}

    def parameter_tensors(self) -> dict:
        out = {}
        for name, t in self.w.items():
            t.requires_grad_(True)
            out[name] = (t, lambda g, n=name: {n: g})
        return out

    def project(self, x, which: str):
        """x @ W (+ b); for q and k then the layer's q/k norm (:func:`qk_normed`), when its config has one."""
        y = x @ self.w[f"W_{which}"]
        bias = self.w.get(f"b_{which}")
        y = y if bias is None else y + bias
        if which in ("q", "k") and self.config.qk_norm:
            y = qk_normed(y, self.w[f"g_{which}"], self.config.qk_norm, self.config.d_head,
                          self.config.qk_norm_eps, self.w.get(f"beta_{which}"))
        return y

    def rotate(self, heads, positions):
        """Heads of q or k (B, n, T, d_head) at ``positions`` turned by the layer's rotary embeddings (unchanged
        without them: :func:`rotary_turned`)."""
        c = self.config
        return rotary_turned(heads, positions, c.rotary, c.rotary_base, c.rotary_dims, c.rotary_scaling)

    def split_heads(self, x, n_heads: int):
        """(B, T, n*d_head) -> (B, n, T, d_head)."""
        b, t, _ = x.shape
        return x.reshape(b, t, n_heads, self.config.d_head).transpose(1, 2)

    def attend_heads(self, qh, kh, vh, inputs: AttentionInputs):
        """Each head's attention from projected heads (B, heads, T, d_head; K and V with kv_heads heads) under the
        masks of ``inputs``: the heads' output (B, heads, Tq, d_head). The decode step needs it."""
        raise NotImplementedError(f"{type(self).__name__} has no attention core of its own (attend_heads)")

    def prepare_decode_step(self, inputs: AttentionInputs):
        """The cached positions' keys and values projected (keys turned at their positions: :meth:`rotate`) once into
        a zeroed cache of all Tk slots; each step projects x_new, writes its keys and values into the last Tq slots,
        attends over the cache (:meth:`attend_heads`) and applies W_o."""
        if type(self).attend_heads is LinearTorchLoaded.attend_heads:  # no attention core of its own
            raise NotImplementedError(f"{type(self).__name__} has no decode step (attend_heads)")
        torch, c, start = self.torch, self.config, inputs.tk - inputs.tq
        x_new = self.tensor(inputs.query)
        with torch.no_grad():
            cache = {which: torch.zeros((inputs.batch, c.kv_heads, inputs.tk, c.d_head), dtype=self.dtype,
                                        device=self.device) for which in "kv"}
            cached = self.tensor(inputs.cached)
            q_pos, k_pos = call_positions(inputs.tq, inputs.tk, self.device)
            turned = {"k": self.rotate, "v": lambda heads, at: heads}
            for which, kv in cache.items():
                kv[:, :, :start] = turned[which](self.split_heads(self.project(cached, which), c.kv_heads),
                                                 k_pos[:start])
        device = self.device

        def step():
            with torch.no_grad():
                for which, kv in cache.items():
                    kv[:, :, start:] = turned[which](self.split_heads(self.project(x_new, which), c.kv_heads),
                                                     k_pos[start:])
                heads = self.attend_heads(self.rotate(self.split_heads(self.project(x_new, "q"), c.num_heads),
                                                      q_pos), cache["k"], cache["v"], inputs)
                b, h, t, dh = heads.shape
                out = self.project(heads.transpose(1, 2).reshape(b, t, h * dh), "o")
            synchronize(device)
            return out
        return step

    def native_output(self, value) -> np.ndarray:
        return self.to_numpy(value)
