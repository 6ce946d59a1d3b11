"""Seeded inputs shared by the cases, built in the input form the backend takes (NumPy only: cases never
import torch or jax).

Forms (``Capabilities.inputs``): ``separate`` gives three distinct arrays, ``shared_kv`` an ``x_q`` and one
``x_kv`` (``key is value``), ``self`` one ``x`` (``query is key is value``), ``kv_cache`` an ``x_new`` equal to the
last Tq rows of one ``x_kv``. Perturbing "keys" perturbs what makes them: the key and value arrays, ``x_kv``, or
``x`` itself (which moves the queries there too, as the last Tq rows of a KV-cache call's ``x_kv`` do).
"""
from __future__ import annotations

import numpy as np

from mha_harness.conformance.casekit import CaseSkipped, input_gradients, primary_dtype  # noqa: F401 - re-exported
from mha_harness.contract.api import AttentionConfig, AttentionInputs, as_kv_cache_call
from mha_harness.contract.conventions import COMMON_ROTARY_SCALINGS, COUPLED_FORMS, TOP_LEFT, causal_offset
from mha_harness.contract.params import make_inputs, make_params

SMALL = dict(d_model=32, num_heads=4)
#: the grid's ``short_with_bias`` row (batch 3, 2 heads of width 8, T = 7, biases): cases that need no shape of
#: their own use it too, so a backend that compiles per shape compiles it once for all of them
SHORT_BATCH, SHORT_HEADS, SHORT_D_HEAD, SHORT_SEQ = 3, 2, 8, 7
#: keys enough to cross the 16-, 32- and 64-key blocks of a tiled (FlashAttention) kernel: how blocks combine, and
#: which blocks a causal mask lets it skip, are never exercised by keys that fit in one block
KEYS_ACROSS_BLOCKS = 65
#: Tq = Tk of every causal case's square variant (and of the causal gradient variant, which so shares its compiled
#: programs with them)
CAUSAL_SQUARE = KEYS_ACROSS_BLOCKS
#: every input form: most properties are defined whatever the form
ALL_FORMS = ("separate", "shared_kv", "self", "kv_cache")
#: properties that need Tq != Tk or keys independent of queries
CROSS_FORMS = ("separate", "shared_kv")


def small_layer(backend, *, bias: bool = False, num_kv_heads=None, seed: int = 0, rotary=None,
                rotary_base: float = 10_000.0, rotary_dims=None, rotary_scaling=None, sliding_window=None,
                qk_norm=None, alibi=None, **overrides):
    """A small layer (d_model 32, 4 heads) using biases only where the backend declares them (``rotary``: with those
    rotary embeddings, ``rotary_dims`` of each head's features turned, its frequencies rescaled by the
    ``rotary_scaling`` kind of COMMON_ROTARY_SCALINGS, or a RotaryScaling itself; ``sliding_window``: a window of
    that many keys; ``qk_norm``: that norm of q and k, its gains not 1; ``alibi``: that ALiBi bias)."""
    shape = {**SMALL, **overrides}
    config = AttentionConfig(shape["d_model"], shape["num_heads"], num_kv_heads, qk_norm=qk_norm,
                             bias=bias and backend.capabilities.bias, rotary=rotary, rotary_base=rotary_base,
                             rotary_dims=rotary_dims,
                             rotary_scaling=rotary_scaling if not isinstance(rotary_scaling, str)
                             else COMMON_ROTARY_SCALINGS[rotary_scaling],
                             sliding_window=sliding_window, alibi=alibi)
    return make_params(config, seed=seed)


def short_layer(backend, *, seed: int = 0):
    """The layer of the grid's ``short_with_bias`` row (d_model 16, 2 heads), biases where the backend declares
    them; call it with batch SHORT_BATCH and length SHORT_SEQ."""
    return small_layer(backend, bias=True, d_model=SHORT_HEADS * SHORT_D_HEAD, num_heads=SHORT_HEADS, seed=seed)


def separate_inputs(config: AttentionConfig, batch: int, tq: int, tk: int | None = None, seed: int = 1, **masks):
    """Query, key and value as three distinct arrays, so keys can be perturbed without touching queries."""
    return make_inputs(config, batch, tq, tk, seed=seed, self_attention=False, **masks)


def kv_cache_refusal(tq: int, tk: int) -> str:
    """Why a KV-cache layer skips a call with more queries than keys (said after the backend's name)."""
    return (f"declares inputs='kv_cache': Tq = {tq} > Tk = {tk} cannot be expressed as a KV-cache step (the new "
            "queries are the last Tq of the Tk positions)")


def form_inputs(form: str, config: AttentionConfig, batch: int, tq: int, tk: int | None = None, seed: int = 1,
                **masks) -> AttentionInputs:
    """Standard-normal inputs in ``form``: separate arrays, (x_q, x_kv, x_kv), (x, x, x), or a KV-cache call
    (x_new, x_kv, x_kv) with x_new a copy of x_kv's last Tq rows (Tq = Tk: one x, nothing cached).

    One x cannot have Tq != Tk, nor a KV-cache call Tq > Tk: asking for it is a skip naming the form (variant
    generators avoid it)."""
    tk = tq if tk is None else tk
    if form == "separate":
        return separate_inputs(config, batch, tq, tk, seed=seed, **masks)
    rng = np.random.default_rng(seed)
    x_q = rng.standard_normal((batch, tq, config.d_model))
    if form == "self" or (form == "kv_cache" and tk == tq):
        if tk != tq:
            raise CaseSkipped(f"Tq = {tq} != Tk = {tk} cannot be expressed with one x (inputs='self')")
        return AttentionInputs(x_q, x_q, x_q, **masks)
    if form == "kv_cache" and tq > tk:
        raise CaseSkipped(kv_cache_refusal(tq, tk))
    x_kv = rng.standard_normal((batch, tk, config.d_model))
    inputs = AttentionInputs(x_q, x_kv, x_kv, **masks)
    return as_kv_cache_call(inputs) if form == "kv_cache" else inputs


def cross_ok(backend) -> bool:
    """Whether variants with Tq != Tk apply: cross-attention declared (never for one x; for a KV-cache step
    Tq < Tk only, ``more_queries_than_keys`` being off)."""
    return backend.capabilities.cross_attention and backend.capabilities.inputs != "self"


def causal_variants(backend) -> list[dict]:
    """Each declared alignment at Tq == Tk and, where cross-attention is declared, Tq < Tk and Tq > Tk.

    Named variants: ``square`` (65, 65: CAUSAL_SQUARE), ``more_keys`` (5, 65), ``more_queries`` (11, 6) for top-left
    and ``rows_without_visible_keys`` (11, 6) for bottom-right, where queries 0..4 see no key at all. 65 keys cross
    a tiled kernel's key blocks: under bottom-right alignment the 5 queries see keys up to 60..64."""
    out = []
    dtype = primary_dtype(backend)
    for alignment in backend.capabilities.causal_alignments:
        shapes = [("square", CAUSAL_SQUARE, CAUSAL_SQUARE)]
        if cross_ok(backend):
            shapes += [("more_keys", 5, KEYS_ACROSS_BLOCKS),
                       ("more_queries" if alignment == TOP_LEFT else "rows_without_visible_keys", 11, 6)]
        out += [{"dtype": dtype, "alignment": alignment, "variant": name, "seq": tq, "tk": tk}
                for name, tq, tk in shapes]
    return out


#: the queries and keys of the causal output case's ``long_square`` variant: past a 256-query chunk (and the 16- to
#: 128-row blocks of tiled kernels), under the zoo's max_seq_len of 512
CAUSAL_LONG = 300


def causal_output_variants(backend) -> list[dict]:
    """:func:`causal_variants`, ``long_square`` (CAUSAL_LONG queries and keys, the first declared alignment: query
    chunks or row blocks past the first), and for a KV-cache step (``inputs='kv_cache'``) ``one_new_token`` (1, 65), the
    commonest decode step: one new token against 64 cached positions (it sees every key, so it has no future key
    for the leak cases to change, but its output must still be the reference's); and for a layer that declares
    rotary embeddings or a q/k norm, the same layer with them (:func:`declared_layer_features`) at ``square`` (once:
    at Tq = Tk the alignments are one mask) and at ``more_keys`` for each alignment, named ``<shape>_with_features``:
    the grid runs those features without a causal mask, and a decoder layer whose causal path leaves them out (a
    fast path that skips the rotary or the norm) passed every other case."""
    plain = causal_variants(backend)
    out = list(plain)
    # a square call of more than 256 queries: a layer that processes its queries in chunks (256 in an outside user's
    # xformers-style layer) and builds each chunk's causal mask from chunk-relative indices is right on every call of
    # up to one chunk; the grid's long rows are unmasked, and only the slow T = 8192 case reached it before
    limit = backend.capabilities.max_seq_len
    if backend.capabilities.causal_alignments and (not limit or limit >= CAUSAL_LONG):
        out.append({"dtype": primary_dtype(backend), "alignment": backend.capabilities.causal_alignments[0],
                    "variant": "long_square", "seq": CAUSAL_LONG, "tk": CAUSAL_LONG})
    if backend.capabilities.inputs == "kv_cache":
        out += [{"dtype": primary_dtype(backend), "alignment": a, "variant": "one_new_token", "seq": 1,
                 "tk": KEYS_ACROSS_BLOCKS} for a in backend.capabilities.causal_alignments]
    features = declared_layer_features(backend)
    if features:
        square = next(v for v in plain if v["variant"] == "square")
        out += [{**v, "variant": f"{v['variant']}_with_features", **features} for v in plain
                if v is square or v["variant"] == "more_keys"]
    return out


#: a decoder layer's features as Qwen 3 has them (its per-head RMSNorm, then rotary at base 1,000,000, two key/value
#: heads), each where the backend declares it (its first declared rotary pairing and q/k norm)
FEATURE_ROTARY_BASE, FEATURE_KV_HEADS = 1_000_000.0, 2


def declared_layer_features(backend) -> dict:
    """The rotary embeddings, q/k norm and grouped-query heads a backend declares, as a variant's fields for
    :func:`small_layer` (``rotary`` and ``rotary_base``, ``qk_norm``, ``kv_heads``); {} when it declares neither
    rotary nor a q/k norm (grouped-query heads alone are in the grid's causal-free rows and the gradients' causal
    ones)."""
    caps = backend.capabilities
    if not (caps.rotary or caps.qk_norms):
        return {}
    qk_norm = "rms_per_head" if "rms_per_head" in caps.qk_norms else (caps.qk_norms or (None,))[0]
    features = {"rotary": caps.rotary[0] if caps.rotary else None, "qk_norm": qk_norm,
                "kv_heads": FEATURE_KV_HEADS if caps.grouped_query else None}
    if caps.rotary:
        features["rotary_base"] = FEATURE_ROTARY_BASE
    return {name: value for name, value in features.items() if value is not None}


def random_allowed_mask(tq: int, tk: int, seed: int = 3) -> np.ndarray:
    """A random "may attend" mask with every row keeping at least one key."""
    rng = np.random.default_rng(seed)
    m = rng.random((tq, tk)) < 0.6
    m[np.arange(tq), rng.integers(0, tk, tq)] = True
    return m


def additive_mask_from(allowed: np.ndarray, seed: int = 4) -> np.ndarray:
    """A float attn_mask: random finite biases (standard deviation 2) where ``allowed``, -inf elsewhere."""
    return np.where(allowed, np.random.default_rng(seed).standard_normal(allowed.shape) * 2.0, -np.inf)


def key_limit(alignment: str, row: int, tq: int, tk: int) -> int:
    """Last key index that query ``row`` may see under the causal mask (may be < 0: none)."""
    return row + causal_offset(alignment, tq, tk)


def poison(rng: np.random.Generator, shape, kind: str) -> np.ndarray:
    """Values put where a mask must hide them: large random numbers, NaN or +inf."""
    if kind == "nan":
        return np.full(shape, np.nan)
    if kind == "inf":
        return np.full(shape, np.inf)
    return rng.standard_normal(shape) * 100.0


def poison_kinds(form: str, *, cached_rows: bool = False) -> tuple[str, ...]:
    """NaN/inf poison needs keys apart from queries: in one x (or a KV-cache call's new rows) it would be a
    non-finite query, which is invalid. ``cached_rows``: the case puts NaN/inf only in a KV-cache call's cached
    rows (and random values in its new ones), which is valid."""
    if cached_rows and form == "kv_cache":  # the case poisons cached rows too, which are not queries
        return ("random", "nan", "inf")
    return ("random",) if form in COUPLED_FORMS else ("random", "nan", "inf")


def with_each_input_changed(inputs: AttentionInputs, change) -> AttentionInputs:
    """Copy of ``inputs`` in which each distinct array among query, key and value (by identity, in that order) is
    copied once and ``change(copy)`` edits it in place: one x stays one x, a shared x_kv one array, so the form is
    kept. (A KV-cache call's x_new and x_kv are distinct arrays: an edit that is the same on every row keeps x_new
    equal to x_kv's last rows.)"""
    changed: dict[str, np.ndarray] = {}
    for name in ("query", "key", "value"):
        array = getattr(inputs, name)
        same = next((changed[n] for n in changed if getattr(inputs, n) is array), None)
        if same is None:
            same = array.copy()
            change(same)
        changed[name] = same
    return inputs.replace(**changed)


def with_keys_replaced(inputs: AttentionInputs, where, kind: str, seed: int = 11) -> AttentionInputs:
    """Copy of ``inputs`` whose keys at ``where`` are poisoned, in the inputs' own form.

    ``where`` indexes (batch, Tk) (a boolean array or a tuple such as ``(slice(None), slice(5, None))``).
    Separate: key and value are replaced independently; shared_kv: x_kv; self: x (queries there move too);
    kv_cache: x_kv, and x_new with its last Tq rows (the queries there move too)."""
    rng = np.random.default_rng(seed)
    form = inputs.form
    key = inputs.key.copy()
    block = key[where].shape
    key[where] = poison(rng, block, kind)
    if form == "self":
        return inputs.replace(query=key, key=key, value=key)
    if form == "kv_cache":
        return inputs.replace(query=key[:, inputs.tk - inputs.tq:].copy(), key=key, value=key)
    if form == "shared_kv":
        return inputs.replace(key=key, value=key)
    value = inputs.value.copy()
    value[where] = poison(rng, block, kind)
    return inputs.replace(key=key, value=value)


def key_position_gradients(grads: dict, form: str) -> dict[str, np.ndarray]:
    """The gradients through which keys/values are reached in ``form``, each indexed by key position (batch, Tk,
    d_model): the key and value entries, x_kv's, x's, or for a KV-cache call the cached rows' then x_new's
    (``sequence``: x_new's rows are the last Tq key positions)."""
    if form == "kv_cache":
        parts = ([grads["key"]] if "key" in grads else []) + [grads["query"]]
        return {"sequence": np.concatenate([np.asarray(g, np.float64) for g in parts], axis=1)}
    names = {"separate": ("key", "value"), "shared_kv": ("key",), "self": ("query",)}[form]
    return {name: np.asarray(grads[name], np.float64) for name in names}


