"""mha-harness plugin wrapping llama_jax_attention.model.LlamaAttention, a hand-written JAX Llama attention layer
(the model code, unchanged: self-attention, grouped-query heads, Hugging Face's rotate_half rotary, no biases,
jitted). Written by an outside user from README.md and docs/ alone; it passed `check --quick` at the first try.

    pip install ./examples/jax_llama_plugin && mha-harness check --quick --backend llama-jax
    # or, from examples/jax_llama_plugin: mha-harness check --quick --backend-spec llama_jax_attention:backends
"""
from __future__ import annotations

import numpy as np

import mha_harness
from mha_harness.masks import combined_mask
from mha_harness.toolkit.divergences import uniform_fully_masked_divergences

mha_harness.configure_jax()        # float64 on, shared compile cache: before any array is built

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from llama_jax_attention import model as _model  # noqa: E402

#: the position every token gets where the config has no rotary (docs/plugins.md: a layer whose rotary is always on
#: gives every token one and the same position, so that everything but positions is checked)
CONSTANT_POSITION = 7


class _Loaded(mha_harness.LoadedAttention):
    def __init__(self, params, dtype, model_module):
        cfg = params.config
        self.dtype = jnp.dtype(dtype)
        self.cfg = cfg
        self.model_module = model_module
        as_dt = lambda w: jnp.asarray(np.asarray(w), dtype=self.dtype)   # noqa: E731
        self.layer = model_module.LlamaAttention(
            as_dt(params.W_q), as_dt(params.W_k), as_dt(params.W_v), as_dt(params.W_o),
            num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, rope_theta=float(cfg.rotary_base))

    # --- turning a harness call into the model's call -------------------------------------------------------
    def _positions(self, inputs):
        t = inputs.tq
        if self.cfg.rotary is None:
            return jnp.full((1, t), CONSTANT_POSITION, dtype=jnp.int32)
        q_pos, _k_pos = mha_harness.rotary_positions(inputs.tq, inputs.tk)   # self form: both 0..T-1
        return jnp.asarray(q_pos, dtype=jnp.int32)[None]

    def _args(self, inputs):
        x = jnp.asarray(np.asarray(inputs.query), dtype=self.dtype)
        mask = combined_mask(inputs, polarity="attend", causal=False)
        mask = None if mask is None else jnp.asarray(mask)
        return x, self._positions(inputs), mask, inputs.causal is not None

    def _fn(self, positions, mask, causal):
        m, layer = self.model_module, self.layer

        def f(x, wq, wk, wv, wo):
            return m.llama_attention(x, wq, wk, wv, wo, positions, mask, num_heads=layer.num_heads,
                                     num_kv_heads=layer.num_kv_heads, rope_theta=layer.rope_theta,
                                     causal=causal)
        return f

    # --- conformance ----------------------------------------------------------------------------------------
    def compute(self, inputs, *, need_weights=False):
        x, positions, mask, causal = self._args(inputs)
        out = self.layer(x, positions, mask, causal=causal)
        return mha_harness.AttentionOutput(np.asarray(out))

    def compute_vjp(self, inputs, cotangent):
        x, positions, mask, causal = self._args(inputs)
        out, vjp = jax.vjp(self._fn(positions, mask, causal), x, *self.layer.weights)
        dx, dwq, dwk, dwv, dwo = vjp(jnp.asarray(np.asarray(cotangent), dtype=out.dtype))
        return {"query": np.asarray(dx), "W_q": np.asarray(dwq), "W_k": np.asarray(dwk),
                "W_v": np.asarray(dwv), "W_o": np.asarray(dwo)}

    # --- benchmarks -----------------------------------------------------------------------------------------
    def prepare(self, inputs, backward=False):
        x, positions, mask, causal = self._args(inputs)
        if not backward:
            def call():
                return self.layer(x, positions, mask, causal=causal).block_until_ready()
            return call
        grad_fn = jax.jit(jax.grad(lambda *a: self._fn(positions, mask, causal)(*a).sum(),
                                   argnums=(0, 1, 2, 3, 4)))
        weights = self.layer.weights

        def call_backward():
            g = grad_fn(x, *weights)
            jax.block_until_ready(g)
            return g
        return call_backward

    def native_gradients(self, value):
        dx, dwq, dwk, dwv, dwo = value
        return {"query": np.asarray(dx), "W_q": np.asarray(dwq), "W_k": np.asarray(dwk),
                "W_v": np.asarray(dwv), "W_o": np.asarray(dwo)}


class LlamaJax(mha_harness.AttentionBackend):
    name = "llama-jax"
    model_module = _model
    capabilities = mha_harness.Capabilities(
        inputs="self",
        causal_alignments=("top-left",),
        bias=False,
        additive_attn_mask=False,       # the layer takes a bool mask only
        grouped_query=True,
        gradients=True,
        dtypes=("float32", "float64"),
        rotary=("half_split",),
        d_head_multiple=2,
    )
    divergences = uniform_fully_masked_divergences(
        "masked scores are set to finfo(dtype).min, so a row with every key masked averages V uniformly",
        with_empty_causal_rows=False)
    native_causal = "causal=True: jnp.tril (top-left)"
    native_mask_polarity = "bool mask, True = may attend"
    compiles_per_shape = True

    def load_native(self, params, dtype):
        return _Loaded(params, dtype, self.model_module)

    def native_parameter_shapes(self, config):
        d, h, kv, dh = config.d_model, config.num_heads, config.kv_heads, config.d_head
        return {"wq": (d, h * dh), "wk": (d, kv * dh), "wv": (d, kv * dh), "wo": (h * dh, d)}

    def versions(self):
        return {"numpy": np.__version__, "jax": jax.__version__}


def backends():
    """The entry point's (and ``--backend-spec llama_jax_attention:backends``'s) backends."""
    return [LlamaJax()]
