"""flax-mha: an adapter over the real flax.linen.MultiHeadDotProductAttention.

Canonical weights are reshaped into flax's kernels: query/key/value kernels (d_model, heads,
d_head) and biases (heads, d_head); the out kernel (heads, d_head, d_model). Masks go through
flax's boolean ``mask`` (True = attend; shape (batch, heads|1, Tq, Tk)); causal masks of either
alignment become explicit masks. Per-head weights are captured with ``sow_weights=True``.
The parameter count comes from the module's own initialised param tree. The decode step is flax's own
autoregressive cache (the same module with ``decode=True``): one new query per call. A layer whose config asks for
``qk_norm="layer_per_head_no_bias"`` is the module built with ``normalize_qk=True`` (flax's LayerNorm of each
head's q and k, without a bias, epsilon 1e-6), its gains ``g_q``, ``g_k`` loaded as ``query_ln`` and ``key_ln``'s
scales.
"""
from __future__ import annotations

import functools

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities, Unsupported
from mha_harness.implementations._jax_common import GPU_DTYPES, JaxBackend, JaxLoaded
from mha_harness.toolkit.divergences import masked_poison_divergences, uniform_fully_masked_divergences
from mha_harness.toolkit.masks import full_mask

_FINITE_MIN = ("flax's dot_product_attention masks logits with the dtype's most negative finite value, so a row "
               "with every key masked softmaxes to uniform weights (observed on flax 0.12.8 / jax 0.10.2 CPU)")
DIVERGENCES = uniform_fully_masked_divergences(_FINITE_MIN) + masked_poison_divergences(
    "flax multiplies masked (zero-weight) values in the weights @ V einsum, and 0 * NaN = NaN "
    "(observed on flax 0.12.8 CPU)")


def to_flax_tree(params: AttentionParams) -> dict:
    """Canonical x @ W parameters as flax's {'query': {'kernel', 'bias'}, ..., 'out': {...}} tree."""
    c = params.config
    h, dh, d = c.num_heads, c.d_head, c.d_model
    tree = {name: {"kernel": getattr(params, f"W_{w}").reshape(d, h, dh)} for name, w in
            (("query", "q"), ("key", "k"), ("value", "v"))}
    tree["out"] = {"kernel": params.W_o.reshape(h, dh, d)}
    if c.qk_norm is not None:  # normalize_qk's LayerNorms: one scale of d_head each, shared by the heads
        tree["query_ln"], tree["key_ln"] = {"scale": params.g_q}, {"scale": params.g_k}
    if c.bias:
        for name, w in (("query", "q"), ("key", "k"), ("value", "v")):
            tree[name]["bias"] = getattr(params, f"b_{w}").reshape(h, dh)
        tree["out"]["bias"] = params.b_o
    return tree


def from_flax_tree(tree, config: AttentionConfig) -> dict:
    d = config.d_model
    out = {f"W_{w}": tree[name]["kernel"].reshape(d, d) for name, w in (("query", "q"), ("key", "k"), ("value", "v"))}
    out["W_o"] = tree["out"]["kernel"].reshape(d, d)
    if "query_ln" in tree:
        out["g_q"], out["g_k"] = tree["query_ln"]["scale"], tree["key_ln"]["scale"]
    if "bias" in tree["out"]:
        out.update({f"b_{w}": tree[name]["bias"].reshape(d)
                    for name, w in (("query", "q"), ("key", "k"), ("value", "v"))})
        out["b_o"] = tree["out"]["bias"]
    return out


#: the q/k norm ``MultiHeadDotProductAttention(normalize_qk=True)`` builds (its LayerNorms' default epsilon)
NORMALIZE_QK = "layer_per_head_no_bias"
NORMALIZE_QK_EPS = 1e-6


@functools.cache
def _module(num_heads: int, d_model: int, bias: bool, dtype_name: str, decode: bool = False,
            normalize_qk: bool = False):
    import flax.linen as nn

    from mha_harness.implementations._jax_common import jax_dtype
    dtype = jax_dtype(dtype_name)
    return nn.MultiHeadDotProductAttention(num_heads=num_heads, qkv_features=d_model, out_features=d_model,
                                           use_bias=bias, dtype=dtype, param_dtype=dtype, deterministic=True,
                                           decode=decode, normalize_qk=normalize_qk)


@functools.cache
def _decode_programs(num_heads: int, d_model: int, bias: bool, dtype_name: str, tk: int, normalize_qk: bool = False):
    """The jitted (fill, step) of flax's autoregressive cache for Tk positions. ``fill(tree, cached)``: the module's
    cache variables (``cached_key``, ``cached_value``: (batch, Tk, heads, d_head); ``cache_index``) holding the
    Tk - 1 cached positions' keys and values, projected with the module's own key and value kernels, and the last
    slot next. ``step(tree, x_new, cache)``: the module with ``decode=True`` on x_new, which writes x_new's key and
    value into the slot at ``cache_index`` and attends over the slots up to it; the cache comes back (donated, so
    the write is in place) with ``cache_index`` left at the last slot, so every step writes the same slot. With
    ``normalize_qk`` the cached keys go through the module's own key LayerNorm (flax's, with ``key_ln``'s scale), as
    the module's keys do before it caches them."""
    import flax.linen as nn
    import jax
    jnp = jax.numpy
    module = _module(num_heads, d_model, bias, dtype_name, decode=True, normalize_qk=normalize_qk)

    def project(tree, x, which):
        y = jnp.einsum("btd,dhe->bthe", x, tree[which]["kernel"])
        y = y + tree[which]["bias"] if "bias" in tree[which] else y
        if which == "key" and normalize_qk:
            dtype = tree[which]["kernel"].dtype
            y = nn.LayerNorm(use_bias=False, dtype=dtype, param_dtype=dtype).apply({"params": tree["key_ln"]}, y)
        return y

    def fill(tree, cached):
        slot = [(0, 0), (0, 1), (0, 0), (0, 0)]  # room for x_new's one position
        return {"cached_key": jnp.pad(project(tree, cached, "key"), slot),
                "cached_value": jnp.pad(project(tree, cached, "value"), slot),
                "cache_index": jnp.array(tk - 1, jnp.int32)}

    def step(tree, x_new, cache):
        out, state = module.apply({"params": tree, "cache": cache}, x_new, mutable=["cache"])
        return out, {**state["cache"], "cache_index": cache["cache_index"]}
    return jax.jit(fill), jax.jit(step, donate_argnums=(2,))


@functools.cache
def _compiled(num_heads: int, d_model: int, bias: bool, dtype_name: str, need_weights: bool,
              normalize_qk: bool = False):
    import jax
    module = _module(num_heads, d_model, bias, dtype_name, normalize_qk=normalize_qk)

    def apply(tree, query, key, value, mask):
        if not need_weights:
            return module.apply({"params": tree}, query, key, value, mask=mask), None
        out, state = module.apply({"params": tree}, query, key, value, mask=mask, sow_weights=True,
                                  mutable=["intermediates"])
        return out, state["intermediates"]["attention_weights"][0]
    return jax.jit(apply)


class FlaxMhaLoaded(JaxLoaded):
    def setup(self, params: AttentionParams) -> None:
        self.params = self.jax.tree_util.tree_map(self.array, to_flax_tree(params))

    def native_inputs(self, inputs: AttentionInputs) -> dict:
        allowed, _ = full_mask(inputs)
        return {"query": self.array(inputs.query), "key": self.array(inputs.key), "value": self.array(inputs.value),
                "mask": self.array(allowed)}

    def call(self, params, a: dict, need_weights: bool):
        c = self.config
        fn = _compiled(c.num_heads, c.d_model, c.bias, self.dtype_name, need_weights, c.qk_norm is not None)
        return fn(params, a["query"], a["key"], a["value"], a["mask"])

    def canonical_gradients(self, grads) -> dict:
        return from_flax_tree(grads, self.config)

    def prepare_decode_step(self, inputs: AttentionInputs):
        """Flax's own decode path: the cache filled (untimed) with the cached positions' projected keys and values;
        each step runs the module with ``decode=True`` on x_new. Its cache takes one new query per call."""
        if inputs.tq != 1:
            raise Unsupported(f"flax's autoregressive cache (decode=True) takes one new query per call; this step "
                              f"has Tq = {inputs.tq} (flax raises 'Autoregressive cache shape error')")
        c = self.config
        return self.stepping(*_decode_programs(c.num_heads, c.d_model, c.bias, self.dtype_name, inputs.tk,
                                               c.qk_norm is not None), inputs)


class FlaxMha(JaxBackend):
    needs_flax = True
    divergences = DIVERGENCES
    native_mask_polarity = "mask bool: True = attend, shape (batch, heads|1, Tq, Tk); no additive masks"
    native_causal = "no causal flag (flax's make_causal_mask is top-left); masks passed explicitly"

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.name = "flax-mha" if device == "cpu" else f"flax-mha-{device}"
        self.capabilities = Capabilities(additive_attn_mask=False, grouped_query=False, attention_weights=True,
                                         gradients=True,
                                         devices=(device,), qk_norms=(NORMALIZE_QK,),
                                         dtypes=("float32", "float64", "bfloat16") if device == "cpu" else GPU_DTYPES)

    def native_parameter_shapes(self, config: AttentionConfig):
        import jax
        import jax.numpy as jnp
        module = _module(config.num_heads, config.d_model, config.bias, "float32",
                         normalize_qk=config.qk_norm is not None)
        x = jax.ShapeDtypeStruct((1, 2, config.d_model), jnp.float32)
        # the module's own init, evaluated abstractly: the same param tree's shapes without running (and compiling,
        # op by op) the initialisers
        tree = jax.eval_shape(module.init, jax.random.key(0), x, x, x)["params"]
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(path): tuple(np.shape(leaf)) for path, leaf in leaves}

    def load_native(self, params: AttentionParams, dtype: str) -> FlaxMhaLoaded:
        eps = params.config.qk_norm_eps
        if params.config.qk_norm is not None and eps != NORMALIZE_QK_EPS:
            raise Unsupported(f"qk_norm_eps: got {eps!r}; accepted: {NORMALIZE_QK_EPS!r} (normalize_qk's LayerNorms "
                              "take flax's default epsilon; MultiHeadDotProductAttention has no argument for it)")
        return FlaxMhaLoaded(self, params, dtype)


def backends():
    return [FlaxMha("cpu"), FlaxMha("gpu")]
