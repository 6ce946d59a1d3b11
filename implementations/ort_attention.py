"""onnxruntime-cpu: the layer as an ONNX graph around the standard ``Attention`` operator (opset 23), run by ONNX
Runtime's CPU execution provider.

**Operator.** The graph uses the standard ONNX ``Attention`` operator of opset 23, not ONNX Runtime's contrib
``com.microsoft.MultiHeadAttention``: onnxruntime 1.32.0 runs it on the CPU execution provider (float32 and
float16 through its own ``Attention`` kernel; float64 through the operator's ONNX function body, expanded into
MatMul/Softmax/Where/... nodes because there is no double kernel), it takes grouped-query heads
(``kv_num_heads``), a boolean or additive ``attn_mask`` and a causal flag, and it is the operator exporters
target. :func:`operator_reason` probes it when the backend is listed, so a runtime that cannot run it says so.

**Graph** (built with ``onnx.helper``, no torch export: the graph is exactly the harness's layer and the backend
needs neither torch nor an exporter's version quirks): ``MatMul(query, W_q) [+ b_q]``, likewise K and V from
``key`` and ``value`` (the 3-D (batch, T, heads * d_head) layout, which the operator splits into heads itself),
``Attention(q, k, v[, attn_mask], q_num_heads, kv_num_heads, is_causal)`` with the operator's own default scale
1/sqrt(d_head), then ``MatMul(., W_o) [+ b_o]``. The weights are graph *inputs*, not initializers, and batch and
lengths are symbolic, so one :class:`onnxruntime.InferenceSession` serves every set of parameters and every shape
of one structure (:class:`GraphKey`: d_model, heads, kv heads, bias, dtype, mask kind, causal flag); sessions are
cached per process (:func:`session`) and created outside every timing (``prepare`` warms one up). Initializers
would let onnxruntime pre-pack the weight matrices (measured 483 vs 508 ms per call at T = 1024, d_model 512, on a
loaded 2-core box: about 5 %), but would need a session per set of parameters (16 ms to create at d_model 64,
about 320 ms at 512), paid by every conformance variant.

**Masks in the operator's convention.** ``is_causal=1`` is top-left (query i sees keys <= i, also when Tq != Tk),
so top-left causal goes through the flag; bottom-right causal, key padding and boolean masks are folded into one
boolean ``attn_mask`` (True = take part), an additive mask into one float ``attn_mask`` (-inf where masked). The
mask is (batch|1, heads|1, Tq, Tk): onnxruntime 1.32.0 refuses a mask whose query dimension is broadcast
("inconsistent q_sequence_length (between attn_mask and Q)").

**Observed** (onnxruntime 1.32.0, onnx 1.23.2): rows with every key masked output zeros (the harness's
convention, in every dtype); a NaN or inf held by a *masked* key or value reaches the output (declared,
``masked_poison``); float64 is computed with the scale 1/sqrt(d_head) rounded to float32 (ONNX float attributes
and the function body's scale are float32): errors of ~5e-8 instead of ~1e-15, so float64 is declared at
float32 precision (``precision:float32``; with the scale folded into Q by hand the same graph is exact to 8e-16,
which shows the scale is the only loss). bfloat16 is not declared: there is no bfloat16 kernel and the function
body fails ("Could not find an implementation for Expand(13)"). No gradients: ONNX Runtime's inference session
has no vector-Jacobian product.

**Decode step.** The operator's own KV cache: ``past_key``/``past_value`` (batch, kv_heads, past_len, d_head) from a
fill graph run once; each step's graph projects x_new, and ``Attention(q, k, v, [attn_mask], past_key, past_value)``
attends over past and new keys and returns ``present_key``/``present_value`` with the new ones appended (a new buffer
of all Tk positions per step: the standard operator has no in-place cache). Observed on onnxruntime 1.32.0 CPU with
grouped-query heads and a boolean bottom-right mask over past_len + q_len keys: float32, float16 and float64 steps
match the float64 reference (bench's decode check, 0.1-4 % of its bound at KV 1024 and 4096).

**Benchmarks.** ``prepare`` returns ``session.run`` on inputs converted once. The session's intra-op thread pool
takes ``$OMP_NUM_THREADS`` (set by the benchmark workers to ``--threads``), else onnxruntime's default. The CPU
memory arena is off, so each call's buffers are fresh allocations that the ``rss`` memory method sees (with the
arena on, a warmed-up call allocates nothing new and its peak would read as zero).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from mha_harness.contract.api import (
    AttentionBackend,
    AttentionConfig,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    Capabilities,
    LoadedAttention,
)
from mha_harness.contract.conventions import PARAM_NAMES
from mha_harness.toolkit.divergences import masked_poison_divergences, precision_divergences
from mha_harness.toolkit.masks import full_mask
from mha_harness.util.install import install_hint

OPSET = 23
PROVIDER = "CPUExecutionProvider"
DTYPES = ("float32", "float64", "float16")
MASK_KINDS = ("none", "bool", "float")
#: the graphs a GraphKey names: the whole layer (query, key, value -> output); a KV cache's fill (the cached
#: positions' x -> past_key, past_value, the operator's (batch, kv_heads, T, d_head) cache layout); a decode step
#: (x_new, past_key, past_value -> output, present_key, present_value: the operator appends the new keys and values)
GRAPHS = ("layer", "fill", "step")
INSTALL_HINT = install_hint("onnx")

_SCALE_IN_FLOAT32 = ("onnxruntime has no float64 Attention kernel and runs the operator's ONNX function body, whose "
                     "scale 1/sqrt(d_head) is float32 (observed max error ~5e-8 against the float64 reference on "
                     "onnxruntime 1.32.0; exact to 8e-16 with the scale folded into Q)")
#: the grid variants with more than one visible key: with a single key the softmax is exactly 1, nothing is scaled
#: away, and single_token / single_key meet the float64 bound
_SOFTMAX_VARIANTS = ("short_with_bias", "eight_heads", "d_head_64_with_bias", "d_head_80", "long_with_bias",
                     "more_keys", "long_keys_with_bias", "grouped_query", "grouped_query_more_keys", "multi_query")
DIVERGENCES = (
    masked_poison_divergences("the ONNX Attention operator multiplies masked (zero-weight) values in P @ V, and "
                              "0 * NaN = NaN (observed on onnxruntime 1.32.0 CPU: float32/float16 kernel and float64 "
                              "function body)")
    + precision_divergences("float64", "float32", _SCALE_IN_FLOAT32, ("check_output_matches_reference",),
                            when={"variant": _SOFTMAX_VARIANTS})
    + precision_divergences("float64", "float32", _SCALE_IN_FLOAT32, ("check_lesson_worked_example_head_weights",))
)


# ------------------------------------------------------------------------------------------------ availability
def import_reason() -> str | None:
    """None when onnx and onnxruntime import, else which one does not and how to install it."""
    for module in ("onnx", "onnxruntime"):
        try:
            __import__(module)
        except ImportError as exc:
            return f"{module} is not installed ({INSTALL_HINT}): {exc}"
    return None


@functools.cache
def operator_reason() -> str | None:
    """None when onnxruntime's CPU provider runs a tiny opset-23 ``Attention`` graph, else why not (probed once)."""
    import onnxruntime as ort
    if PROVIDER not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no {PROVIDER} (providers: {ort.get_available_providers()})"
    try:
        key = GraphKey(d_model=2, num_heads=1, kv_heads=1, bias=False, dtype="float32", mask="none", is_causal=False)
        x = np.zeros((1, 1, 2), np.float32)
        w = np.zeros((2, 2), np.float32)
        session(key).run(None, {"query": x, "key": x, "value": x, "W_q": w, "W_k": w, "W_v": w, "W_o": w})
    except Exception as exc:  # noqa: BLE001 - any refusal is the reason, shown by `mha-harness list`
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return f"onnxruntime {ort.__version__} cannot run the ONNX Attention operator (opset {OPSET}): {first}"
    return None


def ort_reason() -> str | None:
    """None when this backend can run here, else the exact reason (missing package, provider or operator)."""
    return import_reason() or operator_reason()


# ------------------------------------------------------------------------------------------------ the graph
@dataclass(frozen=True)
class GraphKey:
    """Everything a graph depends on. Batch and lengths are symbolic and weights are inputs, so one session per key
    serves every shape and every set of parameters."""

    d_model: int
    num_heads: int
    kv_heads: int
    bias: bool
    dtype: str
    mask: str  # one of MASK_KINDS: no attn_mask, a boolean one (True = take part) or an additive one
    is_causal: bool  # the operator's flag: top-left
    graph: str = "layer"  # one of GRAPHS: the whole layer, a KV cache's fill, a decode step over it

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.d_model // self.num_heads)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of the graph's weight inputs, in canonical names (``x @ W``)."""
        d, kv = self.d_model, self.kv_width
        shapes = {"W_q": (d, d), "W_k": (d, kv), "W_v": (d, kv), "W_o": (d, d)}
        if self.bias:
            shapes.update(b_q=(d,), b_k=(kv,), b_v=(kv,), b_o=(d,))
        return shapes


def _tensor_type(dtype: str) -> int:
    from onnx import TensorProto
    return {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE, "float16": TensorProto.FLOAT16}[dtype]


def _linear(x: str, which: str, bias: bool) -> tuple[list, str]:
    """``x @ W_which (+ b_which)`` as nodes; returns (nodes, name of the result)."""
    from onnx import helper
    nodes = [helper.make_node("MatMul", [x, f"W_{which}"], [f"{which}_mm"])]
    if not bias:
        return nodes, f"{which}_mm"
    nodes.append(helper.make_node("Add", [f"{which}_mm", f"b_{which}"], [f"{which}_proj"]))
    return nodes, f"{which}_proj"


def _model(nodes: list, inputs: list, outputs: list, name: str):
    from onnx import helper
    graph = helper.make_graph(nodes, name, inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="mha-harness")


def _weight_inputs(key: GraphKey, names=None) -> list:
    from onnx import helper
    elem = _tensor_type(key.dtype)
    return [helper.make_tensor_value_info(name, elem, list(shape)) for name, shape in key.parameter_shapes().items()
            if names is None or name[2:] in names]


def build_fill_model(key: GraphKey):
    """A KV cache's fill (opset 23): ``cached`` (batch, past_len, d_model) projected by W_k and W_v (and b_k, b_v)
    and split into the operator's cache layout, ``past_key`` and ``past_value`` (batch, kv_heads, past_len,
    d_head)."""
    from onnx import helper, numpy_helper
    elem, d_head = _tensor_type(key.dtype), key.d_model // key.num_heads
    inputs = [helper.make_tensor_value_info("cached", elem, ["batch", "past_len", key.d_model])]
    inputs += _weight_inputs(key, "kv")
    nodes = [helper.make_node("Constant", [], ["heads_shape"],
                              value=numpy_helper.from_array(np.array([0, 0, key.kv_heads, d_head], np.int64)))]
    outputs = []
    for which, name in (("k", "past_key"), ("v", "past_value")):
        more, out = _linear("cached", which, key.bias)
        nodes += more
        nodes.append(helper.make_node("Reshape", [out, "heads_shape"], [f"{which}_heads"]))
        nodes.append(helper.make_node("Transpose", [f"{which}_heads"], [name], perm=[0, 2, 1, 3]))
        outputs.append(helper.make_tensor_value_info(name, elem, ["batch", key.kv_heads, "past_len", d_head]))
    return _model(nodes, inputs, outputs, "mha_harness_kv_cache_fill")


def build_step_model(key: GraphKey):
    """A decode step (opset 23): ``x_new`` (batch, q_len, d_model) projected to queries, keys and values;
    ``Attention(q, k, v, [attn_mask], past_key, past_value)``, which attends over the past and the new keys and
    outputs the cache with the new keys and values appended (``present_key``, ``present_value``: the operator's
    write); the output projection. The ``attn_mask`` (bottom-right causal with more than one new query) spans
    past_len + q_len keys."""
    from onnx import TensorProto, helper
    elem, d, d_head = _tensor_type(key.dtype), key.d_model, key.d_model // key.num_heads
    cache = ["batch", key.kv_heads, "past_len", d_head]
    inputs = [helper.make_tensor_value_info("x_new", elem, ["batch", "q_len", d])] + _weight_inputs(key)
    nodes, projected = [], []
    for which in "qkv":
        more, out = _linear("x_new", which, key.bias)
        nodes += more
        projected.append(out)
    if key.mask == "bool":
        inputs.append(helper.make_tensor_value_info("attn_mask", TensorProto.BOOL,
                                                    ["mask_batch", "mask_heads", "q_len", "total_len"]))
    inputs += [helper.make_tensor_value_info(name, elem, cache) for name in ("past_key", "past_value")]
    nodes.append(helper.make_node("Attention", projected + ["attn_mask" if key.mask == "bool" else "", "past_key",
                                                            "past_value"],
                                  ["attended", "present_key", "present_value"], q_num_heads=key.num_heads,
                                  kv_num_heads=key.kv_heads, is_causal=0))
    more, out = _linear("attended", "o", key.bias)
    nodes += more
    nodes.append(helper.make_node("Identity", [out], ["output"]))
    present = ["batch", key.kv_heads, "total_len", d_head]
    outputs = [helper.make_tensor_value_info("output", elem, ["batch", "q_len", d])]
    outputs += [helper.make_tensor_value_info(name, elem, present) for name in ("present_key", "present_value")]
    return _model(nodes, inputs, outputs, "mha_harness_decode_step")


def build_model(key: GraphKey):
    """The layer as an ONNX ModelProto (opset 23): projections, ``Attention``, output projection; a KV cache's fill
    or a decode step for ``key.graph`` "fill" or "step" (:func:`build_fill_model`, :func:`build_step_model`).

    Inputs: ``query`` (batch, q_len, d_model), ``key``/``value`` (batch, kv_len, d_model), the weights (and biases)
    in the ``x @ W`` layout, and for masked keys ``attn_mask`` (mask_batch, mask_heads, q_len, kv_len). Output:
    ``output`` (batch, q_len, d_model)."""
    if key.graph != "layer":
        return {"fill": build_fill_model, "step": build_step_model}[key.graph](key)
    from onnx import TensorProto, helper
    elem, d = _tensor_type(key.dtype), key.d_model
    inputs = [helper.make_tensor_value_info("query", elem, ["batch", "q_len", d]),
              helper.make_tensor_value_info("key", elem, ["batch", "kv_len", d]),
              helper.make_tensor_value_info("value", elem, ["batch", "kv_len", d])]
    inputs += _weight_inputs(key)
    nodes, projected = [], []
    for x, which in (("query", "q"), ("key", "k"), ("value", "v")):
        more, out = _linear(x, which, key.bias)
        nodes += more
        projected.append(out)
    if key.mask != "none":
        mask_type = TensorProto.BOOL if key.mask == "bool" else elem
        inputs.append(helper.make_tensor_value_info("attn_mask", mask_type,
                                                    ["mask_batch", "mask_heads", "q_len", "kv_len"]))
        projected.append("attn_mask")
    nodes.append(helper.make_node("Attention", projected, ["attended"], q_num_heads=key.num_heads,
                                  kv_num_heads=key.kv_heads, is_causal=int(key.is_causal)))
    more, out = _linear("attended", "o", key.bias)
    nodes += more
    nodes.append(helper.make_node("Identity", [out], ["output"]))
    return _model(nodes, inputs, [helper.make_tensor_value_info("output", elem, ["batch", "q_len", d])],
                  "mha_harness_attention")


def session_options():
    """CPU provider settings: threads from $OMP_NUM_THREADS (the benchmark's --threads), arena off (so the rss
    memory method sees each call's buffers), warnings silenced."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ.get("OMP_NUM_THREADS") or 0)  # 0: onnxruntime's default
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3
    return options


@functools.lru_cache(maxsize=512)
def session(key: GraphKey):
    """One InferenceSession per graph structure, per process (each is a few KiB: the weights are inputs)."""
    import onnxruntime as ort
    return ort.InferenceSession(build_model(key).SerializeToString(), session_options(), providers=[PROVIDER])


# ------------------------------------------------------------------------------------------------ masks
def native_mask(inputs: AttentionInputs, dtype: np.dtype) -> tuple[str, np.ndarray | None, bool]:
    """(mask kind, attn_mask or None, is_causal) in the operator's convention.

    Top-left causal goes through ``is_causal``; every other mask is folded into one (batch|1, heads|1, Tq, Tk)
    array: bool (True = take part) without an additive mask, else float (the additive values, -inf where masked).
    """
    is_causal = inputs.causal == "top-left"
    allowed, additive = full_mask(inputs.replace(causal=None) if is_causal else inputs)
    if allowed is None:
        return "none", None, is_causal
    if additive is None:
        return "bool", np.ascontiguousarray(allowed), is_causal
    shape = np.broadcast_shapes(allowed.shape, additive.shape)
    mask = np.where(np.broadcast_to(allowed, shape), additive, -np.inf).astype(dtype)
    return "float", mask, is_causal


# ------------------------------------------------------------------------------------------------ the backend
class OrtLoaded(LoadedAttention):
    """Weights as contiguous arrays in the layer's dtype, fed to the cached session of each call's structure."""

    def __init__(self, params: AttentionParams, dtype: str):
        self.config, self.dtype_name, self.dtype = params.config, dtype, np.dtype(dtype)
        self.weights = {name: np.ascontiguousarray(a, self.dtype) for name, a in params.arrays().items()}

    def graph_key(self, mask: str, is_causal: bool, graph: str = "layer") -> GraphKey:
        c = self.config
        return GraphKey(d_model=c.d_model, num_heads=c.num_heads, kv_heads=c.kv_heads, bias=c.bias,
                        dtype=self.dtype_name, mask=mask, is_causal=is_causal, graph=graph)

    def feeds(self, inputs: AttentionInputs) -> tuple[GraphKey, dict[str, np.ndarray]]:
        """The session key and the input feed of one call (inputs cast and made contiguous once)."""
        kind, mask, is_causal = native_mask(inputs, self.dtype)
        feed = {name: np.ascontiguousarray(getattr(inputs, name), self.dtype) for name in ("query", "key", "value")}
        feed.update(self.weights)
        if mask is not None:
            feed["attn_mask"] = mask
        return self.graph_key(kind, is_causal), feed

    def compute(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        key, feed = self.feeds(inputs)
        return AttentionOutput(session(key).run(["output"], feed)[0], None)

    def prepare(self, inputs: AttentionInputs, *, backward: bool = False):
        if backward:
            raise NotImplementedError("onnxruntime-cpu: ONNX Runtime's inference session computes no gradients")
        key, feed = self.feeds(inputs)
        run_session = session(key).run
        run_session(["output"], feed)  # session creation and first-run planning, outside any timing
        return lambda: run_session(["output"], feed)[0]

    def prepare_decode_step(self, inputs: AttentionInputs):
        """The cached positions projected once by the fill graph into ``past_key``/``past_value`` (the operator's
        cache layout); each step runs the step graph: x_new projected, ``Attention`` over the past and the new keys
        (appending them: ``present_key``/``present_value``, which a model feeds to its next step) and W_o. Bottom-right
        causal with more than one new query goes in as a boolean ``attn_mask`` over all Tk keys (the operator's
        ``is_causal`` is top-left). Both sessions are made and run once here, outside any timing."""
        kind, mask, _ = native_mask(inputs, self.dtype)
        cached = np.ascontiguousarray(inputs.cached, self.dtype)
        fill = {"cached": cached, **{n: w for n, w in self.weights.items() if n[2:] in "kv"}}
        past_key, past_value = session(self.graph_key("none", False, "fill")).run(["past_key", "past_value"], fill)
        feed = {"x_new": np.ascontiguousarray(inputs.query, self.dtype), **self.weights, "past_key": past_key,
                "past_value": past_value}
        if kind != "none":
            feed["attn_mask"] = mask
        run_session = session(self.graph_key(kind, False, "step")).run
        run_session(None, feed)  # session creation and first-run planning, outside any timing

        def step():  # present_key/present_value, the cache with x_new's keys and values appended, come back too
            return run_session(None, feed)[0]
        return step


class OrtAttention(AttentionBackend):
    """The ONNX ``Attention`` operator (opset 23) on onnxruntime's CPU execution provider."""

    divergences = DIVERGENCES
    native_mask_polarity = ("attn_mask bool: True = take part; float: added to the scores; key padding folded "
                            "into it")
    native_causal = "is_causal=1 is top-left (the top-left variants run through it); bottom-right via attn_mask"
    memory_method = "rss"

    def __init__(self, inputs: str = "separate"):
        """``inputs``: the form the backend declares; the registered backend takes separate query/key/value (and so
        every form); :func:`form_variants` declares the one-x_kv and one-x forms to run the cases in those."""
        self.name = "onnxruntime-cpu" if inputs == "separate" else f"onnxruntime-cpu-{inputs.replace('_', '-')}"
        self.capabilities = Capabilities(dtypes=DTYPES, gradients=False, attention_weights=False, inputs=inputs)

    def availability(self) -> str | None:
        return ort_reason()

    def versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime
        return {"numpy": np.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}

    def native_parameter_shapes(self, config: AttentionConfig) -> dict[str, tuple[int, ...]]:
        """The weight inputs the ONNX graph declares (read back from the ModelProto, not from a formula)."""
        key = GraphKey(d_model=config.d_model, num_heads=config.num_heads, kv_heads=config.kv_heads,
                       bias=config.bias, dtype="float32", mask="none", is_causal=False)
        graph = build_model(key).graph
        return {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim)
                for i in graph.input if i.name in PARAM_NAMES}

    def load_native(self, params: AttentionParams, dtype: str) -> OrtLoaded:
        return OrtLoaded(params, dtype)


def backends():
    return [OrtAttention()]


def form_variants():
    """The same backend declaring ``inputs="shared_kv"`` and ``inputs="self"``, so that ``mha-harness check
    --backend-spec mha_harness.implementations.ort_attention:form_variants`` runs every case in those forms (the
    same graph, fed one array as key and value, or as all three). Not registered: it would triple the suite."""
    return [OrtAttention("shared_kv"), OrtAttention("self")]
