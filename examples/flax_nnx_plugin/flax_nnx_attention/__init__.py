"""flax.nnx.MultiHeadAttention wrapped, as it is, as mha-harness backends (written by a user of the harness from
its README alone; tests/test_flax_nnx_example.py keeps it passing).

Three backends, one per way model code calls the layer:

* ``nnx-mha-self``:  ``layer(x)``            self-attention (inputs="self")
* ``nnx-mha-cross``: ``layer(x_q, x_kv)``    encoder-decoder cross-attention (inputs="shared_kv")
* ``nnx-mha``:       ``layer(q, k, v)``      separate query/key/value (inputs="separate"; accepts every form)

Installed (``pip install ./examples/flax_nnx_plugin``) the three are registered; from this folder,
``mha-harness check --backend-spec flax_nnx_attention:backends`` checks them without installing.

What the wrapper has to know: nnx keeps per-head kernels, query/key/value (in, heads, d_head) and out
(heads, d_head, out), which are the harness's x @ W matrices reshaped (head n is columns n*d_head... of W_q, rows
n*d_head... of W_o); nnx's mask is True = may attend, so the harness's masks go through
``mha_harness.masks.combined_mask(inputs, polarity="attend")``; and the divergences below are what nnx really does,
each verified by the harness, not trusted.
"""
from __future__ import annotations

import dataclasses

import numpy as np

import mha_harness
from mha_harness.toolkit.divergences import (
    masked_poison_divergences,
    precision_divergences,
    uniform_fully_masked_divergences,
)

mha_harness.configure_jax()  # float64 + persistent compile cache, as the built-in JAX backends

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

JNP_DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16}
N_ARGS = {"self": 1, "shared_kv": 2, "separate": 3}  # how many arrays the layer's call takes


def build_module(config, dtype):
    """The nnx layer as model code builds it; made in ``dtype`` before any weight is copied in."""
    return nnx.MultiHeadAttention(
        num_heads=config.num_heads, in_features=config.d_model, qkv_features=config.d_model,
        out_features=config.d_model, num_kv_heads=config.kv_heads,
        dtype=dtype, param_dtype=dtype, use_bias=config.bias, decode=False, deterministic=True,
        keep_rngs=False, rngs=nnx.Rngs(0))


def to_native_weights(params, dtype):
    """Harness x @ W weights -> nnx kernels: query/key/value (in, heads, d_head), out (heads, d_head, out)."""
    c = params.config
    h, kvh, dh, d = c.num_heads, c.kv_heads, c.d_head, c.d_model
    a = lambda x: jnp.asarray(np.asarray(x, np.float64), dtype)  # noqa: E731
    w = {("query", "kernel"): a(params.W_q.reshape(d, h, dh)),
         ("key", "kernel"): a(params.W_k.reshape(d, kvh, dh)),
         ("value", "kernel"): a(params.W_v.reshape(d, kvh, dh)),
         ("out", "kernel"): a(params.W_o.reshape(h, dh, d))}
    if c.bias:
        w.update({("query", "bias"): a(params.b_q.reshape(h, dh)),
                  ("key", "bias"): a(params.b_k.reshape(kvh, dh)),
                  ("value", "bias"): a(params.b_v.reshape(kvh, dh)),
                  ("out", "bias"): a(params.b_o)})
    return w


def to_nnx_mask(inputs):
    """The harness's masks (causal, key padding, bool attn_mask) as nnx's: True = may attend."""
    m = mha_harness.masks.combined_mask(inputs, polarity="attend")
    return None if m is None else jnp.asarray(m)


def call_layer(module, xs, mask, need_weights):
    """How model code calls the layer: layer(x), layer(x_q, x_kv) or layer(q, k, v)."""
    return module(*xs, mask=mask, sow_weights=need_weights)


class LoadedNNXAttention(mha_harness.LoadedAttention):
    def __init__(self, params, dtype, backend):
        self.dtype = JNP_DTYPES[dtype]
        self.cfg, self.form = params.config, backend.capabilities.inputs
        module = build_module(params.config, self.dtype)
        weights = backend.native_weights(params, self.dtype)
        for path, var in nnx.state(module, nnx.Param).flat_state():
            var.set_value(weights[path])
        self.graphdef, self.params, self.rest = nnx.split(module, nnx.Param, ...)
        graphdef, rest, to_mask, call = self.graphdef, self.rest, backend.to_mask, backend.call

        def run(params_, xs, mask, need_weights):
            m = nnx.merge(graphdef, params_, rest)
            out = call(m, xs, mask, need_weights)
            weights = nnx.state(m, nnx.Intermediate)["attention_weights"].get_value()[0] if need_weights else None
            return out, weights

        def vjp(params_, xs, mask, cot):
            out, pull = jax.vjp(lambda p, xs_: run(p, xs_, mask, False)[0], params_, xs)
            return pull(cot)

        self.to_mask = to_mask
        self._run = jax.jit(run, static_argnums=(3,))
        self._vjp = jax.jit(vjp)
        self._grad = jax.jit(jax.grad(lambda p, xs, mask: run(p, xs, mask, False)[0].sum(), argnums=(0, 1)))

    def _xs(self, inputs):
        arrays = (inputs.query, inputs.key, inputs.value)[:N_ARGS[self.form]]
        return tuple(jnp.asarray(np.ascontiguousarray(x), self.dtype) for x in arrays)

    def _np(self, y):
        return np.asarray(y.astype(jnp.float32) if y.dtype == jnp.bfloat16 else y)

    def compute(self, inputs, *, need_weights=False):
        args = (self.params, self._xs(inputs), self.to_mask(inputs), bool(need_weights))
        try:
            out, weights = self._run(*args)
        except jax.errors.JaxRuntimeError as e:
            # jax 0.10.2 CPU: the jitted bfloat16 layer at length 1 fails to compile ("Algorithm not supported by
            # the ElementalIrEmitter: ALG_DOT_BF16_BF16_F32"); the same layer runs op by op
            if "ElementalIrEmitter" not in str(e):
                raise
            with jax.disable_jit():
                out, weights = self._run(*args)
        return mha_harness.AttentionOutput(self._np(out), None if weights is None else self._np(weights))

    def compute_vjp(self, inputs, cotangent):
        return self.native_gradients(self._vjp(self.params, self._xs(inputs), self.to_mask(inputs),
                                               jnp.asarray(cotangent, self.dtype)))

    def native_gradients(self, value):  # (parameter gradients, input gradients), from _vjp or _grad, as NumPy
        dp, dxs = value
        d, flat = self.cfg.d_model, dict(dp.flat_state())
        g = lambda path: self._np(flat[path].get_value())  # noqa: E731
        grads = dict(zip(("query", "key", "value"), (self._np(x) for x in dxs)))
        grads.update(W_q=g(("query", "kernel")).reshape(d, -1), W_k=g(("key", "kernel")).reshape(d, -1),
                     W_v=g(("value", "kernel")).reshape(d, -1), W_o=g(("out", "kernel")).reshape(-1, d))
        if self.cfg.bias:
            grads.update(b_q=g(("query", "bias")).reshape(-1), b_k=g(("key", "bias")).reshape(-1),
                         b_v=g(("value", "bias")).reshape(-1), b_o=g(("out", "bias")))
        return grads

    def prepare(self, inputs, *, backward=False):  # for mha-harness bench: the whole layer on every call
        xs, mask = self._xs(inputs), self.to_mask(inputs)
        if backward:
            def step():  # returns the gradients of output.sum(), which native_gradients reads
                return jax.block_until_ready(self._grad(self.params, xs, mask))
        else:
            def step():  # returns the output: bench checks one call's output against the reference
                return self._run(self.params, xs, mask, False)[0].block_until_ready()
        step()  # compile outside the timings
        return step

    def native_output(self, value):  # what step() returned, as NumPy
        return self._np(value)


FLAX = f"flax {flax.__version__} / jax {jax.__version__} CPU"


class NNXMultiHeadAttention(mha_harness.AttentionBackend):
    name = "nnx-mha"
    capabilities = mha_harness.Capabilities(
        inputs="separate",  # layer(q, k, v)
        causal_alignments=("top-left", "bottom-right"),  # both through the boolean mask we build
        key_padding_mask=True, bool_attn_mask=True,
        additive_attn_mask=False,  # nnx.MultiHeadAttention.__call__ takes a boolean mask only, no bias
        cross_attention=True, grouped_query=True, bias=True,  # num_kv_heads, use_bias
        attention_weights=True,  # sow_weights=True -> Intermediate 'attention_weights'
        gradients=True, dtypes=("float32", "float64", "bfloat16"))
    native_causal = "is_causal=True not used: both alignments are passed inside the boolean mask"
    native_mask_polarity = "mask True = may attend (as the harness)"
    compiles_per_shape = True
    divergences = (
        uniform_fully_masked_divergences(
            "nnx.dot_product_attention masks logits with the dtype's most negative finite value, so a row with "
            f"every key masked softmaxes to uniform weights ({FLAX})")
        + masked_poison_divergences(
            f"nnx multiplies masked (zero-weight) values in the weights @ V einsum, 0 * NaN = NaN ({FLAX})")
        + precision_divergences(
            "float64", "float32",
            f"nnx.dot_product_attention computes float64 inputs at float32 precision inside (max error ~1e-7 "
            f"against a float64 reference; {FLAX})",
            ["check_output_matches_reference", "check_gradients_match_reference",
             "check_fully_masked_rows_output_zeros"]))

    # the hooks the deliberately broken copies override
    native_weights = staticmethod(to_native_weights)
    to_mask = staticmethod(to_nnx_mask)
    call = staticmethod(call_layer)

    def load_native(self, params, dtype):
        return LoadedNNXAttention(params, dtype, self)

    def native_parameter_shapes(self, config):
        module = build_module(config, jnp.float32)
        return {"/".join(map(str, p)): tuple(v.get_value().shape)
                for p, v in nnx.state(module, nnx.Param).flat_state()}

    def versions(self):
        return {"numpy": np.__version__, "jax": jax.__version__, "flax": flax.__version__}


class NNXSelfAttention(NNXMultiHeadAttention):
    name = "nnx-mha-self"
    capabilities = dataclasses.replace(NNXMultiHeadAttention.capabilities, inputs="self", cross_attention=False)


class NNXCrossAttention(NNXMultiHeadAttention):
    name = "nnx-mha-cross"
    capabilities = dataclasses.replace(NNXMultiHeadAttention.capabilities, inputs="shared_kv")


def backends():
    return [NNXSelfAttention(), NNXCrossAttention(), NNXMultiHeadAttention()]
