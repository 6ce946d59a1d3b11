"""The prepared call a benchmark times, built the same way by the sweep's workers, asv and pytest-benchmark."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def cross_attention_reason(caps, shape: Shape) -> str | None:
    """Why a backend with capabilities ``caps`` cannot run ``shape``, a cross-attention call (queries from one
    sequence, keys and values from another: ``Shape.cross``), for its input form; None when it can."""
    if caps.inputs == "self":
        return ("declares inputs='self' (one x): cross-attention takes its keys and values from another sequence "
                "(x_q and x_kv), which one x cannot express")
    if caps.inputs == "kv_cache":
        return ("declares inputs='kv_cache': its keys and values are its own sequence's (a cache whose last Tq rows "
                "are the queries), not another sequence's, as cross-attention's are")
    if not caps.cross_attention:
        return "no cross-attention (declares cross_attention=False): the cross workload times x_q against another x_kv"
    if shape.tq > shape.tk and not caps.more_queries_than_keys:
        return (f"declares more_queries_than_keys=False: Tq = {shape.tq} queries against Tk = {shape.tk} keys needs "
                "it")
    return None


def unsupported(backend, shape: Shape) -> str | None:
    """Why ``backend`` cannot run ``shape``, from its declared capabilities; None when it can. A structural reason
    comes first: a one-x layer (``inputs="self"``) asked for Tq != Tk is told so, not that it lacks a mask."""
    caps = backend.capabilities
    alignment = alignment_for(backend, shape)
    if shape.cross:
        why = cross_attention_reason(caps, shape)
        if why:
            return why
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
    if shape.bias and not caps.bias:
        return "no biases (declares bias=False): --bias times a layer whose projections carry b_q ... b_o"
    feature = missing_feature(caps, shape)
    if feature:
        return feature
    if shape.d_head % caps.d_head_multiple:
        return (f"d_head {shape.d_head} is not a multiple of {caps.d_head_multiple} (declares "
                f"d_head_multiple={caps.d_head_multiple}): choose --d-model / --heads so that it is")
    if caps.max_seq_len and max(shape.tq, shape.tk) > caps.max_seq_len:
        return f"max_seq_len {caps.max_seq_len}"
    return None


def missing_feature(caps, shape: Shape) -> str | None:
    """Why a backend with capabilities ``caps`` cannot be built with ``shape``'s layer features (rotary embeddings,
    a q/k norm, a sliding window, ALiBi: ``--rotary``, ``--qk-norm``, ``--sliding-window``, ``--alibi``), naming the
    capability it does not declare; None when it can."""
    declared = ", ".join(caps.rotary) or "none"
    if shape.rotary and shape.rotary not in caps.rotary:
        return (f"no {shape.rotary} rotary embeddings (capabilities.rotary declares: {declared}): --rotary times a "
                "layer that turns q and k by their positions")
    norms = ", ".join(caps.qk_norms) or "none"
    if shape.qk_norm and shape.qk_norm not in caps.qk_norms:
        return (f"no {shape.qk_norm} q/k norm (capabilities.qk_norms declares: {norms}): --qk-norm times a layer "
                "that normalises q and k after their projections")
    if shape.sliding_window is not None and not caps.sliding_window:
        return ("no sliding window (declares sliding_window=False): --sliding-window times a layer whose queries "
                "see only the last w positions")
    if shape.alibi and shape.alibi not in caps.alibi:
        return (f"no {shape.alibi} ALiBi (capabilities.alibi declares: {', '.join(caps.alibi) or 'none'}): --alibi "
                "times a layer whose scores are biased by the distance between query and key")
    return None


def layer_config(shape: Shape):
    """The :class:`~mha_harness.contract.api.AttentionConfig` of ``shape``'s layer: its size, heads, biases and
    features."""
    from mha_harness.contract.api import AttentionConfig
    return AttentionConfig(shape.d_model, shape.num_heads, shape.num_kv_heads, bias=shape.bias, qk_norm=shape.qk_norm,
                           qk_norm_eps=shape.qk_norm_eps,
                           rotary=shape.rotary, rotary_base=shape.rotary_base, sliding_window=shape.sliding_window,
                           alibi=shape.alibi)


def call_arguments(shape: Shape, causal: str | None, *, kv_cache: bool = False):
    """(params, inputs) of the benchmarked call for ``shape`` with the causal mask ``causal`` (an alignment, or None
    for no mask): seeded, the same in every process. ``kv_cache``: a KV-cache step's inputs (the same query, and
    one x_kv whose last Tq rows are it: see ``Capabilities(inputs="kv_cache")``). A cross-attention shape
    (``shape.cross``): x_q and one x_kv of another sequence, key = value (the ``shared_kv`` form), at Tq = Tk too."""
    from mha_harness.contract.api import as_kv_cache_call
    from mha_harness.contract.params import make_inputs, make_params
    attn = layer_config(shape)
    inputs = make_inputs(attn, shape.batch, shape.tq, shape.tk, seed=shape.tk, causal=causal,
                         self_attention=False if shape.cross else None)
    if shape.cross:
        inputs = inputs.replace(value=inputs.key)
    elif kv_cache and not inputs.is_self_attention:
        inputs = as_kv_cache_call(inputs)
    return make_params(attn, seed=0), inputs


def backend_arguments(backend, shape: Shape):
    """:func:`call_arguments` as ``backend`` is called for ``shape``: with the mask :func:`mask_in_call` records,
    in a KV-cache step's form for a decode step (``shape.cached``) or a backend that declares that form."""
    mask = mask_in_call(backend, shape)
    return call_arguments(shape, None if mask == "none" else mask,
                          kv_cache=shape.cached or backend.capabilities.inputs == "kv_cache")


@dataclass
class PreparedPoint:
    """A backend's prepared callable for one benchmark shape, with the loaded layer and the call it was prepared
    for (what its output is checked against)."""

    fn: Callable[[], Any]
    loaded: Any
    params: Any
    inputs: Any
    shape: Shape

    def checked_values(self, value):
        """What of one call's return ``value`` the float64 reference is compared with
        (:func:`~mha_harness.bench.verify.check_point`): for a forward call or a decode step, its output at the rows
        :func:`checked_rows`, float64 (batch, rows, d_model), read with the loaded layer's ``native_output``
        (``decode_step_output`` for a decode step); for a forward + backward call, its gradients read with
        ``native_gradients``, each as ``{"shape": its full shape, "part": gradient_part(it) as float64}``, or None
        when the layer does not read them (its points are timed unchecked). Raises
        :class:`~mha_harness.bench.verify.WrongOutput` when the value is not what the call should return."""
        if self.shape.backward:
            return self.checked_gradients(value)
        import numpy as np

        from mha_harness.bench.verify import WrongOutput
        what = "decode step" if self.shape.cached else "prepare()'s call"
        expected = (self.inputs.batch, self.inputs.tq, self.loaded.config.d_model)
        accepted = (f"accepted: the layer's output, shape (batch, Tq, d_model) = {expected}, which the layer's "
                    f"{'decode_step_output' if self.shape.cached else 'native_output'} reads")
        if value is None:
            raise WrongOutput(f"{what} returned None; {accepted}")
        read = self.loaded.decode_step_output if self.shape.cached else self.loaded.native_output
        try:
            out = np.asarray(read(value))
        except Exception as exc:  # noqa: BLE001 - a plugin's value that cannot be read is that point's wrong output
            raise WrongOutput(f"{what} returned a {type(value).__name__} that cannot be read as an array "
                              f"({type(exc).__name__}: {exc}); {accepted}") from None
        if out.shape != expected or out.dtype.kind in "bcOSUM":
            raise WrongOutput(f"{what} returned an array of shape {out.shape}, dtype {out.dtype}; {accepted}")
        try:
            return out[:, checked_rows(self.inputs.tq)].astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise WrongOutput(f"{what} returned an array of dtype {out.dtype} that cannot be read as float64 "
                              f"({exc}); {accepted}") from None

    def checked_gradients(self, value) -> dict | None:
        """A forward + backward call's gradients as :meth:`checked_values` sends them; None without
        ``native_gradients``."""
        import numpy as np

        from mha_harness.bench.verify import WrongOutput
        accepted = ("accepted: a dict of the gradients of output.sum() under vjp's names (query, key, value per the "
                    "declared input form; W_q ... b_o in the canonical layout), which native_gradients reads from "
                    "what the forward + backward call returned")
        try:
            grads = self.loaded.native_gradients(value)
        except NotImplementedError:
            return None
        except Exception as exc:  # noqa: BLE001 - a plugin's value that cannot be read is that point's wrong output
            none = ("; a gradient its backward did not reach stays None (a parameter that does not require grad): "
                    "return None for it and bench names it" if "NoneType" in str(exc) else "")
            raise WrongOutput(f"native_gradients could not read the forward + backward call's {type(value).__name__} "
                              f"({type(exc).__name__}: {exc}){none}; {accepted}") from None
        if not isinstance(grads, dict):
            raise WrongOutput(f"native_gradients returned a {type(grads).__name__}; {accepted}")
        out = {}
        for name, grad in grads.items():
            if grad is None:
                raise WrongOutput(f"the forward + backward call left no gradient for {name} (None): its backward did "
                                  "not reach it (a parameter that does not require grad, an input detached or not "
                                  f"requiring grad); {accepted}")
            try:
                array = np.asarray(grad)
                out[str(name)] = {"shape": list(array.shape), "part": gradient_part(array).astype(np.float64)}
            except (TypeError, ValueError) as exc:
                raise WrongOutput(f"the gradient of {name} cannot be read as a float64 array ({exc}); "
                                  f"{accepted}") from None
        return out


#: a benchmarked call's output is compared with the float64 reference at this many query rows (every row when Tq is
#: at most this): the first and the last (one key and every key, under a causal mask) and others drawn by a seed
CHECKED_ROWS = 16


def checked_rows(tq: int) -> list[int]:
    """The query rows of a benchmarked call's output that are compared with the float64 reference: all of them
    when ``tq`` <= CHECKED_ROWS, else the first, the last and CHECKED_ROWS - 2 others drawn with seed ``tq``."""
    import numpy as np
    if tq <= CHECKED_ROWS:
        return list(range(tq))
    inner = np.random.default_rng(tq).choice(np.arange(1, tq - 1), CHECKED_ROWS - 2, replace=False)
    return sorted({0, tq - 1, *map(int, inner)})


def gradient_part(gradient):
    """The entries of a gradient that bench compares with the reference's: an input's (batch, T, d_model) at the
    positions :func:`checked_rows` (T), a weight's (d_in, d_out) at the rows :func:`checked_rows` (d_in), a bias
    whole. Every gradient of ``output.sum()`` sums over all query positions, so a few rows of each still see every
    row's contribution."""
    if gradient.ndim == 3:
        return gradient[:, checked_rows(gradient.shape[1])]
    if gradient.ndim == 2:
        return gradient[checked_rows(gradient.shape[0])]
    return gradient


def prepare_point(backend, shape: Shape) -> PreparedPoint:
    """The backend's zero-argument prepared callable for ``shape`` (seeded inputs and parameters), not yet called:
    its decode step over a filled KV cache for a ``cached`` shape (``LoadedAttention.decode_step``:
    NotImplementedError, a skip, for a backend without one), else its ``prepare``."""
    params, inputs = backend_arguments(backend, shape)
    loaded = backend.load(params, dtype=shape.dtype)
    fn = loaded.decode_step(inputs) if shape.cached else loaded.prepare(inputs, backward=shape.backward)
    if not callable(fn):
        raise TypeError(f"prepare: returned {type(fn).__name__}; accepted: a zero-argument callable that runs one "
                        "call and returns its output")
    return PreparedPoint(fn, loaded, params, inputs, shape)


def prepared_call(backend, shape: Shape):
    """The backend's prepared callable for ``shape`` (:func:`prepare_point`), after one untimed call whose output
    (or gradients) matched the float64 reference at :func:`checked_rows` (:func:`~mha_harness.bench.verify.check_point`,
    here in the caller's process: asv and pytest-benchmark; the sweep's workers send the values to the parent, which
    checks them). Raises :class:`~mha_harness.bench.verify.WrongOutput` when it did not."""
    from mha_harness.bench.verify import check_point
    point = prepare_point(backend, shape)
    check_point(backend, shape, point.checked_values(point.fn()))
    return point.fn
