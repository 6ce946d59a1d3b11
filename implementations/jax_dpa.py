"""jax-dpa: projections in JAX, core through jax.nn.dot_product_attention.

implementation="xla" on CPU (and a "cudnn" variant on GPU). Layout (batch, T, heads, d_head);
grouped-query heads are native. Causal: top-left through ``is_causal=True`` (JAX's flag is
top-left when Tq != Tk), bottom-right and every other mask through the boolean ``mask``
(True = take part in attention); additive masks through ``bias``. A sliding window (``config.sliding_window``)
through ``local_window_size=(w - 1, 0)`` where a query's position is its index in the call (jax counts the window
from the index, top-left), through the mask elsewhere.
"""
from __future__ import annotations

import functools

from mha_harness.contract.api import (
    AttentionConfig,
    AttentionInputs,
    AttentionParams,
    Capabilities,
    Unsupported,
)
from mha_harness.contract.conventions import window_offset
from mha_harness.implementations._jax_common import GPU_DTYPES, JaxBackend, JaxLoaded, linear_tree
from mha_harness.toolkit.divergences import (
    masked_poison_divergences,
    precision_divergences,
    uniform_fully_masked_divergences,
)
from mha_harness.toolkit.masks import full_mask

_UNIFORM = ("jax.nn.dot_product_attention (xla) masks logits with a large finite negative value, so a row "
            "with every key masked softmaxes to uniform weights (observed on jax 0.10.2 CPU)")
_FLOAT32_INSIDE = ("jax.nn.dot_product_attention computes float64 inputs at float32 precision inside (observed max "
                   "error ~1e-7 against the float64 reference on jax 0.10.2 CPU)")
DIVERGENCES = uniform_fully_masked_divergences(_UNIFORM) + precision_divergences(
    # with a single key the softmax is exactly 1 and no precision is lost: single_token and single_key pass
    "float64", "float32", _FLOAT32_INSIDE, ("check_output_matches_reference",), when={"variant": (
        "short_with_bias", "eight_heads", "d_head_64_with_bias", "d_head_80", "long_with_bias", "more_keys",
        "long_keys_with_bias", "grouped_query", "grouped_query_more_keys", "multi_query")},
) + precision_divergences("float64", "float32", _FLOAT32_INSIDE,
                          ("check_lesson_worked_example_head_weights", "check_gradients_match_reference",
                           "check_fully_masked_rows_output_zeros", "check_sliding_window_output_matches_reference"),
                          ) + masked_poison_divergences("dot_product_attention multiplies masked (zero-weight) values "
                                                        "in P @ V, and 0 * NaN = NaN (observed on jax 0.10.2 CPU)")


@functools.cache
def _compiled(num_heads: int, kv_heads: int, is_causal: bool, implementation: str,
              local_window: tuple[int, int] | None = None):
    import jax

    def apply(w, query, key, value, mask, bias):
        def proj(x, which, n):
            y = x @ w[f"W_{which}"]
            y = y + w[f"b_{which}"] if f"b_{which}" in w else y
            b, t, width = y.shape
            return y.reshape(b, t, n, width // n)
        out = jax.nn.dot_product_attention(proj(query, "q", num_heads), proj(key, "k", kv_heads),
                                           proj(value, "v", kv_heads), bias=bias, mask=mask, is_causal=is_causal,
                                           local_window_size=local_window, implementation=implementation)
        b, t, h, dh = out.shape
        y = out.reshape(b, t, h * dh) @ w["W_o"]
        return (y + w["b_o"] if "b_o" in w else y), None
    return jax.jit(apply)


class JaxDpaLoaded(JaxLoaded):
    def setup(self, params: AttentionParams) -> None:
        self.params = linear_tree(self, params)

    def native_inputs(self, inputs: AttentionInputs) -> dict:
        is_causal = inputs.causal == "top-left" and inputs.key_padding_mask is None and inputs.attn_mask is None
        window, local = self.config.sliding_window, None
        if window is not None and window_offset(inputs.causal, inputs.tq, inputs.tk) == 0:
            # jax's local_window_size counts from each query's index in the call (its window mask is top-left): it
            # is the layer's window where a query's position is its index, and the later keys stay visible without
            # a causal mask; elsewhere (a bottom-right call with Tq != Tk) the window goes into the mask
            local, window = (window - 1, 0 if inputs.causal else inputs.tk), None
        allowed, additive = full_mask(inputs.replace(causal=None) if is_causal else inputs, sliding_window=window)
        return {"query": self.array(inputs.query), "key": self.array(inputs.key), "value": self.array(inputs.value),
                "mask": self.array(allowed), "bias": self.array(additive), "is_causal": is_causal,
                "local_window": local}

    def call(self, params, a: dict, need_weights: bool):
        fn = _compiled(self.config.num_heads, self.config.kv_heads, a["is_causal"], self.backend.implementation,
                       a["local_window"])
        try:
            return fn(params, a["query"], a["key"], a["value"], a["mask"], a["bias"])
        except Exception as exc:  # noqa: BLE001 - only jax's own refusals are turned into skips
            self._refused(exc)
            raise

    def decode_attention(self, inputs: AttentionInputs):
        # bottom-right, through the mask (is_causal and local_window_size are top-left), with the layer's window
        allowed = full_mask(inputs, sliding_window=self.config.sliding_window)[0]
        implementation = self.backend.implementation

        def core(q, k, v, masks):
            import jax
            return jax.nn.dot_product_attention(q, k, v, mask=masks["mask"], implementation=implementation)
        return "positions_first", core, {"mask": self.array(allowed)}

    def _vjp(self, inputs: AttentionInputs, cotangent):
        try:  # the jitted vjp compiles after tracing ``call``: a refusal at compile time is a skip too
            return super()._vjp(inputs, cotangent)
        except Unsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - only jax's own refusals are turned into skips
            self._refused(exc)
            raise

    def _refused(self, exc: Exception) -> None:
        """Raise Unsupported when ``exc`` is jax refusing this implementation for the input."""
        text = str(exc)
        if "not supported" in text.lower() or self.backend.implementation == "cudnn":
            raise Unsupported(f"jax refuses dot_product_attention(implementation={self.backend.implementation!r}) "
                              f"in {self.dtype_name} on {self.backend.device} for this input: "
                              f"{(text.splitlines() or [''])[0][:200]}") from None

    def canonical_gradients(self, grads) -> dict:
        return dict(grads)


class JaxDpa(JaxBackend):
    divergences = DIVERGENCES
    native_mask_polarity = "mask bool: True = take part in attention; additive masks go to bias"
    native_causal = "is_causal=True is top-left (the top-left variants run through it); bottom-right via mask"

    def __init__(self, implementation: str = "xla", device: str = "cpu"):
        self.implementation, self.device = implementation, device
        self.name = "jax-dpa" if device == "cpu" else f"jax-dpa-{implementation}-{device}"
        # float16 on CPU: jax refuses every call ("precision F16_F16_F32 is not supported by dot_general on CPU")
        self.capabilities = Capabilities(attention_weights=False, gradients=True, devices=(device,),
                                         dtypes=("float32", "float64", "bfloat16") if device == "cpu" else GPU_DTYPES,
                                         sliding_window=True)

    def native_parameter_shapes(self, config: AttentionConfig):
        from mha_harness.contract.params import make_params
        return {n: tuple(a.shape) for n, a in JaxDpaLoaded(self, make_params(config), "float32").params.items()}

    def load_native(self, params: AttentionParams, dtype: str) -> JaxDpaLoaded:
        return JaxDpaLoaded(self, params, dtype)

    def direct_callable(self, inputs: AttentionInputs, params: AttentionParams, *, dtype: str = "float32"):
        """A directly jitted layer: ``x @ W`` projections, ``jax.nn.dot_product_attention`` with this backend's
        implementation, ``@ W_o`` (no masks but top-left causal, no biases, no grouped-query heads)."""
        c = params.config
        if inputs.key_padding_mask is not None or inputs.attn_mask is not None or inputs.causal == "bottom-right":
            raise Unsupported(f"{self.name}: the direct call takes no masks other than top-left causal")
        if c.bias or c.kv_heads != c.num_heads:
            raise Unsupported(f"{self.name}: the direct call takes no biases and no grouped-query heads")
        import jax
        loaded = self.load(params, dtype=dtype)
        w = {name: loaded.params[name] for name in ("W_q", "W_k", "W_v", "W_o")}
        xq, xk, xv = (loaded.array(getattr(inputs, n)) for n in ("query", "key", "value"))
        h, is_causal, implementation = c.num_heads, inputs.causal == "top-left", self.implementation

        @jax.jit
        def layer(w, xq, xk, xv):
            q, k, v = ((x @ w[n]).reshape(x.shape[0], x.shape[1], h, -1)
                       for x, n in ((xq, "W_q"), (xk, "W_k"), (xv, "W_v")))
            out = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation=implementation)
            return out.reshape(xq.shape[0], xq.shape[1], -1) @ w["W_o"]

        def direct():
            return jax.block_until_ready(layer(w, xq, xk, xv))
        direct()  # compile here, outside any timing
        return direct


def backends():
    return [JaxDpa("xla", "cpu"), JaxDpa("xla", "gpu"), JaxDpa("cudnn", "gpu")]
