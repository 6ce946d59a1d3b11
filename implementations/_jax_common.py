"""What the JAX backends share: availability, dtypes, devices, masks, jit caching, vjp and timing.

jax is imported lazily. Compiled functions are module-level ``jax.jit`` objects, so XLA's
cache is keyed by shape and shared by every loaded layer: the suite compiles each shape once.
The vjp is one jitted program per layer configuration too (forward and backward together), cached the same way.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import threading

import numpy as np

from mha_harness.contract.api import (
    AttentionBackend,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    LoadedAttention,
)
from mha_harness.toolkit.jax_setup import configure_jax
from mha_harness.util.install import install_hint

# JAX takes 75% of a GPU's memory in every process by default: a worker checking one backend, or a sweep that
# also runs torch, would leave the others nothing. Set before jax is first imported; a user's own setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

JAX_DTYPES = ("float32", "float64", "bfloat16", "float16")
GPU_DTYPES = ("float32", "bfloat16", "float16")


def jax_reason(device: str = "cpu", needs_flax: bool = False) -> str | None:
    if importlib.util.find_spec("jax") is None:
        return f"jax is not installed ({install_hint('jax')})"
    if needs_flax and importlib.util.find_spec("flax") is None:
        return f"flax is not installed ({install_hint('jax')})"
    if device == "gpu":
        import jax
        try:
            jax.devices("gpu")
        except RuntimeError:
            return f"no GPU device for jax {jax.__version__} (jax.devices('gpu') found none)"
    return None


def jax_dtype(name: str):
    configure_jax()
    import jax.numpy as jnp
    return {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


class JaxLoaded(LoadedAttention):
    """Parameters as jax arrays on the backend's device. Subclasses give ``apply`` (a jitted pure function)."""

    def __init__(self, backend: JaxBackend, params: AttentionParams, dtype: str):
        import jax
        self.jax = jax
        self.backend, self.dtype_name, self.config = backend, dtype, params.config
        self.dtype = jax_dtype(dtype)
        self.device = jax.devices(backend.device)[0]
        self.setup(params)

    def setup(self, params: AttentionParams) -> None:
        raise NotImplementedError

    def precision(self):
        """float32 means float32: on GPU, XLA's default matmul precision may compute float32 products in TF32
        (10-bit mantissa); float32/float64 layers there run at "highest". Half precision and CPU are unchanged."""
        if self.backend.device != "cpu" and self.dtype_name in ("float32", "float64"):
            return self.jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    def array(self, x):
        """NumPy -> device array in this layer's dtype. The cast happens on the host (ml_dtypes covers
        bfloat16): casting on the device would compile one tiny XLA program per shape and dtype."""
        if x is None:
            return None
        x = np.asarray(x)
        if x.dtype != np.bool_:
            x = x.astype(np.dtype(self.dtype))
        return self.jax.device_put(x, self.device)

    def to_numpy(self, x):
        return None if x is None else np.asarray(x).astype(np.float64)

    def native_inputs(self, inputs: AttentionInputs) -> dict:
        """Device arrays and static options for ``apply``."""
        raise NotImplementedError

    def call(self, params, arrays: dict, need_weights: bool):
        """(output, weights or None) from device arrays."""
        raise NotImplementedError

    def compute(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        with self.precision():
            out, weights = self.call(self.params, self.native_inputs(inputs), need_weights)
        return AttentionOutput(self.to_numpy(out), self.to_numpy(weights) if need_weights else None)

    def canonical_gradients(self, grads) -> dict:
        """The parameter gradient tree in canonical names and layout."""
        raise NotImplementedError

    def compute_vjp(self, inputs: AttentionInputs, cotangent: np.ndarray) -> dict[str, np.ndarray]:
        with self.precision():
            return self._vjp(inputs, cotangent)

    def _vjp(self, inputs: AttentionInputs, cotangent: np.ndarray) -> dict[str, np.ndarray]:
        native = self.native_inputs(inputs)
        static = {k: v for k, v in native.items() if isinstance(v, STATIC_OPTIONS)}
        arrays = {k: v for k, v in native.items() if k not in static}
        g_params, gq, gk, gv = self.vjp_program(static)(self.params, arrays, self.array(cotangent))
        out = {"query": self.to_numpy(gq), "key": self.to_numpy(gk), "value": self.to_numpy(gv)}
        # to NumPy before the layout change: reshaping device arrays would run (and compile) one op at a time
        g_params = self.jax.tree_util.tree_map(np.asarray, g_params)
        out.update({n: self.to_numpy(g) for n, g in self.canonical_gradients(g_params).items()})
        return out

    def vjp_program(self, static: dict):
        """The jitted ``(params, arrays, cotangent) -> (d params, d query, d key, d value)`` of this layer's ``call``
        with the ``static`` options: forward and backward in ONE compiled program per input shape (eager
        ``jax.vjp`` of the jitted forward compiles two: the forward with its residuals, then the transpose).

        Cached per (layer type, backend, config, dtype, static options), everything ``call`` may depend on besides
        its arguments, so every layer with that configuration shares it; the traced ``call`` belongs to a copy of
        this layer without its parameters (the cache must not keep them alive)."""
        key = (type(self), self.backend, self.config, self.dtype_name, tuple(sorted(static.items())))
        with _VJP_LOCK:
            program = _VJP_PROGRAMS.get(key)
            if program is None:
                program = _VJP_PROGRAMS[key] = _jitted_vjp(self.jax, _without_params(self), static)
        return program

    def prepare(self, inputs: AttentionInputs, *, backward: bool = False):
        jax = self.jax
        native = self.native_inputs(inputs)
        static = {k: v for k, v in native.items() if isinstance(v, STATIC_OPTIONS)}
        arrays = {k: v for k, v in native.items() if k not in static}
        if not backward:
            fn = jax.jit(lambda params, a, masks: self.call(params, {**a, **masks, **static}, False)[0])
        else:
            def loss(params, a, masks):
                return self.call(params, {**a, **masks, **static}, False)[0].astype(jax.numpy.float32).sum()
            # gradients to the parameters and the query, key and value arrays; the masks (a bool mask has no
            # gradient at all) are arguments that are not differentiated
            fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
        masks = {k: v for k, v in arrays.items() if k not in _DIFFERENTIABLE_INPUTS}
        arrays = {k: v for k, v in arrays.items() if k in _DIFFERENTIABLE_INPUTS}
        with self.precision():
            jax.block_until_ready(fn(self.params, arrays, masks))  # compile here, outside any timing

        def run():
            with self.precision():
                return jax.block_until_ready(fn(self.params, arrays, masks))

        def memory_analysis():  # XLA's own account of the compiled program's buffers, for mha-harness fidelity
            with self.precision():
                return fn.lower(self.params, arrays, masks).compile().memory_analysis()
        run.memory_analysis = memory_analysis
        return run

    def decode_attention(self, inputs: AttentionInputs):
        """What the decode step attends with: (layout, core, masks). ``layout`` is "heads_first" (B, heads, T,
        d_head) or "positions_first" (B, T, heads, d_head); ``core(q, k, v, masks)`` is a traceable function of
        projected heads in that layout (K and V with kv_heads heads, all Tk positions) returning the heads' output in
        it; ``masks`` a dict of device arrays (or None) from ``inputs``'s causal mask, passed to ``core``."""
        raise NotImplementedError(f"{type(self).__name__} has no decode step (decode_attention)")

    def prepare_decode_step(self, inputs: AttentionInputs):
        """The cached positions' keys and values projected once into a cache of all Tk slots (zeros in the last Tq);
        each step projects x_new, writes its keys and values into those slots (``lax.dynamic_update_slice`` on the
        donated cache: in place), attends (:meth:`decode_attention`'s core) and applies W_o. Both programs are
        compiled here, outside any timing."""
        layout, core, masks = self.decode_attention(inputs)
        fill, step = _decode_programs(self.jax, self.config, inputs.tq, inputs.tk, layout, core)
        return self.stepping(fill, step, inputs, masks)

    def stepping(self, fill, step, inputs: AttentionInputs, *extra):
        """The decode step's callable from its jitted ``fill(params, cached) -> cache`` and ``step(params, x_new,
        cache, *extra) -> (output, cache)`` (the cache donated): the cache filled and both programs compiled here,
        untimed; each call runs one step on the cache the previous call returned."""
        jax = self.jax
        x_new = self.array(inputs.query)
        with self.precision():
            state = {"cache": jax.block_until_ready(fill(self.params, self.array(inputs.cached)))}
            probe = fill(self.params, self.array(inputs.cached))  # the first step donates a cache of its own
            jax.block_until_ready(step(self.params, x_new, probe, *extra))  # compiles the step

        def run():
            with self.precision():
                out, state["cache"] = step(self.params, x_new, state["cache"], *extra)
                return jax.block_until_ready(out)
        return run

    def native_output(self, value) -> np.ndarray:
        return self.to_numpy(value)

    def native_gradients(self, value) -> dict[str, np.ndarray]:
        """What the forward + backward call returned, ``jax.grad``'s (parameter tree, {query, key, value}), in the
        canonical names and layout (as :meth:`_vjp` converts them)."""
        g_params, g_arrays = value
        out = {name: self.to_numpy(g) for name, g in g_arrays.items()}
        g_params = self.jax.tree_util.tree_map(np.asarray, g_params)
        out.update({n: self.to_numpy(g) for n, g in self.canonical_gradients(g_params).items()})
        return out


def _decode_programs(jax, config, tq: int, tk: int, layout: str, core):
    """The jitted (fill, step) of a decode step: ``fill(params, cached)`` -> (K cache, V cache) with Tq zero slots at
    the end; ``step(params, x_new, cache, masks)`` -> (output, cache with x_new's keys and values in those slots),
    the cache donated so the write is in place."""
    jnp = jax.numpy
    t_axis = 2 if layout == "heads_first" else 1

    def heads(w, x, which, n):
        y = x @ w[f"W_{which}"]
        y = y + w[f"b_{which}"] if f"b_{which}" in w else y
        y = y.reshape(y.shape[0], y.shape[1], n, config.d_head)
        return y.transpose(0, 2, 1, 3) if layout == "heads_first" else y

    def fill(w, cached):
        pad = [(0, 0)] * 4
        pad[t_axis] = (0, tq)
        return tuple(jnp.pad(heads(w, cached, which, config.kv_heads), pad) for which in "kv")

    def step(w, x_new, cache, masks):
        origin = [0, 0, 0, 0]
        origin[t_axis] = tk - tq
        cache = tuple(jax.lax.dynamic_update_slice(kv, heads(w, x_new, which, config.kv_heads), tuple(origin))
                      for kv, which in zip(cache, "kv"))
        out = core(heads(w, x_new, "q", config.num_heads), *cache, masks)
        if layout == "heads_first":
            out = out.transpose(0, 2, 1, 3)
        y = out.reshape(out.shape[0], out.shape[1], config.d_model) @ w["W_o"]
        return (y + w["b_o"] if "b_o" in w else y), cache
    return jax.jit(fill), jax.jit(step, donate_argnums=(2,))


#: the types of ``native_inputs`` values that are options of the compiled program, not arrays passed to it (a flag,
#: a name, a window's (left, right) sizes): each distinct value is its own program
STATIC_OPTIONS = (bool, int, str, tuple)

#: the native input arrays a forward + backward benchmark differentiates (besides the parameters); every other array
#: of ``native_inputs`` (masks) is passed along undifferentiated
_DIFFERENTIABLE_INPUTS = ("query", "key", "value")

#: jitted vjp programs by layer configuration (:meth:`JaxLoaded.vjp_program`)
_VJP_PROGRAMS: dict = {}
_VJP_LOCK = threading.Lock()


def _without_params(loaded: JaxLoaded) -> JaxLoaded:
    proto = copy.copy(loaded)
    proto.params = None
    return proto


def _jitted_vjp(jax, proto: JaxLoaded, static: dict):
    def vjp(params, arrays, cotangent):
        def forward(params, q, k, v):
            return proto.call(params, {**arrays, **static, "query": q, "key": k, "value": v}, False)[0]
        _, pullback = jax.vjp(forward, params, arrays["query"], arrays["key"], arrays["value"])
        return pullback(cotangent)
    return jax.jit(vjp)


class JaxBackend(AttentionBackend):
    device = "cpu"
    needs_flax = False
    compiles_per_shape = True  # XLA compiles one program per shape and dtype

    @property
    def memory_method(self) -> str:
        return "jax-device" if self.device == "gpu" else "rss"

    def availability(self) -> str | None:
        return jax_reason(self.device, self.needs_flax)

    def versions(self) -> dict[str, str]:
        import jax
        out = {"numpy": np.__version__, "jax": jax.__version__}
        if self.needs_flax:
            import flax
            out["flax"] = flax.__version__
        return out


def linear_tree(loaded: JaxLoaded, params: AttentionParams) -> dict:
    return {name: loaded.array(a) for name, a in params.arrays().items()}
