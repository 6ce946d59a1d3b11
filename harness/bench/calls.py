"""The prepared call a benchmark times, built the same way by the sweep's workers, asv and pytest-benchmark."""
from __future__ import annotations

from mha_harness.bench.metrics import Shape


def causal_alignment(shape: Shape) -> str | None:
    """Prefill (Tq = Tk) is causal top-left; decode (Tq < Tk, new queries at the end) bottom-right."""
    if not shape.causal:
        return None
    return "top-left" if shape.tq == shape.tk else "bottom-right"


def alignment_for(backend, shape: Shape) -> str | None:
    """The causal alignment ``backend``'s call for ``shape`` carries: :func:`causal_alignment`, except that a square
    causal shape (prefill) takes bottom-right for a backend that declares only bottom-right (a KV-cache decode
    layer): with Tq = Tk the two alignments are the same mask."""
    alignment = causal_alignment(shape)
    declared = backend.capabilities.causal_alignments
    if alignment == "top-left" and "top-left" not in declared and "bottom-right" in declared:
        return "bottom-right"
    return alignment


def one_query_sees_every_key(backend, shape: Shape) -> bool:
    """Whether ``shape`` is a decode step with one query, which under bottom-right causal masking sees every key,
    for a backend without that alignment (a cross-attention layer: an encoder-decoder's decoder attending to the
    encoder's keys): the same attention is then its call without a mask, and that is what it runs."""
    caps = backend.capabilities
    return (shape.tq == 1 and causal_alignment(shape) == "bottom-right" and not caps.always_causal
            and "bottom-right" not in caps.causal_alignments)


def mask_in_call(backend, shape: Shape) -> str:
    """The mask the call for ``shape`` carries when ``backend`` runs it: its causal alignment ("top-left",
    "bottom-right") or "none" (a full-attention shape, or the one-query decode step of a backend without
    bottom-right masking, :func:`one_query_sees_every_key`). Recorded with each point, beside the shape's ``causal``."""
    if one_query_sees_every_key(backend, shape):
        return "none"
    return alignment_for(backend, shape) or "none"


def one_x_reason(shape: Shape) -> str:
    """Why a backend that declares ``inputs="self"`` cannot run ``shape`` (Tq != Tk, e.g. any decode point)."""
    return (f"declares inputs='self' (one x): Tq = {shape.tq} != Tk = {shape.tk} cannot be expressed with one x, "
            "so decode (new queries against a longer KV cache) is not defined for it; decode runs the decode step "
            "(LoadedAttention.prepare_decode_step) of a layer that takes key/value inputs (inputs='separate', "
            "'shared_kv' or 'kv_cache')")


def unsupported(backend, shape: Shape) -> str | None:
    """Why ``backend`` cannot run ``shape``, from its declared capabilities; None when it can. A structural reason
    comes first: a one-x layer (``inputs="self"``) asked for Tq != Tk is told so, not that it lacks a mask."""
    caps = backend.capabilities
    alignment = alignment_for(backend, shape)
    if shape.tq != shape.tk and caps.inputs == "self":
        return one_x_reason(shape)
    if shape.tq > shape.tk and caps.inputs == "kv_cache":
        return (f"declares inputs='kv_cache': Tq = {shape.tq} > Tk = {shape.tk} cannot be a KV-cache step (its new "
                "queries are the last Tq of the Tk positions)")
    if shape.kv_heads != shape.num_heads and not caps.grouped_query:
        return (f"num_kv_heads {shape.kv_heads} < num_heads {shape.num_heads} (grouped-query) needs capability "
                "grouped_query, which the backend does not declare")
    if shape.dtype not in caps.dtypes:
        return f"dtype {shape.dtype} not declared"
    if alignment and alignment not in caps.causal_alignments and not one_query_sees_every_key(backend, shape):
        return f"no {alignment} causal mask"
    if not alignment and caps.always_causal:
        return "always causal (declares always_causal): no full-attention call"
    if shape.tq != shape.tk and not caps.cross_attention:
        return "no cross-attention (Tq != Tk)"
    if shape.backward and not caps.gradients:
        return "no gradients"
    if caps.max_seq_len and max(shape.tq, shape.tk) > caps.max_seq_len:
        return f"max_seq_len {caps.max_seq_len}"
    return None


def call_arguments(shape: Shape, causal: str | None, *, kv_cache: bool = False):
    """(params, inputs) of the benchmarked call for ``shape`` with the causal mask ``causal`` (an alignment, or None
    for no mask): seeded, the same in every process. ``kv_cache``: a KV-cache step's inputs (the same query, and
    one x_kv whose last Tq rows are it: see ``Capabilities(inputs="kv_cache")``)."""
    from mha_harness.contract.api import AttentionConfig, as_kv_cache_call
    from mha_harness.contract.params import make_inputs, make_params
    attn = AttentionConfig(shape.d_model, shape.num_heads, shape.num_kv_heads)
    inputs = make_inputs(attn, shape.batch, shape.tq, shape.tk, seed=shape.tk, causal=causal)
    if kv_cache and not inputs.is_self_attention:
        inputs = as_kv_cache_call(inputs)
    return make_params(attn, seed=0), inputs


def backend_arguments(backend, shape: Shape):
    """:func:`call_arguments` as ``backend`` is called for ``shape``: with the mask :func:`mask_in_call` records,
    in a KV-cache step's form for a decode step (``shape.cached``) or a backend that declares that form."""
    mask = mask_in_call(backend, shape)
    return call_arguments(shape, None if mask == "none" else mask,
                          kv_cache=shape.cached or backend.capabilities.inputs == "kv_cache")


def prepared_call(backend, shape: Shape):
    """The backend's zero-argument prepared callable for ``shape`` (seeded inputs and parameters): its decode step
    over a filled KV cache for a ``cached`` shape (``LoadedAttention.decode_step``: NotImplementedError, a skip,
    for a backend without one), else its ``prepare``."""
    params, inputs = backend_arguments(backend, shape)
    loaded = backend.load(params, dtype=shape.dtype)
    if shape.cached:
        return _returning_its_output(loaded, inputs)
    return loaded.prepare(inputs, backward=shape.backward)


def _returning_its_output(loaded, inputs):
    """The loaded layer's decode step for ``inputs``, after one untimed call showed it returns an output of the
    step's shape (a step returning None, or its cache, would be timed as if it computed the layer); the values are
    what its conformance case verifies."""
    import numpy as np
    step = loaded.decode_step(inputs)
    out = step()
    expected = (inputs.batch, inputs.tq, loaded.config.d_model)
    got = None if out is None else np.shape(loaded.decode_step_output(out))
    if got != expected:
        raise TypeError(f"decode step: returned {'None' if got is None else f'an array of shape {got}'}; accepted: "
                        f"the step's output, shape (batch, Tq, d_model) = {expected}")
    return step
