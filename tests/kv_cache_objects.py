"""KV-cache attention layers as people write them for decoding (NumPy, and PyTorch with autograd), wrapped with
``inputs="kv_cache"``, and copies with the bugs such layers have: the new keys put before the cached ones, the
step's causal mask applied top-left (its offset forgotten), one new token attending over the cache before its own
key is appended, the cache's keys and values unpacked in the other order, and a backward with the new keys and
values detached. Written against the public API only."""
from __future__ import annotations

import numpy as np

import mha_harness
from mha_harness import masks


class KVCacheLayer:
    """Multi-head attention with a key/value cache: ``fill(x_past)`` projects the cached positions once,
    ``step(x_new, cache)`` projects the new positions, appends their keys and values and attends causally: new
    query i sees every cached key and the new keys up to its own position."""

    def __init__(self, weights: dict, num_heads: int, *, new_keys_first: bool = False, top_left: bool = False,
                 one_token_skips_itself: bool = False, cache_kv_swapped: bool = False):
        self.w, self.h = weights, num_heads
        self.new_keys_first, self.top_left = new_keys_first, top_left
        self.one_token_skips_itself, self.cache_kv_swapped = one_token_skips_itself, cache_kv_swapped

    def _proj(self, x, name):
        y = x @ self.w[f"W_{name}"] + self.w.get(f"b_{name}", 0.0)
        b, t, width = y.shape
        return y.reshape(b, t, self.h, width // self.h).transpose(0, 2, 1, 3)

    def fill(self, x_past):
        return self._proj(x_past, "k"), self._proj(x_past, "v")

    def step(self, x_new, cache, bias=None):
        k_past, v_past = cache[::-1] if self.cache_kv_swapped else cache  # the pair unpacked in the other order
        k_new, v_new = self._proj(x_new, "k"), self._proj(x_new, "v")
        if self.one_token_skips_itself and x_new.shape[1] == 1 and k_past.shape[2]:  # attends before appending
            k_new, v_new = k_new[:, :, :0], v_new[:, :, :0]
        order = ((k_new, k_past), (v_new, v_past)) if self.new_keys_first else ((k_past, k_new), (v_past, v_new))
        k, v = (np.concatenate(pair, axis=2) for pair in order)
        q = self._proj(x_new, "q")
        tq, tk = q.shape[2], k.shape[2]
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
        offset = 0 if self.top_left else tk - tq
        if tk < k_past.shape[2] + tq:  # the skipped new key: the query sees the whole cache (and its masks)
            offset, bias = tk, None if bias is None else bias[..., :tk]
        keep = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset
        if bias is not None:  # -inf where the call's masks hide a key
            keep = keep & np.isfinite(bias)
            scores = scores + np.where(keep, bias, 0.0)
        scores = np.where(keep, scores, -np.inf)  # a NaN in a masked cached key must not reach the softmax
        top = scores.max(-1, keepdims=True)
        e = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
        p = e / np.maximum(e.sum(-1, keepdims=True), np.finfo(e.dtype).tiny)
        out = p @ np.where(np.isfinite(v), v, 0.0)  # a NaN in a masked cached value must not reach 0 * NaN
        b, h, t, d = out.shape
        return out.transpose(0, 2, 1, 3).reshape(b, t, h * d) @ self.w["W_o"] + self.w.get("b_o", 0.0)


class _Loaded(mha_harness.LoadedAttention):
    def __init__(self, layer: KVCacheLayer, dtype):
        self.layer, self.dtype = layer, dtype

    def compute(self, inputs, *, need_weights=False):
        x_new = np.asarray(inputs.query, self.dtype)
        cache = self.layer.fill(np.asarray(inputs.cached, self.dtype))
        bias = masks.additive_mask(inputs, causal=False, dtype=self.dtype)  # the layer masks causally itself
        return mha_harness.AttentionOutput(self.layer.step(x_new, cache, bias))

    def prepare(self, inputs, *, backward=False):
        """The whole step every call: the cached positions projected (the cache filled), then the new ones."""
        x_new, x_cached = np.asarray(inputs.query, self.dtype), np.asarray(inputs.cached, self.dtype)
        bias = masks.additive_mask(inputs, causal=False, dtype=self.dtype)
        return lambda: self.layer.step(x_new, self.layer.fill(x_cached), bias)

    def prepare_decode_step(self, inputs):
        """A decode step as a model runs it: the cache filled here, once; each call runs the step on x_new."""
        x_new, cache = np.asarray(inputs.query, self.dtype), self.layer.fill(np.asarray(inputs.cached, self.dtype))
        return lambda: self.layer.step(x_new, cache)


class KVCacheAttention(mha_harness.AttentionBackend):
    """The layer's decode step as the harness calls it: ``layer.step(x_new, layer.fill(inputs.cached))``."""

    name = "kv-cache-numpy"
    capabilities = mha_harness.Capabilities(inputs="kv_cache", always_causal=True,
                                            causal_alignments=("bottom-right",), grouped_query=False,
                                            dtypes=("float32", "float64"))
    layer_options: dict = {}

    def load_native(self, params, dtype):
        weights = {k: np.asarray(v, dtype) for k, v in params.arrays().items()}
        return _Loaded(KVCacheLayer(weights, params.config.num_heads, **self.layer_options), dtype)


class NewKeysFirst(KVCacheAttention):
    name = "kv-cache-new-keys-first"
    layer_options = {"new_keys_first": True}


class OneTokenSkipsItself(KVCacheAttention):
    """A step that, for one new token against a non-empty cache, attends over the cache before appending the new
    key and value (the token does not see itself): right for every call the harness made before the one-new-token
    variant (an eleventh stranger's bug)."""

    name = "kv-cache-one-token-skips-itself"
    layer_options = {"one_token_skips_itself": True}


class CacheKVSwapped(KVCacheAttention):
    """A step that unpacks its cache's (keys, values) pair in the other order: the cached positions' keys read from
    the value cache and their values from the key cache, its own new ones right (an outside user's bug, which
    failed with figures only)."""

    name = "kv-cache-kv-swapped"
    layer_options = {"cache_kv_swapped": True}


class OffsetForgotten(KVCacheAttention):
    name = "kv-cache-top-left-step"
    layer_options = {"top_left": True}


class _TorchLoaded(mha_harness.LoadedAttention):
    """A PyTorch KV-cache layer (q/k/v/out nn.Linear, a cache of projected keys and values) with autograd
    gradients: d/dx_new (x_new's uses as queries, new keys and new values) and d/dx_cached."""

    def __init__(self, params, dtype):
        import torch
        self.torch, self.h = torch, params.config.num_heads
        self.dt = {"float32": torch.float32, "float64": torch.float64}[dtype]
        d, c = params.config.d_model, params.config
        self.lin = {}
        for name in "qkvo":
            w = np.asarray(getattr(params, f"W_{name}"))
            b = getattr(params, f"b_{name}")
            lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=c.bias, dtype=self.dt)
            with torch.no_grad():
                lin.weight.copy_(torch.as_tensor(w.T))
                if b is not None:
                    lin.bias.copy_(torch.as_tensor(np.asarray(b)))
            self.lin[name] = lin
        self.d = d

    def _heads(self, y):
        b, t, width = y.shape
        return y.reshape(b, t, self.h, width // self.h).transpose(1, 2)

    detach_new_kv = False  # the bug of TorchGradientOfNewRowsAsQueriesOnly
    keys_past_diagonal = 0  # 1: the bug of TorchOneFutureKey

    def _step(self, x_new, x_cached, bias):
        torch = self.torch
        kv_new = x_new.detach() if self.detach_new_kv else x_new
        k = torch.cat([self._heads(self.lin["k"](x_cached)), self._heads(self.lin["k"](kv_new))], dim=2)
        v = torch.cat([self._heads(self.lin["v"](x_cached)), self._heads(self.lin["v"](kv_new))], dim=2)
        q = self._heads(self.lin["q"](x_new))
        tq, tk = q.shape[2], k.shape[2]
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        keep = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq) + self.keys_past_diagonal
        if bias is not None:
            bias = torch.as_tensor(bias, dtype=self.dt)
            keep = keep & torch.isfinite(bias)
            scores = scores + torch.where(keep, bias, torch.zeros((), dtype=self.dt))
        seen = keep.any(-1, keepdim=True)  # a row with no key to attend to outputs 0, with finite gradients
        scores = scores.masked_fill(~keep, float("-inf")).masked_fill(~seen, 0.0)
        p = torch.softmax(scores, dim=-1) * seen
        v = torch.where(torch.isfinite(v), v, torch.zeros((), dtype=self.dt))
        out = (p @ v).transpose(1, 2).reshape(x_new.shape[0], tq, -1)
        return self.lin["o"](out)

    def _tensors(self, inputs):
        torch = self.torch
        x_new = torch.tensor(np.asarray(inputs.query), dtype=self.dt, requires_grad=True)
        x_cached = torch.tensor(np.asarray(inputs.cached), dtype=self.dt, requires_grad=True)
        return x_new, x_cached, masks.additive_mask(inputs, causal=False)

    def compute(self, inputs, *, need_weights=False):
        with self.torch.no_grad():
            x_new, x_cached, bias = self._tensors(inputs)
            return mha_harness.AttentionOutput(self._step(x_new, x_cached, bias).numpy())

    def compute_vjp(self, inputs, cotangent):
        for lin in self.lin.values():
            lin.zero_grad(set_to_none=True)
        x_new, x_cached, bias = self._tensors(inputs)
        self._step(x_new, x_cached, bias).backward(self.torch.as_tensor(np.asarray(cotangent), dtype=self.dt))
        grads = {"query": x_new.grad.numpy()}
        if inputs.tk > inputs.tq:
            grads["key"] = x_cached.grad.numpy()
        for name, lin in self.lin.items():
            grads[f"W_{name}"] = lin.weight.grad.numpy().T
            if lin.bias is not None:
                grads[f"b_{name}"] = lin.bias.grad.numpy()
        return grads


class TorchKVCacheAttention(mha_harness.AttentionBackend):
    """The PyTorch layer's decode step, with gradients: what the cases check of a KV-cache layer's backward."""

    name = "kv-cache-torch"
    capabilities = mha_harness.Capabilities(inputs="kv_cache", always_causal=True,
                                            causal_alignments=("bottom-right",), grouped_query=False, gradients=True,
                                            dtypes=("float32", "float64"))

    def load_native(self, params, dtype):
        return _TorchLoaded(params, dtype)


class TorchGradientOfNewRowsAsQueriesOnly(TorchKVCacheAttention):
    """A KV-cache layer's backward that returns d/dx_new through the queries alone (the new keys and values
    detached, as a cache that stores them without their graph does)."""

    name = "kv-cache-torch-new-kv-detached"

    def load_native(self, params, dtype):
        loaded = _TorchLoaded(params, dtype)
        loaded.detach_new_kv = True
        return loaded


class TorchOneFutureKey(TorchKVCacheAttention):
    """A KV-cache layer whose causal mask lets each new query see the next new token (GPT-2's tril buffer sliced one
    key too wide): its gradients reach the future, which the causal Jacobian case names."""

    name = "kv-cache-torch-one-future-key"

    def load_native(self, params, dtype):
        loaded = _TorchLoaded(params, dtype)
        loaded.keys_past_diagonal = 1
        return loaded
