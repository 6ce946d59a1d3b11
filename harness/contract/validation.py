"""Input validation shared by every public entry point.

Each failure is a ValueError or TypeError whose message names the parameter, what it got
and what it accepts, so a user can fix the call without reading the source.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import TYPE_CHECKING

import numpy as np

from mha_harness.contract.conventions import (
    ACCEPTED_FORMS,
    ALIBI_KINDS,
    ATTN_MASK_POLARITY,
    BOTTOM_RIGHT,
    CAUSAL_ALIGNMENTS,
    DTYPES,
    KEY_PADDING_POLARITY,
    QK_NORMS,
    QK_NORMS_PER_HEAD,
    QK_NORMS_WITH_BIAS,
    ROTARY_KINDS,
    causal_offset,
)
from mha_harness.contract.scoped import scoped

if TYPE_CHECKING:  # annotations only: api imports this module, never the other way round at run time
    from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams


def _int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}; accepted: an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}: got {value}; accepted: an integer >= {minimum}")
    return int(value)


def validate_config(config: AttentionConfig) -> None:
    d_model = _int("d_model", config.d_model)
    num_heads = _int("num_heads", config.num_heads)
    if d_model % num_heads:
        raise ValueError(f"num_heads: got {num_heads}, which does not divide d_model={d_model}; "
                         f"accepted: a divisor of d_model, e.g. {[h for h in (1, 2, 4, 8, 16) if d_model % h == 0]}")
    if config.num_kv_heads is not None:
        kv = _int("num_kv_heads", config.num_kv_heads)
        if num_heads % kv:
            raise ValueError(f"num_kv_heads: got {kv}, which does not divide num_heads={num_heads}; "
                             "accepted: a divisor of num_heads "
                             f"{[k for k in range(1, num_heads + 1) if num_heads % k == 0]}")
    if not isinstance(config.bias, (bool, np.bool_)):
        raise TypeError(f"bias: got {config.bias!r}; accepted: True or False")
    if config.qk_norm is not None and config.qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm: got {config.qk_norm!r}; accepted: None (no norm on q and k), "
                         f"{', '.join(map(repr, QK_NORMS))} (an RMSNorm over each head's features, as Qwen 3 and "
                         "Gemma 3 have, or over the whole q and k projections, as OLMo 2 has; a LayerNorm over each "
                         "head's features, with a bias as timm's qk_norm has, or without one as ViT-22B's and flax's "
                         "normalize_qk have)")
    if config.rotary is not None:
        if config.rotary not in ROTARY_KINDS:
            raise ValueError(f"rotary: got {config.rotary!r}; accepted: None (no rotary position embeddings), "
                             f"{', '.join(map(repr, ROTARY_KINDS))} (features i and i + d_head/2 paired, as Hugging "
                             "Face's rotate_half; or 2i and 2i + 1, as GPT-J and Meta's Llama code)")
        if (d_model // num_heads) % 2:
            raise ValueError(f"rotary: got {config.rotary!r} with d_head = {d_model // num_heads}; accepted: an even "
                             "d_head (rotary embeddings turn pairs of a head's features), or rotary=None")
    dims, d_head = config.rotary_dims, d_model // num_heads
    if dims is not None:
        if isinstance(dims, bool) or not isinstance(dims, (int, np.integer)) or dims < 2 or dims > d_head or dims % 2:
            raise ValueError(f"rotary_dims: got {dims!r} with d_head = {d_head}; accepted: None (all of each head's "
                             f"features turned) or an even integer from 2 to {d_head}, the number of each head's "
                             "leading features turned (GPT-NeoX's rotary_pct * d_head, Phi's partial_rotary_factor * "
                             "d_head, GPT-J's rotary_dim)")
        if config.rotary is None:
            raise ValueError(f"rotary_dims: got {dims!r} with rotary=None; accepted: None, or set rotary to one of "
                             f"{', '.join(map(repr, ROTARY_KINDS))} (rotary_dims says how many of each head's "
                             "features the rotary embeddings turn)")
    scaling = config.rotary_scaling
    if scaling is not None:
        if not all(hasattr(scaling, a) for a in ("kind", "factor", "frequencies")):
            raise TypeError(f"rotary_scaling: got {scaling!r}; accepted: None or a mha_harness.RotaryScaling, e.g. "
                            "RotaryScaling('llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, "
                            "original_max_positions=8192) (Llama 3.1's)")
        if config.rotary is None:
            raise ValueError(f"rotary_scaling: got {scaling!r} with rotary=None; accepted: None, or set rotary to one "
                             f"of {', '.join(map(repr, ROTARY_KINDS))} (the scaling rescales the rotary's "
                             "frequencies)")
    window = config.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"sliding_window: got {window!r}; accepted: None (every key visible) or an integer >= 1, the "
                         "number of keys each query sees: its own position and the ones before it (Mistral's "
                         "sliding_window, 4096)")
    if config.alibi is not None and (not isinstance(config.alibi, str) or config.alibi not in ALIBI_KINDS):
        raise ValueError(f"alibi: got {config.alibi!r}; accepted: None (no ALiBi bias), "
                         f"{', '.join(map(repr, ALIBI_KINDS))} (-slope * |p - s|, flash-attn's alibi_slopes and MPT's; "
                         "-slope * (p - s), the ALiBi paper's and BLOOM's)")
    base = config.rotary_base
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"rotary_base: got {base!r}; accepted: a finite number > 1, the base of the rotary "
                         "frequencies (10000.0 for Llama 2, 500000.0 for Llama 3, 1000000.0 for Qwen 2 and 3)")
    eps = config.qk_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"qk_norm_eps: got {eps!r}; accepted: a finite number >= 0, the epsilon added to the "
                         "mean square (or variance) inside the q/k norm's square root (e.g. 1e-6)")


def validate_dtype(dtype: str, allowed=None) -> str:
    allowed = tuple(allowed or DTYPES)
    if not isinstance(dtype, str) or dtype not in allowed:
        raise ValueError(f"dtype: got {dtype!r}; accepted: {', '.join(allowed)}")
    return dtype


def _array(name: str, value, ndim: int | None = None) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: got {type(value).__name__}; accepted: a numpy.ndarray")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name}: got rank {value.ndim} with shape {value.shape}; accepted: rank {ndim}")
    return value


def _finite(name: str, array: np.ndarray) -> None:
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"{name}: got dtype {array.dtype}; accepted: a floating dtype (float16/32/64)")
    if not np.all(np.isfinite(array)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise ValueError(f"{name}: got a non-finite value {array[bad]} at index {bad}; accepted: finite values only")


def _require_kind(name: str, value, attributes: tuple[str, ...], accepted: str) -> None:
    """``value`` must be the harness's own type (checked by its attributes: api imports this module, not back)."""
    if not all(hasattr(value, a) for a in attributes):
        raise TypeError(f"{name}: got {type(value).__name__}; accepted: {accepted}")


def require_config(config) -> None:
    """``config`` must be an AttentionConfig (a TypeError naming ``config`` otherwise)."""
    _require_kind("config", config, ("d_model", "num_heads", "kv_heads", "d_head", "bias"),
                  "mha_harness.AttentionConfig(d_model=..., num_heads=..., num_kv_heads=None, bias=False, "
                  "qk_norm=None, qk_norm_eps=1e-6, rotary=None, rotary_base=10000.0, rotary_dims=None, "
                  "rotary_scaling=None, sliding_window=None, alibi=None)")


def require_params(params) -> None:
    """``params`` must be an AttentionParams (a TypeError naming ``params`` otherwise)."""
    _require_kind("params", params, ("config", "W_q", "W_k", "W_v", "W_o"),
                  "mha_harness.AttentionParams (e.g. from mha_harness.make_params(config))")


def validate_seed(seed) -> int:
    """A seed for numpy.random.default_rng: a non-negative integer."""
    return _int("seed", seed, 0)


def validate_sizes(**sizes) -> None:
    """Each named size (batch, tq, tk ...) an integer >= 1, or None where optional."""
    for name, value in sizes.items():
        if value is not None:
            _int(name, value, 1)


def validate_causal(causal) -> None:
    if causal is not None and causal not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal: got {causal!r}; accepted: None, {' or '.join(map(repr, CAUSAL_ALIGNMENTS))}")


def require_inputs(inputs) -> None:
    """``inputs`` must be an AttentionInputs (a TypeError naming ``inputs`` otherwise)."""
    _require_kind("inputs", inputs, ("query", "key", "value", "causal", "key_padding_mask", "attn_mask"),
                  "mha_harness.AttentionInputs(query, key, value, causal=None, key_padding_mask=None, attn_mask=None)")


def qk_norm_gain_shapes(config: AttentionConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of the q and k norms' gains ``g_q`` and ``g_k`` under ``config.qk_norm`` (empty without a norm):
    one d_head vector each, shared by all heads, for a norm per head (``rms_per_head``, ``layer_per_head``); the
    projections' widths for ``rms_over_projection``."""
    if config.qk_norm in QK_NORMS_PER_HEAD:
        return {"g_q": (config.d_head,), "g_k": (config.d_head,)}
    if config.qk_norm == "rms_over_projection":
        return {"g_q": (config.d_model,), "g_k": (config.kv_heads * config.d_head,)}
    return {}


def qk_norm_bias_shapes(config: AttentionConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of the q and k LayerNorms' biases ``beta_q`` and ``beta_k`` under ``config.qk_norm`` (empty for a
    norm without one: :data:`~mha_harness.contract.conventions.QK_NORMS_WITH_BIAS`): one d_head vector each,
    shared by all heads."""
    if config.qk_norm in QK_NORMS_WITH_BIAS:
        return {"beta_q": (config.d_head,), "beta_k": (config.d_head,)}
    return {}


def validate_params(params: AttentionParams) -> None:
    require_config(params.config)
    c = params.config
    kv_width = c.kv_heads * c.d_head
    shapes = {"W_q": (c.d_model, c.d_model), "W_k": (c.d_model, kv_width),
              "W_v": (c.d_model, kv_width), "W_o": (c.d_model, c.d_model),
              "b_q": (c.d_model,), "b_k": (kv_width,), "b_v": (kv_width,), "b_o": (c.d_model,),
              "g_q": None, "g_k": None, **qk_norm_gain_shapes(c),
              "beta_q": None, "beta_k": None, **qk_norm_bias_shapes(c)}
    for name, shape in shapes.items():
        value = getattr(params, name)
        kind = "beta" if name.startswith("beta_") else name[0]
        wanted = {"b": c.bias, "g": c.qk_norm is not None, "beta": c.qk_norm in QK_NORMS_WITH_BIAS}.get(kind, True)
        flag = {"b": "config.bias is True", "g": f"config.qk_norm is {c.qk_norm!r}",
                "beta": f"config.qk_norm is {c.qk_norm!r}, a LayerNorm with a bias"}.get(kind)
        if value is None:
            if wanted:
                raise ValueError(f"{name}: got None; accepted: an array of shape {shape}"
                                 + (f" ({flag})" if flag else ""))
            continue
        if not wanted:
            unwanted = {"b": "config.bias is False", "g": "config.qk_norm is None",
                        "beta": f"config.qk_norm is {c.qk_norm!r}, a norm without a bias"}[kind]
            raise ValueError(f"{name}: got an array but {unwanted}; accepted: None")
        _array(name, value)
        if value.shape != shape:
            raise ValueError(f"{name}: got shape {value.shape}; accepted: {shape} "
                             f"for d_model={c.d_model}, num_heads={c.num_heads}, num_kv_heads={c.kv_heads}")
        _finite(name, value)


def validate_form(inputs: AttentionInputs, declared: str) -> None:
    """Refuse inputs in a form the backend did not declare (``Capabilities.inputs``), naming ``inputs``. Runs after
    :func:`validate_inputs`, so the arrays are well formed and only their identity or values decide the form."""
    require_inputs(inputs)
    form = inputs.form
    accepted = ACCEPTED_FORMS[declared]
    if form not in accepted:
        how = {"self": "one array x (query is key is value)",
               "shared_kv": "x_q and one x_kv (key is value)",
               "kv_cache": "x_new and one x_kv whose last Tq rows are x_new (key is value)"}
        got = f"{form} form"
        if declared == "kv_cache" and form == "shared_kv":
            q, kv = np.asarray(inputs.query), np.asarray(inputs.key)
            got += (f" (x_q has dtype {q.dtype}, x_kv {kv.dtype})" if q.dtype != kv.dtype
                    else f" (x_q has more rows than x_kv: Tq = {q.shape[1]} > Tk = {kv.shape[1]})"
                    if q.shape[1] > kv.shape[1] else " (x_q is not the last Tq rows of x_kv)")
        raise ValueError(f"inputs: got the {got} but the backend declares inputs={declared!r}; accepted: "
                         + " or ".join(how[f] for f in accepted if f in how))


def validate_decode_step(inputs: AttentionInputs) -> None:
    """Refuse, naming ``inputs`` or the field, a call that is not a decode step over a filled KV cache: x_new and one
    x_kv whose last Tq rows are x_new (``inputs.form == "kv_cache"``), no masks but the causal one, whose alignment
    is bottom-right (the new queries are the last positions). Runs after :func:`validate_inputs`."""
    require_inputs(inputs)
    if inputs.form != "kv_cache":
        raise ValueError(f"inputs: got the {inputs.form} form for a decode step; accepted: x_new and one x_kv whose "
                         "last Tq rows are x_new (key is value; mha_harness.as_kv_cache_call makes one)")
    for name in ("key_padding_mask", "attn_mask"):
        if getattr(inputs, name) is not None:
            raise ValueError(f"{name}: got a mask for a decode step; accepted: None (a decode step takes the causal "
                             "mask only)")
    if inputs.causal not in (None, BOTTOM_RIGHT):
        raise ValueError(f"causal: got {inputs.causal!r} for a decode step; accepted: None or {BOTTOM_RIGHT!r} (its "
                         "new queries are the last Tq of the Tk positions)")


def validate_inputs(inputs: AttentionInputs, config: AttentionConfig) -> None:
    """Check ranks, widths, batch sizes, mask shapes/dtypes and finiteness before any computation.

    query must be finite; key/value may hold NaN/inf only where a mask can hide it
    (the leakage cases put poison there on purpose).
    """
    require_inputs(inputs)
    q = _array("query", inputs.query, 3)
    k = _array("key", inputs.key, 3)
    v = _array("value", inputs.value, 3)
    for name, arr in (("query", q), ("key", k), ("value", v)):
        if arr.shape[-1] != config.d_model:
            raise ValueError(f"{name}: got width {arr.shape[-1]} (shape {arr.shape}); "
                             f"accepted: width d_model={config.d_model}")
        if arr.shape[1] == 0:
            raise ValueError(f"{name}: got an empty sequence (shape {arr.shape}); accepted: sequence length >= 1")
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"{name}: got dtype {arr.dtype}; accepted: a floating dtype")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"key/value: got batch sizes {k.shape[0]}/{v.shape[0]} but query has batch {q.shape[0]}; "
                         "accepted: the same batch size as query")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"value: got sequence length {v.shape[1]} but key has {k.shape[1]}; accepted: equal lengths")
    if inputs.causal is not None and inputs.causal not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal: got {inputs.causal!r}; accepted: None, {' or '.join(map(repr, CAUSAL_ALIGNMENTS))}")
    b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    if inputs.key_padding_mask is not None:
        m = _array("key_padding_mask", inputs.key_padding_mask)
        if m.dtype != np.bool_:
            raise TypeError(f"key_padding_mask: got dtype {m.dtype}; accepted: bool ({KEY_PADDING_POLARITY})")
        if m.shape != (b, tk):
            raise ValueError(f"key_padding_mask: got shape {m.shape}; accepted: (batch, Tk) = {(b, tk)}")
    if inputs.attn_mask is not None:
        m = _array("attn_mask", inputs.attn_mask)
        allowed = [(tq, tk), (b, 1, tq, tk), (b, config.num_heads, tq, tk), (1, config.num_heads, tq, tk)]
        if m.shape not in allowed:
            raise ValueError(f"attn_mask: got shape {m.shape}; accepted: one of {allowed}")
        if m.dtype != np.bool_ and not np.issubdtype(m.dtype, np.floating):
            raise TypeError(f"attn_mask: got dtype {m.dtype}; "
                            f"accepted: bool ({ATTN_MASK_POLARITY}) or float (additive)")
        if m.dtype != np.bool_ and np.any(np.isnan(m)):
            raise ValueError("attn_mask: got NaN in an additive mask; accepted: finite values or -inf")
    _finite("query", q)
    visible = visible_keys(inputs)
    _finite_where("key", k, visible)
    _finite_where("value", v, visible)


_CAUSAL_FUTURE_POISON = contextvars.ContextVar("mha_harness_causal_future_poison", default=False)


@contextlib.contextmanager
def causal_future_poison_allowed():
    """For the causal leakage case only: inside this block NaN/inf may also sit at keys the causal mask hides
    from the *first* query (later queries then read poison, and their outputs are garbage by design). The
    case uses it to prove that queries which cannot see those keys stay unaffected; every other caller gets
    the strict rule of :func:`visible_keys`."""
    with scoped(_CAUSAL_FUTURE_POISON, True):
        yield


def visible_keys(inputs: AttentionInputs) -> np.ndarray | None:
    """(batch, Tk) bool: True where at least one query of some head may attend to that key under the causal
    mask, the key padding mask and attn_mask together; None when nothing is masked (every key is visible).

    A key no query can see contributes nothing by the harness's convention, so it may hold NaN or inf (the
    leakage cases put poison there on purpose); a key some query sees must be finite (inside
    :func:`causal_future_poison_allowed`, the causal mask counts only the first query)."""
    causal, padding, attn = inputs.causal, inputs.key_padding_mask, inputs.attn_mask
    if causal is None and padding is None and attn is None:
        return None
    b, tq, tk = inputs.query.shape[0], inputs.query.shape[1], inputs.key.shape[1]
    keys = np.arange(tk)
    queries = np.arange(1 if causal is not None and _CAUSAL_FUTURE_POISON.get() else tq)
    if attn is None:
        visible = np.ones((1, tk), dtype=bool)
        if causal is not None:  # key j is seen by the last query exactly when j <= Tq - 1 + offset
            visible = visible & (keys <= queries[-1] + causal_offset(causal, tq, tk))[None, :]
    else:
        allowed = attn if attn.dtype == np.bool_ else ~np.isneginf(attn)
        allowed = allowed.reshape((1, 1) + allowed.shape) if allowed.ndim == 2 else allowed
        if causal is not None:
            allowed = allowed[:, :, : len(queries)] & (keys[None, :] <= queries[:, None]
                                                       + causal_offset(causal, tq, tk))
        visible = allowed.any(axis=(1, 2))
    if padding is not None:
        visible = visible & ~padding
    return np.broadcast_to(visible, (b, tk))


def _finite_where(name: str, array: np.ndarray, visible: np.ndarray | None) -> None:
    """Finite values at every (batch, position) some query sees; anything at hidden positions."""
    if visible is None:
        _finite(name, array)
        return
    bad = ~np.isfinite(array).all(axis=-1) & visible
    if bad.any():
        bi, ti = (int(i) for i in np.argwhere(bad)[0])
        fi = int(np.argwhere(~np.isfinite(array[bi, ti]))[0][0])
        raise ValueError(f"{name}: got a non-finite value {array[bi, ti, fi]} at index {(bi, ti, fi)}, a position "
                         "some query attends to; accepted: finite values wherever a query can see them "
                         "(NaN/inf only at keys every query's mask hides)")


def validate_cotangent(cotangent, inputs: AttentionInputs, config: AttentionConfig) -> None:
    """A vjp cotangent is checked like an output: an ndarray of shape (batch, Tq, d_model), floating, finite."""
    expected = (inputs.query.shape[0], inputs.query.shape[1], config.d_model)
    c = _array("cotangent", cotangent, 3)
    if c.shape != expected:
        raise ValueError(f"cotangent: got shape {c.shape}; accepted: the output's shape (batch, Tq, d_model) = "
                         f"{expected}")
    _finite("cotangent", c)
