"""The float64 reference: the semantics every conformance case compares against.

Batched multi-head attention with optional biases, causal masking in both alignments,
key padding masks, boolean and additive attention masks, cross-attention, grouped- and
multi-query heads (query head n uses key/value head n // group) and per-head weights.

Soft-capped scores (Gemma 2's ``attn_logit_softcapping``, flash-attn's ``softcap``): a backend that declares
``Capabilities.logit_softcap = c`` is compared with scores ``c * tanh(s / c)``, taken after the scale and before
any mask (:func:`scores_as_declared`); every other backend with the scores as they are. A score scale of the layer's
own design (``Capabilities.score_scale``: T5's 1, muP's 1/d_head) replaces the standard 1/sqrt(d_head) the same way.
A layer whose config has a q/k norm (``AttentionConfig.qk_norm``: Qwen 3's and Gemma 3's RMSNorm of each head, OLMo 2's
of the whole projection, timm's and ViT-22B's LayerNorm of each head, with and without its bias) normalises its q and
k projections, ``y / sqrt(mean(y^2) + eps) * g`` (a LayerNorm's y less its mean, then its bias ``beta`` added),
before the scores; the forward, both backwards (the gains ``g_q``, ``g_k`` and biases ``beta_q``, ``beta_k`` get
gradients of their own) and the term magnitudes go through it. Rotary position embeddings
(``AttentionConfig.rotary``: Hugging Face's rotate_half pairing or GPT-J's interleaved one) turn each head's q and k
after the norm, key j at position j and query i at i + Tk - Tq; the backward turns their gradients back. A sliding
window (``AttentionConfig.sliding_window = w``: Mistral's, Gemma's) hides from each query every key more than w - 1
positions before its own, on top of the call's masks. An ALiBi layer (``AttentionConfig.alibi``: flash-attn's and
MPT's ``-m_h |p - s|``, the paper's and BLOOM's ``-m_h (p - s)``) adds its bias by distance to each head's scaled
scores, exactly (as a float attn_mask is added), before the call's float mask.

Fully masked rows: a query row whose keys are all masked outputs **zeros** before W_o
(its attention weights are all zero), following flash-attention and torch SDPA >= 2.5.
Backends that give NaN or a uniform average declare a divergence.

``rows`` restricts the computation to a subset of query rows, so a check at T = 8192
costs O(len(rows) * T) rather than O(T^2).

Results are memoised by the *content* of their inputs (:class:`_ContentCache`): every backend checked in one
process gets the same case inputs, so each variant's reference (and its naive run in each dtype) is computed
once per run, not once per backend. Validation still runs on every call, and every call gets its own copy.

The same code, run with ``dtype`` other than float64, is "the naive algorithm in that
dtype" (rounding after every stage), whose error against float64 sets the tolerance.

In float64 the q, k and v projections are within one unit in the last place of their exact values
(:func:`~mha_harness.contract.exact_matmul.exact_affine`): a float64 matmul rounds at the size of its terms, and
where they cancel that rounding, carried into every score of a row at large logits, was as large as a correct
float64 kernel's whole error. The output projection is float64's own matmul (its rounding adds to the output once).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import threading
from collections import OrderedDict

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionOutput, AttentionParams
from mha_harness.contract.conventions import (
    EPS,
    PARAM_NAMES,
    QK_NORMS_CENTRED,
    QK_NORMS_PER_HEAD,
    QK_NORMS_WITH_BIAS,
    alibi_bias,
    causal_offset,
    rotary_pairs,
    rotary_positions,
    round_to,
    window_allows,
)
from mha_harness.contract.exact_matmul import exact_affine
from mha_harness.contract.numerics import weighted_values
from mha_harness.contract.scoped import scoped
from mha_harness.contract.score_scale import checked_score_scale, score_scale_at, score_scale_label
from mha_harness.contract.validation import require_inputs, require_params

#: what a row with no key to attend to outputs before W_o: "zeros" (the convention), "uniform_average" or "nan";
#: changed only while a backend's declared ``fully_masked_rows:...`` divergence is verified
_EMPTY_ROWS: contextvars.ContextVar[str] = contextvars.ContextVar("empty_rows", default="zeros")
EMPTY_ROW_CONVENTIONS = ("zeros", "uniform_average", "nan")


@contextlib.contextmanager
def empty_rows_as(convention: str):
    """Within this block the reference gives rows with no visible key the ``convention`` output."""
    if convention not in EMPTY_ROW_CONVENTIONS:
        raise ValueError(f"convention: got {convention!r}; accepted: {', '.join(EMPTY_ROW_CONVENTIONS)}")
    with scoped(_EMPTY_ROWS, convention):
        yield


def empty_rows_convention() -> str:
    """The output the reference gives rows with no visible key now (see :func:`empty_rows_as`)."""
    return _EMPTY_ROWS.get()


#: how the backward treats the scores of a row with no visible key under the uniform-average convention: "held"
#: (the layer replaces them with one constant, as a where or masked_fill does: nothing flows back to them) or
#: "shifted" (it adds a finite minimum, which rounding absorbs the scores into in the forward while the backward
#: still differentiates them: the softmax's backward at uniform weights); the two give the same forward
UNIFORM_ROW_SCORES = ("held", "shifted")
_UNIFORM_ROW_SCORES: contextvars.ContextVar[str] = contextvars.ContextVar("uniform_row_scores", default="held")


@contextlib.contextmanager
def uniform_row_scores_as(mode: str):
    """Within this block the reference's backward treats the scores of rows with no visible key as ``mode`` says
    (see :data:`UNIFORM_ROW_SCORES`; it matters only under the ``uniform_average`` convention)."""
    if mode not in UNIFORM_ROW_SCORES:
        raise ValueError(f"mode: got {mode!r}; accepted: {', '.join(UNIFORM_ROW_SCORES)}")
    with scoped(_UNIFORM_ROW_SCORES, mode):
        yield


#: the cap c of soft-capped scores, ``c * tanh(scores / c)`` after the scale and before any mask, or None (the
#: scores as they are); set for the run of a backend that declares ``Capabilities.logit_softcap``
_LOGIT_SOFTCAP: contextvars.ContextVar[float | None] = contextvars.ContextVar("logit_softcap", default=None)


@contextlib.contextmanager
def logit_softcap_as(cap: float | None):
    """Within this block the reference soft-caps its scaled scores at ``cap`` (None: no cap), forward and backward."""
    if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool)
                                and np.isfinite(cap) and cap > 0):
        raise ValueError(f"cap: got {cap!r}; accepted: None or a finite number > 0")
    with scoped(_LOGIT_SOFTCAP, None if cap is None else float(cap)):
        yield


def logit_softcap() -> float | None:
    """The cap the reference applies to its scaled scores now (see :func:`logit_softcap_as`), or None."""
    return _LOGIT_SOFTCAP.get()


#: the score scale the reference applies (:mod:`~mha_harness.contract.score_scale`: None is the standard
#: 1/sqrt(d_head)); set for the run of a backend that declares ``Capabilities.score_scale``
_SCORE_SCALE: contextvars.ContextVar[float | str | None] = contextvars.ContextVar("score_scale", default=None)


@contextlib.contextmanager
def score_scale_as(scale):
    """Within this block the reference scales its scores by ``scale`` (None: the standard 1/sqrt(d_head); a rule
    such as "1/d_head"; or a number applied at every head width), forward and backward."""
    with scoped(_SCORE_SCALE, checked_score_scale(scale, "scale")):
        yield


def score_scale(d_head: int) -> np.float64:
    """The scale the reference multiplies the scores of ``d_head``-wide heads by now (see :func:`score_scale_as`), as
    a NumPy float64: a Python float is a weak scalar (NEP 50), so ``float32 scores * scale`` would stay float32 and
    the naive algorithm in float32, whose error sets the tolerance, would round once more than it does."""
    return np.float64(score_scale_at(_SCORE_SCALE.get(), d_head))


def score_scale_declared():
    """The score scale the reference holds now as declared (None, a rule's name or a number)."""
    return _SCORE_SCALE.get()


def score_scale_named() -> str:
    """The reference's score scale now, in words ("1/sqrt(d_head)", "1/d_head", "1 (no scaling)", "0.0625")."""
    return score_scale_label(_SCORE_SCALE.get())


@contextlib.contextmanager
def scores_as_declared(capabilities):
    """The scores' conventions a backend declares (:class:`~mha_harness.contract.api.Capabilities`: its
    ``logit_softcap`` and ``score_scale``), for the references computed within this block."""
    with logit_softcap_as(getattr(capabilities, "logit_softcap", None)), \
            score_scale_as(getattr(capabilities, "score_scale", None)):
        yield


def soft_capped(scores: np.ndarray, r=lambda x: x) -> np.ndarray:
    """``scores`` soft-capped as the reference does now (``c * tanh(scores / c)``; unchanged without a cap), each
    stage rounded with ``r``."""
    cap = _LOGIT_SOFTCAP.get()
    return scores if cap is None else r(cap * np.tanh(r(scores / cap)))


#: the rotary mistakes the reference can make, for diagnoses (:func:`rotary_mistaken`): only q or only k turned,
#: the queries turned at positions 0 .. Tq - 1 where a KV-cache step's or a cross call's are Tk - Tq .. Tk - 1, the
#: new tokens (the queries and the last Tq keys, their own) turned so while the cached keys keep their positions (a
#: Hugging Face step given position_ids = arange(Tq)), every key turned one position later or earlier than the
#: queries' positions make it (an off-by-one), or q and k turned before their q/k norm instead of after it
#: (forward only), or a partial rotary's frequencies spread over all d_head features instead of the r it turns
#: (``base ** (-2i / d_head)``: the inv_freq of a full rotary, cut to r/2 frequencies)
ROTARY_MISTAKES = ("q_only", "k_only", "queries_from_zero", "new_tokens_from_zero", "keys_one_later",
                   "keys_one_earlier", "before_norm", "frequencies_over_head")
_ROTARY_MISTAKE: contextvars.ContextVar[str | None] = contextvars.ContextVar("rotary_mistake", default=None)


@contextlib.contextmanager
def rotary_mistaken(mistake: str | None):
    """Within this block the reference applies a layer's rotary embeddings with ``mistake`` (one of
    :data:`ROTARY_MISTAKES`; None: as the config says), forward and backward: what a diagnosis compares with."""
    if mistake is not None and mistake not in ROTARY_MISTAKES:
        raise ValueError(f"mistake: got {mistake!r}; accepted: None, {', '.join(map(repr, ROTARY_MISTAKES))}")
    with scoped(_ROTARY_MISTAKE, mistake):
        yield


#: a q/k norm computed otherwise than the config says, for diagnoses (:func:`qk_norm_mistaken`): (its name, the norm)
_QK_NORM_AS: contextvars.ContextVar[tuple[str, object] | None] = contextvars.ContextVar("qk_norm_as", default=None)


@contextlib.contextmanager
def qk_norm_mistaken(name: str, normed):
    """Within this block the reference norms a layer's q and k projections as ``normed(y, which, n_heads)`` does
    (``y``: the projection (batch, T, width) of ``which``, "q" or "k", in float64; it returns ``y`` normed) instead
    of as ``config.qk_norm`` says, forward only: what a q/k-norm diagnosis compares with. ``name`` names the mistake
    for the reference's memo: one name, one function of the layer's parameters."""
    if not isinstance(name, str) or not name or not callable(normed):
        raise ValueError(f"qk_norm_mistaken: got name {name!r} and normed {normed!r}; accepted: a non-empty str and "
                         "a function (y, which, n_heads) -> normed y")
    with scoped(_QK_NORM_AS, (name, normed)):
        yield


def rotary_tables(positions: np.ndarray, width: int, base: float, dtype: str = "float64", spread: int | None = None,
                  scaling=None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotary angles ``p * base ** (-2i / width)``, (len(positions), width // 2), rounded to
    ``dtype`` (``width``: the features turned, d_head or a partial rotary's r; ``spread``: the denominator instead,
    for the mistake of a partial rotary's frequencies over d_head; ``scaling``: a
    :class:`~mha_harness.contract.conventions.RotaryScaling` of the frequencies, or None; YaRN's multiplies cos and
    sin by its attention factor). Below float64 the angles
    are computed as kernels compute them, in float32 whatever the dtype (the frequencies ``1 / base ** (2i /
    width)``, their scaling and their products with the positions each rounded to float32: at position p an angle is
    off by about p * 2^-24), which at long positions is most of a float32 layer's error."""
    i = np.arange(width // 2, dtype=np.float64)
    over = width if spread is None else spread
    p = np.asarray(positions, np.float64)[:, None]
    scaled = (lambda f: f) if scaling is None else (lambda f: scaling.frequencies(f, base))  # noqa: E731
    if dtype == "float64":
        theta = p * scaled(np.float64(base) ** (-2.0 * i / over))
    else:
        f32 = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731
        theta = f32(p * f32(scaled(f32(1.0 / f32(f32(base) ** f32(2.0 * i / over))))))
    cos, sin = np.cos(theta), np.sin(theta)
    if scaling is not None and scaling.attention_scale != 1.0:  # YaRN's attention factor, on q and k alike
        rounded = (lambda a: a) if dtype == "float64" else f32  # noqa: E731
        cos, sin = rounded(rounded(cos) * scaling.attention_scale), rounded(rounded(sin) * scaling.attention_scale)
    return round_to(cos, dtype), round_to(sin, dtype)


def _config_tables(positions: np.ndarray, config, dtype: str = "float64") -> tuple[np.ndarray, np.ndarray]:
    """:func:`rotary_tables` of the config's rotary (its width, base and scaling), spread over d_head under the
    ``frequencies_over_head`` mistake."""
    spread = config.d_head if _ROTARY_MISTAKE.get() == "frequencies_over_head" else None
    return rotary_tables(positions, config.rotary_width, config.rotary_base, dtype, spread, config.rotary_scaling)


def _call_positions(inputs: AttentionInputs, rows=None) -> tuple[np.ndarray, np.ndarray]:
    """The rotary positions of the call's queries (those of ``rows``) and keys, as :func:`rotary_positions` gives
    them, or the queries' from 0 under the ``queries_from_zero`` mistake, and the last Tq keys' too under
    ``new_tokens_from_zero``; every key's one later (``keys_one_later``) or earlier (``keys_one_earlier``) than
    the queries' positions make it."""
    q_pos, k_pos = rotary_positions(inputs.tq, inputs.tk)
    mistake = _ROTARY_MISTAKE.get()
    if mistake in ("keys_one_later", "keys_one_earlier"):
        k_pos = k_pos + (1 if mistake == "keys_one_later" else -1)
    if mistake in ("queries_from_zero", "new_tokens_from_zero"):
        q_pos = np.arange(inputs.tq, dtype=np.int64)
    if mistake == "new_tokens_from_zero" and inputs.tq <= inputs.tk:
        k_pos = np.concatenate([k_pos[:inputs.tk - inputs.tq], np.arange(inputs.tq, dtype=np.int64)])
    return (q_pos if rows is None else q_pos[np.asarray(rows)]), k_pos


def rotated(x: np.ndarray, positions: np.ndarray, config, dtype: str = "float64", which: str = "q",
            inverse: bool = False) -> np.ndarray:
    """Heads ``x`` (batch, heads, T, d_head) at ``positions`` (T,) turned by the config's rotary embeddings (its
    pairs among the first ``config.rotary_width`` features, the rest unturned:
    :func:`~mha_harness.contract.conventions.rotary_pairs`; ``x`` itself without them, or for ``which``
    (q or k) under a :func:`rotary_mistaken` that leaves it out), each stage rounded to ``dtype``. ``inverse``:
    turned back (the transpose: the backward of the rotation)."""
    mistake = _ROTARY_MISTAKE.get()
    if config.rotary is None or (mistake, which) in (("q_only", "k"), ("k_only", "q")):
        return x
    r = lambda a: round_to(a, dtype)  # noqa: E731
    a, b = rotary_pairs(config.rotary, config.rotary_width)
    cos, sin = _config_tables(positions, config, dtype)
    if inverse:
        sin = -sin
    xa, xb = x[..., a], x[..., b]
    ya, yb = r(r(xa * cos) - r(xb * sin)), r(r(xb * cos) + r(xa * sin))
    out = np.array(x, dtype=ya.dtype)  # a partial rotary's features past its width pass unturned
    out[..., a], out[..., b] = ya, yb
    return out


def _rotated_squares(x_sq: np.ndarray, positions: np.ndarray, config) -> np.ndarray:
    """The squares of the terms of each rotated entry (:func:`rotated`, either way) from those of ``x_sq``'s:
    ``cos^2 x_a^2 + sin^2 x_b^2`` (a rotated entry is a sum of two terms)."""
    if config.rotary is None:
        return x_sq
    a, b = rotary_pairs(config.rotary, config.rotary_width)
    cos, sin = (np.square(t) for t in _config_tables(positions, config))
    out = np.array(x_sq)
    out[..., a] = cos * x_sq[..., a] + sin * x_sq[..., b]
    out[..., b] = cos * x_sq[..., b] + sin * x_sq[..., a]
    return out


def _softcap_slope(q, k, scale: float) -> np.ndarray | None:
    """The derivative of the soft cap at each scaled score, ``1 - tanh^2(s / c)`` (None without a cap): the
    backward multiplies the scores' gradient by it."""
    cap = _LOGIT_SOFTCAP.get()
    if cap is None:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        return 1.0 - np.square(np.tanh(q @ k.transpose(0, 1, 3, 2) * (scale / cap)))


def _held_rows(allowed, shape) -> np.ndarray | None:
    """The rows (broadcastable to ``shape[:-1] + (1,)``) whose scores the backward holds constant now: rows with no
    visible key under the uniform-average convention with "held" scores; None when there are none to hold."""
    if _EMPTY_ROWS.get() != "uniform_average" or _UNIFORM_ROW_SCORES.get() != "held":
        return None
    return ~np.broadcast_to(allowed, shape).any(axis=-1, keepdims=True)


def allowed_and_bias(params: AttentionParams, inputs: AttentionInputs, rows: np.ndarray | None = None):
    """Boolean "may attend" mask and additive bias, each broadcastable to (B, H, R, Tk)."""
    tq, tk = inputs.tq, inputs.tk
    q_idx = np.arange(tq) if rows is None else np.asarray(rows)
    allowed = np.ones((1, 1, len(q_idx), tk), dtype=bool)
    additive = None
    if inputs.causal:
        offset = causal_offset(inputs.causal, tq, tk)
        allowed = allowed & (np.arange(tk)[None, :] <= q_idx[:, None] + offset)[None, None]
    window = params.config.sliding_window
    if window is not None:  # the keys at the query's position and the w - 1 before it
        allowed = allowed & window_allows(window, inputs.causal, tq, tk, q_idx)[None, None]
    if inputs.key_padding_mask is not None:
        allowed = allowed & ~inputs.key_padding_mask[:, None, None, :]
    if params.config.alibi is not None:  # the layer's own bias by distance, per head (before any float mask's)
        additive = alibi_bias(params.config.alibi, params.config.num_heads, tq, tk, q_idx)[None]
    if inputs.attn_mask is not None:
        m = inputs.attn_mask
        m = m.reshape((1, 1) + m.shape) if m.ndim == 2 else m
        m = m[:, :, q_idx, :]
        if m.dtype == np.bool_:
            allowed = allowed & m
        else:
            mask = m.astype(np.float64)
            allowed = allowed & ~np.isneginf(mask)
            mask = np.where(np.isneginf(mask), 0.0, mask)
            additive = mask if additive is None else additive + mask
    return allowed, additive


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    b, t, w = x.shape
    return x.reshape(b, t, n, w // n).transpose(0, 2, 1, 3)


def _project(x, w, bias, dtype, exact: bool = True):
    """``x @ w + bias`` as a kernel in ``dtype`` gets it at best: each entry the exact value rounded once to
    ``dtype`` (in float64 by :func:`~mha_harness.contract.exact_matmul.exact_affine`, since float64's own matmul
    rounds at the size of the terms, which cancel; in a narrower dtype float64's sum of its exact products).
    ``exact=False``: float64's own matmul (the output projection, whose rounding adds to the output once, at the
    size the bound's floor allows, where q's and k's is multiplied by the scores)."""
    if dtype == "float64" and exact:  # memoised: a diagnosis's wrong layers (scales, caps, mistakes) share them
        x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
        bias = None if bias is None else np.asarray(bias, np.float64)
        return _PROJECTIONS.get(_digest("projection", x, w, bias), lambda: _frozen(exact_affine(x, w, bias)),
                                lambda y: y.nbytes)
    y = round_to(x, dtype) @ round_to(w, dtype)
    if bias is not None:
        y = y + round_to(bias, dtype)
    return round_to(y, dtype)


def _norm_groups(y: np.ndarray, config, n_heads: int) -> np.ndarray:
    """``y`` (batch, T, width) as the groups ``config.qk_norm`` normalises, along the last axis: each head's
    d_head features (a norm per head; ``n_heads`` of them) or the whole width (``rms_over_projection``)."""
    b, t, w = y.shape
    return y.reshape(b, t, n_heads, w // n_heads) if config.qk_norm in QK_NORMS_PER_HEAD else y


def _centred(x: np.ndarray, config, r=lambda a: a) -> np.ndarray:
    """``x`` less its mean over the last axis for a LayerNorm (:data:`QK_NORMS_CENTRED`); ``x`` for an RMSNorm."""
    return r(x - r(x.mean(axis=-1, keepdims=True))) if config.qk_norm in QK_NORMS_CENTRED else x


def _rms_inverse(x: np.ndarray, eps: float, r=lambda a: a) -> np.ndarray:
    """``1 / sqrt(mean(x^2) + eps)`` over the last axis (keeping it), rounding each stage with ``r``."""
    return r(1.0 / np.sqrt(r(r(np.square(x)).mean(axis=-1, keepdims=True) + eps)))


def _lane_error(size: np.ndarray, error_of: str, which: str, rows) -> np.ndarray:
    """:func:`_rounding_error` of ``size`` (batch, n, T, m) for q's or k's norm (``which``), their signs independent:
    q's and k's take alternate lanes of one (batch, 2n, T, m) sign pattern; ``rows``: the query rows (q's)."""
    b, n, t, m = size.shape
    lanes = np.zeros((b, 2 * n, t, m))
    lane = {"q": 0, "k": 1}[which]
    lanes[:, lane::2] = size
    return _rounding_error(lanes, error_of, rows if which == "q" else None)[:, lane::2]


def _variance_error(groups: np.ndarray, error_of: str, which: str, rows) -> np.ndarray:
    """The rounding error of ``error_of`` in a LayerNorm's one-pass variance ``mean(y^2) - mean(y)^2`` of each of
    ``groups`` (batch, T, [heads,] features): two roundings at the size of its terms, a pseudo-random sign per
    group (:func:`_rounding_error`; q's and k's independent, a query row's the same whichever ``rows`` are
    computed). Where a group's mean is large against its spread the terms are far above the variance, and this is
    the largest error a correct kernel makes there."""
    size = np.square(groups).mean(axis=-1) + np.square(groups.mean(axis=-1))
    b, t = size.shape[:2]
    size = size.reshape(b, t, -1).transpose(0, 2, 1)  # (batch, groups, T): a sign per group and position
    error = _lane_error(2 * size[..., None], error_of, which, rows)[..., 0]
    return error.transpose(0, 2, 1).reshape(groups.shape[:-1] + (1,))


def _norm_parts(y: np.ndarray, config, n_heads: int, r, one_pass: bool, error_of: str | None = None,
                which: str = "q", rows=None) -> tuple[np.ndarray, np.ndarray]:
    """The groups of ``y`` the q/k norm divides (:func:`_centred`) and ``1 / sqrt(mean square + eps)`` for each,
    rounding each stage with ``r``. ``one_pass``: a LayerNorm's variance taken in one pass, ``mean(y^2) -
    mean(y)^2`` (at least 0), as flax's LayerNorm (``use_fast_variance``) and ``jax.nn.standardize`` compute it:
    another valid algorithm, whose rounding error where a group's mean is large against its spread is far above
    the two-pass one's (an RMSNorm has no such choice). ``error_of``: a dtype; a LayerNorm's variance then carries
    the rounding of that algorithm in it (:func:`_variance_error`; ``which``: q or k, ``rows``: the query rows)."""
    groups = _norm_groups(y, config, n_heads)
    x = _centred(groups, config, r)
    if config.qk_norm not in QK_NORMS_CENTRED or not (one_pass or error_of):
        return x, _rms_inverse(x, config.qk_norm_eps, r)
    if one_pass:
        mean = r(groups.mean(axis=-1, keepdims=True))
        variance = r(r(r(np.square(groups)).mean(axis=-1, keepdims=True)) - r(np.square(mean)))
    else:
        variance = r(np.square(x).mean(axis=-1, keepdims=True))
    if error_of is not None:
        variance = variance + _variance_error(groups, error_of, which, rows)
    return x, r(1.0 / np.sqrt(r(np.maximum(variance, 0.0) + config.qk_norm_eps)))


def qk_normed(y: np.ndarray, gain, config, n_heads: int, r=lambda a: a, one_pass: bool = False,
              error_of: str | None = None, which: str = "q", rows=None, bias=None) -> np.ndarray:
    """The projection ``y`` (batch, T, width) after the layer's q/k norm (``config.qk_norm``; unchanged without
    one): ``x / sqrt(mean(x^2) + eps) * gain (+ bias)`` over :func:`_norm_groups`, where x is ``y`` (an RMSNorm) or
    ``y`` less its mean (a LayerNorm: :func:`_centred`; ``bias``: its bias, None without), rounding each stage with
    ``r``; ``one_pass``, ``error_of``, ``which``, ``rows``: a LayerNorm's variance in one pass, or carrying its
    rounding (:func:`_norm_parts`)."""
    if config.qk_norm is None:
        return y
    x, inv = _norm_parts(y, config, n_heads, r, one_pass, error_of, which, rows)
    out = r(r(x * inv) * r(gain))
    return (out if bias is None else r(out + r(bias))).reshape(y.shape)


def _qk_norm_vjp(y: np.ndarray, gain, d_out: np.ndarray, config, n_heads: int, r=lambda a: a,
                 one_pass: bool = False, error_of: str | None = None, which: str = "q"):
    """The backward of :func:`qk_normed` at the projection ``y``: the gradient with respect to ``y`` and to the
    gain, from ``d_out``, the gradient with respect to the normed projection (dx = inv * (u - x_hat * mean(u *
    x_hat)) with u = gain * d_out, x_hat = x * inv; a LayerNorm also subtracts mean(u)), and to a LayerNorm's bias
    (the sum of ``d_out`` over the groups), rounding each stage with ``r``; ``one_pass``, ``error_of``, ``which``: as
    :func:`_norm_parts`'s. Returns (d_y, d_gain, d_bias)."""
    x, inv = _norm_parts(y, config, n_heads, r, one_pass, error_of, which)
    d = _norm_groups(d_out, config, n_heads)
    x_hat = r(x * inv)
    d_gain = r((d * x_hat).sum(axis=tuple(range(d.ndim - 1))))
    u = r(d * r(gain))
    if config.qk_norm in QK_NORMS_CENTRED:
        u = r(u - r(u.mean(axis=-1, keepdims=True)))
    d_x = r(inv * r(u - r(x_hat * r((u * x_hat).mean(axis=-1, keepdims=True)))))
    return d_x.reshape(y.shape), d_gain, r(d.sum(axis=tuple(range(d.ndim - 1))))


def _projection_error(x, params: AttentionParams, which: str, error_of: str, rows) -> np.ndarray:
    """The rounding error of ``error_of`` in the projection ``which`` (q or k) of ``x``, at the size of its dot
    products' terms (``|x| @ |W| + |b|``), a pseudo-random sign per entry (:func:`_rounding_error`; q's and k's
    independent, a query row's the same whichever ``rows`` are computed). One rounding at that size in a layer
    without a q/k norm: a float32 matmul's error is 0.23 x eps x the terms' size in root mean square at every
    d_model from 4 to 512 (NumPy's and torch's, 2026-12-07), so one rounding (eps / 2) is about twice the typical;
    where its terms cancel at large logits the scores turn it into a row's largest error (docs/cases.md). Two in a
    layer with one, whose norm magnifies it where a group's spread is small (flax's normalize_qk, 2026-12-05)."""
    bias = getattr(params, f"b_{which}")
    size = np.abs(x) @ np.abs(getattr(params, f"W_{which}")) + (0.0 if bias is None else np.abs(bias))
    roundings = 1 if params.config.qk_norm is None else 2
    return _lane_error(roundings * size[:, None], error_of, which, rows)[:, 0]


def _project_normed(x, params: AttentionParams, which: str, n_heads: int, dtype: str,
                    one_pass: bool = False, error_of: str | None = None, rows=None, before_norm=None) -> np.ndarray:
    """The projection ``which`` (q, k or v) of ``x``, through the q/k norm for q and k (``one_pass``: a
    LayerNorm's variance in one pass, :func:`_norm_parts`), split into heads. ``error_of``: a dtype; the q and k
    projections then carry its rounding (:func:`_projection_error`; ``rows``: the query rows ``x`` holds), before
    the norm where there is one, which can magnify it where a group's spread is small against eps or its mean: the
    error of a kernel whose projections sum in that dtype. ``before_norm``: a function of the projection (batch, T,
    width) applied before the norm (a diagnosis' mistake)."""
    y = _project(x, getattr(params, f"W_{which}"), getattr(params, f"b_{which}"), dtype)
    if which != "v" and error_of is not None:
        y = y + _projection_error(x, params, which, error_of, rows)
    if which != "v" and before_norm is not None:
        y = before_norm(y)
    mistaken = _QK_NORM_AS.get()
    if which != "v" and mistaken is not None:
        y = round_to(mistaken[1](np.asarray(y, np.float64), which, n_heads), dtype)
    elif which != "v":
        y = qk_normed(y, getattr(params, f"g_{which}"), params.config, n_heads, lambda a: round_to(a, dtype),
                      one_pass, error_of, which, rows, getattr(params, f"beta_{which}"))
    return _heads(y, n_heads)


def _turned_heads(x, params: AttentionParams, which: str, n_heads: int, dtype: str, positions, one_pass: bool = False,
                  error_of: str | None = None, rows=None) -> np.ndarray:
    """q's or k's heads (:func:`_project_normed`) turned by the rotary embeddings at ``positions`` (:func:`rotated`):
    after the q/k norm, or before it under the ``before_norm`` mistake."""
    c = params.config
    if _ROTARY_MISTAKE.get() == "before_norm" and c.qk_norm is not None and c.rotary is not None:
        def early(y):
            return _merge_heads(rotated(_heads(y, n_heads), positions, c, dtype, which), n_heads)
        return _project_normed(x, params, which, n_heads, dtype, one_pass, error_of, rows, before_norm=early)
    return rotated(_project_normed(x, params, which, n_heads, dtype, one_pass, error_of, rows), positions, c, dtype,
                   which)


def _empty_row_weight(empty_rows: str, tk: int) -> float:
    """The weight every key gets in a row with no visible key, under the ``empty_rows`` convention."""
    return {"zeros": 0.0, "nan": np.nan, "uniform_average": 1.0 / tk}[empty_rows]


def _masked_softmax(scores, allowed, empty_rows: str = "zeros"):
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    any_allowed = np.isfinite(row_max)
    e = np.exp(scores - np.where(any_allowed, row_max, 0.0))
    e = np.where(allowed, e, 0.0)
    total = e.sum(axis=-1, keepdims=True)
    empty = _empty_row_weight(empty_rows, scores.shape[-1])
    return np.where(any_allowed, e / np.where(total == 0, 1, total), empty)


#: mixed into the hash of :func:`_signs` (fixed: a tolerance is a function of the case's inputs alone)
SCORE_ERROR_SEED = 20261202
_MIX = tuple(np.uint64(m) for m in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93))


def _score_terms(q, k, scale: float) -> np.ndarray:
    """The size of the terms each score's dot product sums, ``scale * sum_d |q_d k_d|``: its rounding error in any
    dtype grows with it (not with the possibly cancelled score)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(q) @ np.abs(k).transpose(0, 1, 3, 2) * scale


def _score_error_size(q, k, scale: float, of: str) -> np.ndarray:
    """The size at which :func:`_scores` rounds each score's error in ``of`` (in units of its unit roundoff): in
    float32 or float64 two roundings at the size of the dot product's terms (:func:`_score_terms`; a sum in that
    dtype rounds more than once); in a half precision, the standard deviation of a textbook kernel's error (torch's
    matmul of half tensors sums in float32 and rounds the score once; q's and k's entries are each rounded once to
    the dtype), each rounding's relative error uniform within the unit roundoff and independent:
    ``sqrt((s^2 + 2 sum_d (q_d k_d)^2) / 3)``."""
    if of not in ("bfloat16", "float16"):
        return 2 * _score_terms(q, k, scale)
    with np.errstate(invalid="ignore", over="ignore"):
        score = np.square(q @ k.transpose(0, 1, 3, 2))
        products = np.square(q) @ np.square(k).transpose(0, 1, 3, 2)
        return np.sqrt((score + 2 * products) / 3) * scale


def _signs(shape, rows) -> np.ndarray:
    """A pseudo-random sign per (batch, head, query position, key), a hash (splitmix64's finaliser) of those indices
    and :data:`SCORE_ERROR_SEED`: an entry's sign does not depend on which query ``rows`` are computed."""
    b, h, r, t = shape
    query = np.arange(r) if rows is None else np.asarray(rows)
    z = (np.arange(b, dtype=np.uint64)[:, None, None, None] * _MIX[0]
         ^ np.arange(h, dtype=np.uint64)[None, :, None, None] * _MIX[1]
         ^ query.astype(np.uint64)[None, None, :, None] * _MIX[2]
         ^ np.arange(t, dtype=np.uint64)[None, None, None, :] * _MIX[3] ^ np.uint64(SCORE_ERROR_SEED))
    z = (z ^ (z >> np.uint64(30))) * _MIX[1]
    z = (z ^ (z >> np.uint64(27))) * _MIX[2]
    z = z ^ (z >> np.uint64(31))
    return np.where(z >> np.uint64(63), -1.0, 1.0)


def _rounding_error(size: np.ndarray, of: str, rows, signs: np.ndarray | None = None) -> np.ndarray:
    """``size`` times the unit roundoff of ``of`` (eps / 2: one rounding at its largest), with a pseudo-random sign
    per entry (:func:`_signs`, or ``signs``); non-finite sizes give 0."""
    with np.errstate(invalid="ignore"):
        error = EPS[of] / 2 * size * (_signs(size.shape, rows) if signs is None else signs)
    return np.where(np.isfinite(error), error, 0.0)


def _apart_at_the_top(signs: np.ndarray, scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``signs`` (batch, heads, queries, keys; changed in place) with, in each row of two or more visible keys, the
    sign of its second-largest visible score set against its largest's. A row's weights move only with the
    differences of its scores' errors, and at large logits two keys carry nearly all of a row's weight: where those
    two drew one sign the estimate moves nothing (an outside user's soft-capped float32 layer at two keys failed at
    1.5 x a bound drawn so, 2026-12-05), while a kernel's two roundings fall either way. The other keys keep their
    draws."""
    masked = np.where(allowed, scores, -np.inf)
    if masked.shape[-1] < 2:
        return signs
    first = np.argmax(masked, axis=-1)[..., None]  # two passes of argmax: a row of 1000s of keys, no sort
    np.put_along_axis(masked, first, -np.inf, axis=-1)
    second = np.argmax(masked, axis=-1)[..., None]
    two = np.isfinite(np.take_along_axis(masked, second, axis=-1))
    apart = -np.take_along_axis(signs, first, axis=-1)
    np.put_along_axis(signs, second, np.where(two, apart, np.take_along_axis(signs, second, axis=-1)), axis=-1)
    return signs


def _scores(params: AttentionParams, inputs: AttentionInputs, rows, q, k, scale: float, dtype: str, scale_first: bool,
            score_error_of: str | None = None, sign: int = 1):
    """The scaled scores (soft-capped when a cap is declared: :func:`soft_capped`) with the float attn_mask added,
    rounding in ``dtype``; the allowed mask; the float mask's
    additive part (None without one). ``scale_first``:
    the queries times the scale rounded to ``dtype``, then the product (as fused kernels do); else the product
    scaled. ``score_error_of``: each score then carries an error of that dtype at the size of its dot product's
    terms (:func:`_score_terms`, :func:`_rounding_error`; the softmax turns an absolute score error e into a relative
    weight error of about e, so at large logits, scores of 100s, it is the largest error a correct kernel makes,
    and which way each score happens to round decides how large its output's error is; the two largest of a row
    round apart, :func:`_apart_at_the_top`; ``sign`` -1: every one the other way); a float mask is added as a
    kernel in that dtype adds it, rounded exactly (a huge finite mask value absorbs the score, here as there)."""
    if scale_first:
        scores = round_to(round_to(q * round_to(np.float64(scale), dtype), dtype) @ k.transpose(0, 1, 3, 2), dtype)
    else:
        scores = round_to(q @ k.transpose(0, 1, 3, 2) * scale, dtype)
    scores = soft_capped(scores, lambda x: round_to(x, dtype))
    allowed, additive = allowed_and_bias(params, inputs, rows)
    if additive is not None:
        scores = round_to(scores + additive, dtype)
    if score_error_of is not None:
        if additive is not None:
            with np.errstate(over="ignore"):
                rounded = round_to(scores, score_error_of).astype(np.float64)
            # a mask value beyond a half precision's range (float32's most negative, say) is added as float32 adds it
            scores = np.where(np.isfinite(rounded) | ~np.isfinite(scores), rounded,
                              round_to(scores, "float32").astype(np.float64))
        size = np.broadcast_to(_score_error_size(q, k, scale, score_error_of), scores.shape)
        signs = _apart_at_the_top(_signs(scores.shape, rows), scores, np.broadcast_to(allowed, scores.shape))
        scores = scores + _rounding_error(size, score_error_of, rows, sign * signs)
    return scores, allowed, additive


def _merge_heads(d: np.ndarray, n_heads: int) -> np.ndarray:
    """(batch, heads, T, d_head) per-head gradients -> (batch, T, n_heads * d_head), the query heads of a group
    summed onto their shared key/value head when ``n_heads`` is the key/value head count."""
    b, h, t, dh = d.shape
    if h != n_heads:
        d = d.reshape(b, n_heads, h // n_heads, t, dh).sum(axis=2)
    return d.transpose(0, 2, 1, 3).reshape(b, t, n_heads * dh)


def _forward_parts(params: AttentionParams, inputs: AttentionInputs, rows, dtype: str, empty_rows: str | None = None,
                   scale_first: bool = False, score_error_of: str | None = None,
                   projection_error_of: str | None = None, sign: int = 1):
    """The forward up to the heads' concatenation; ``projection_error_of`` (default ``score_error_of``): the
    q and k projections carry that dtype's rounding (:func:`_project_normed`); ``sign``: the scores' error
    as drawn (1) or the other way (-1)."""
    c = params.config
    query = inputs.query if rows is None else inputs.query[:, np.asarray(rows)]
    error_of = projection_error_of or score_error_of
    # the fused kernels' algorithm (scale_first) also takes a LayerNorm's variance in one pass, as flax's does
    q_pos, k_pos = _call_positions(inputs, rows)
    q = _turned_heads(query, params, "q", c.num_heads, dtype, q_pos, scale_first, error_of, rows)
    k = np.repeat(_turned_heads(inputs.key, params, "k", c.kv_heads, dtype, k_pos, scale_first, error_of), c.group,
                  axis=1)
    v = np.repeat(_project_normed(inputs.value, params, "v", c.kv_heads, dtype), c.group, axis=1)
    scale = score_scale(c.d_head)
    scores, allowed, _ = _scores(params, inputs, rows, q, k, scale, dtype, scale_first, score_error_of, sign)
    weights = round_to(_masked_softmax(scores, np.broadcast_to(allowed, scores.shape),
                                       empty_rows or empty_rows_convention()), dtype)
    heads = round_to(weighted_values(weights, v), dtype)
    b, h, r, dh = heads.shape
    concat = heads.transpose(0, 2, 1, 3).reshape(b, r, h * dh)
    return q, k, v, weights, concat, scale, allowed


# --- memoisation by content -----------------------------------------------------------------------------------

def _digest(*parts) -> bytes:
    """A digest of arrays (shape, dtype and bytes), None and plain values, in order (SHA-256: the CPU's SHA
    instructions make it about 1.5x as fast as BLAKE2b here, and most of a cached reference's cost is this)."""
    h = hashlib.sha256()
    for part in parts:
        if part is None:
            h.update(b"\x00none")
        elif isinstance(part, np.ndarray):
            h.update(f"\x01{part.dtype.str}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).view(np.uint8).reshape(-1).data if part.size else b"")
        elif isinstance(part, bytes):
            h.update(b"\x03" + part)
        else:
            h.update(f"\x02{part!r}".encode())
    return h.digest()


def _call_digest(params: AttentionParams, inputs: AttentionInputs) -> bytes:
    """The digest of a layer and one call of it: configuration, parameters, inputs (a key or value that is the
    query array itself counts as that, not hashed again) and masks."""
    c = params.config
    query = np.asarray(inputs.query)
    same = lambda x: "same as query" if x is inputs.query else np.asarray(x)  # noqa: E731
    return _digest(c.d_model, c.num_heads, c.kv_heads, c.bias, c.qk_norm, c.qk_norm_eps, c.rotary, c.rotary_base,
                   c.rotary_dims, None if c.rotary_scaling is None else repr(c.rotary_scaling), c.sliding_window,
                   c.alibi,
                   *(getattr(params, n) for n in PARAM_NAMES),
                   query, same(inputs.key), same(inputs.value), inputs.causal, inputs.key_padding_mask,
                   inputs.attn_mask)


#: (params, inputs, their digest) while :func:`hashed_once` holds: the same two objects are not hashed again
_HASHED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("hashed", default=None)


@contextlib.contextmanager
def hashed_once(params: AttentionParams, inputs: AttentionInputs):
    """Within this block, the memo keys of every reference computation for exactly these ``params`` and ``inputs``
    objects reuse one digest of them (hashing the arrays costs as much as most references themselves). The
    caller must not modify their arrays inside the block."""
    if _held_digest(params, inputs) is not None:  # nested: already hashed
        yield
        return
    with scoped(_HASHED, (params, inputs, _call_digest(params, inputs))):
        yield


def _held_digest(params: AttentionParams, inputs: AttentionInputs) -> bytes | None:
    """The digest :func:`hashed_once` holds for exactly these objects, or None."""
    held = _HASHED.get()
    return held[2] if held is not None and held[0] is params and held[1] is inputs else None


def _content_key(kind: str, params: AttentionParams, inputs: AttentionInputs, *extra) -> bytes:
    return _digest(kind, _held_digest(params, inputs) or _call_digest(params, inputs), _LOGIT_SOFTCAP.get(),
                   _SCORE_SCALE.get(), _ROTARY_MISTAKE.get(), _qk_norm_mistake_name(), *extra)


def _qk_norm_mistake_name() -> str | None:
    """The name of the :func:`qk_norm_mistaken` in effect, or None."""
    mistaken = _QK_NORM_AS.get()
    return None if mistaken is None else mistaken[0]


class _ContentCache:
    """Thread-safe LRU of computed results keyed by a content digest, bounded in bytes. A key being computed
    by one thread is waited for by the others (backends checked side by side ask for the same references)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self.pending: dict[bytes, threading.Event] = {}
        self.lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: bytes, compute, size):
        while True:
            with self.lock:
                if key in self.entries:
                    self.entries.move_to_end(key)
                    self.hits += 1
                    return self.entries[key][0]
                waiting = self.pending.get(key)
                if waiting is None:
                    self.pending[key] = threading.Event()
                    self.misses += 1
                    break
            waiting.wait()  # computed by another thread (or failed there: then computed here)
        try:
            value = compute()
            n = size(value)
            with self.lock:
                if n <= self.max_bytes:
                    self.entries[key] = (value, n)
                    self.bytes += n
                    while self.bytes > self.max_bytes:
                        _, (_, dropped) = self.entries.popitem(last=False)
                        self.bytes -= dropped
            return value
        finally:
            with self.lock:
                self.pending.pop(key).set()

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.bytes = self.hits = self.misses = 0


#: references computed in this process (256 MiB at most; the whole conformance suite needs about 30)
_CACHE = _ContentCache(256 * 2**20)


#: exact float64 projections (:func:`_project`), 64 MiB at most: the references a diagnosis computes for one call
#: (a score fit's ~140 scales and caps) differ only in their scores and share its q, k and v projections
_PROJECTIONS = _ContentCache(64 * 2**20)


def reference_cache_info() -> dict:
    """Hits, misses and bytes held by the reference's memo (for tests and profiling)."""
    with _CACHE.lock:
        return {"hits": _CACHE.hits, "misses": _CACHE.misses, "entries": len(_CACHE.entries), "bytes": _CACHE.bytes}


def clear_reference_cache() -> None:
    _CACHE.clear()
    _PROJECTIONS.clear()


def _require_sign(sign) -> None:
    if sign not in (1, -1) or isinstance(sign, bool):
        raise ValueError(f"score_error_sign: got {sign!r}; accepted: 1 or -1")


def _require_dtype_name(name: str, value: str | None) -> None:
    if value is not None and value not in EPS:
        raise ValueError(f"{name}: got {value!r}; accepted: None or one of {', '.join(EPS)}")


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a``, made read-only (a memoised value is shared by every caller)."""
    a.flags.writeable = False
    return a


def _read_only(*arrays):
    for a in arrays:
        if a is not None:
            a.flags.writeable = False


def reference_attention(params: AttentionParams, inputs: AttentionInputs, *, rows=None,
                        need_weights: bool = False, dtype: str = "float64",
                        empty_rows: str | None = None, scale_first: bool = False,
                        score_error_of: str | None = None,
                        projection_error_of: str | None = None, score_error_sign: int = 1) -> AttentionOutput:
    """Multi-head attention by the definition, in float64 unless ``dtype`` says otherwise.

    With ``rows`` only those query rows are computed (output shape (B, len(rows), d_model)). ``empty_rows``
    overrides the output of rows with no visible key (default: :func:`empty_rows_convention`, normally zeros).
    ``scale_first``: the queries are multiplied by the scale rounded to ``dtype`` before the product with the
    keys (as fused kernels compute it) instead of the product being scaled: another valid algorithm, whose honest
    error in a low precision differs (at large logits by several times).
    ``score_error_of``: a dtype; every score then carries an error of that dtype's rounding (two unit roundoffs at
    the size of the terms its dot product sums, a pseudo-random sign per entry; a float mask added and rounded as a
    kernel in that dtype does) and nothing else is rounded beyond ``dtype``: with float64, the error of a kernel
    exact but for its scores' rounding, which dominates at large logits (see :func:`_scores`).
    ``projection_error_of`` (default ``score_error_of``): the dtype whose rounding the q and k projections carry,
    before their norm where there is one (:func:`_projection_error`). ``score_error_sign`` -1: the scores' error the
    other way round (the projections' kept): in a layer with a q/k norm the two can cancel in one draw, and the
    tolerance takes both.
    """
    require_params(params)
    require_inputs(inputs)
    _require_dtype_name("score_error_of", score_error_of)
    _require_dtype_name("projection_error_of", projection_error_of)
    _require_sign(score_error_sign)
    empty_rows = empty_rows or empty_rows_convention()
    rows_key = None if rows is None else np.asarray(rows)

    def compute():
        *_, weights, concat, _, _ = _forward_parts(params, inputs, rows, dtype, empty_rows, scale_first,
                                                   score_error_of, projection_error_of, score_error_sign)
        out = _project(concat, params.W_o, params.b_o, dtype, exact=False).astype(np.float64)
        weights = weights.astype(np.float64) if need_weights else None
        _read_only(out, weights)
        return out, weights

    key = _content_key("forward", params, inputs, rows_key, need_weights, dtype, empty_rows, scale_first,
                       score_error_of, projection_error_of, score_error_sign)
    out, weights = _CACHE.get(key, compute, lambda v: v[0].nbytes + (0 if v[1] is None else v[1].nbytes))
    return AttentionOutput(out.copy(), None if weights is None else weights.copy())


def reference_vjp(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray,
                  dtype: str = "float64", *, flash: bool = False,
                  score_error_of: str | None = None,
                  projection_error_of: str | None = None, score_error_sign: int = 1) -> dict[str, np.ndarray]:
    """Gradients of sum(output * cotangent) with respect to inputs and parameters.

    Exact in float64; with another ``dtype`` it is the naive backward in that format
    (rounding after every stage), whose error sets the gradient tolerance. ``flash``: the backward
    as FlashAttention-2 computes it (weights recomputed from the log-sum-exp, the softmax backward's
    row term from the output), another valid algorithm whose honest error in ``dtype`` also counts.
    ``score_error_of``: in float64, the backward whose weights carry the rounding of the scores in that dtype: the
    textbook backward takes the weights of :func:`reference_attention`'s forward with that argument (normalised),
    FlashAttention's recomputes each weight as ``exp(s - lse)`` with that error, and one rounding of s + mask and of
    s - lse per entry and of the stored lse per row, in the exponent, which no normalisation removes (at large
    logits, |lse| of 100s, that is the largest error of its gradients; see :func:`_flash_weights`).
    ``projection_error_of`` (default ``score_error_of``), ``score_error_sign``: as :func:`reference_attention`'s, in
    forward and backward.
    """
    _require_dtype_name("score_error_of", score_error_of)
    _require_dtype_name("projection_error_of", projection_error_of)
    _require_sign(score_error_sign)
    cotangent = np.asarray(cotangent)

    def compute():
        # a naive backward in half precision may overflow where the layer's own does not: its error is the estimate
        with np.errstate(over="ignore", invalid="ignore"):
            grads = _vjp(params, inputs, cotangent, dtype, flash=flash, score_error_of=score_error_of,
                         projection_error_of=projection_error_of, sign=score_error_sign)
        _read_only(*grads.values())
        return grads

    key = _content_key("vjp", params, inputs, cotangent, dtype, empty_rows_convention(), _UNIFORM_ROW_SCORES.get(),
                       flash, score_error_of, projection_error_of, score_error_sign)
    grads = _CACHE.get(key, compute, lambda g: sum(a.nbytes for a in g.values()))
    return {name: grad.copy() for name, grad in grads.items()}


def reference_vjp_magnitudes(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray
                             ) -> dict[str, np.ndarray]:
    """For each gradient of :func:`reference_vjp`, the size of the terms its computation sums: the same backward
    in float64 with every sum of terms replaced by the root of the sum of their squares (each difference is a
    sum of two terms), carried through every stage.

    The rounding error of a sum, in any order, grows with the size of its terms, not with the sum: where terms
    cancel it is far above eps * |sum|. The softmax backward ``p * (dp - sum(dp * p))`` cancels at peaked weights,
    and the gradients of query, key and their weights inherit it; there this magnitude is far above |gradient|,
    while for ordinary random inputs (terms of random sign, whose sum is about their root-sum-square) it is about
    |gradient|. The tolerance rule's floor scales with it (rounding errors add like independent random terms:
    the probabilistic analysis of Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019)."""
    cotangent = np.asarray(cotangent)

    def compute():
        grads = _vjp_magnitudes(params, inputs, cotangent)
        _read_only(*grads.values())
        return grads

    key = _content_key("vjp-magnitudes", params, inputs, cotangent, empty_rows_convention(),
                       _UNIFORM_ROW_SCORES.get())
    grads = _CACHE.get(key, compute, lambda g: sum(a.nbytes for a in g.values()))
    return {name: grad.copy() for name, grad in grads.items()}


def _vjp_magnitudes(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray) -> dict:
    """The backward of :func:`_vjp` on squares: a sum of products sum_k a_k b_k becomes sum_k a_k^2 b_k^2 (so a
    product of matrices becomes the product of their squares), a difference a - b becomes a^2 + b^2; the square
    root at the end gives each gradient's root-sum-square of terms."""
    c = params.config
    sq = {n: np.square(np.asarray(x, np.float64)) for n, x in params.arrays().items()}
    x_sq = {n: np.square(np.asarray(getattr(inputs, n), np.float64)) for n in ("query", "key", "value")}

    # the q/k norm's terms: each normed entry is the projection's entry (a LayerNorm's less the mean, a difference:
    # its squares add the mean's, mean(y^2) / n) times 1/rms times the gain (the mean of squares, a sum of positive
    # terms, cancels nothing); its backward d_x = inv * (u - x_hat * mean(u * x_hat)), a LayerNorm's u less mean(u).
    # x_hat's terms are those of the difference, not its value: where the entries equal their mean (one feature
    # per head), x_hat is 0 but a kernel's y - mean(y) (or torch's sum(dy * y) - mean * sum(dy)) rounds at the
    # size of y, times 1/sqrt(eps)
    normed = {}
    centred = c.qk_norm in QK_NORMS_CENTRED

    def mean_terms(a, n):  # the squares of a's terms plus, for a LayerNorm, those of its mean's
        return a + a.sum(axis=-1, keepdims=True) / n ** 2 if centred else a

    for which, n_heads in (("q", c.num_heads), ("k", c.kv_heads)):
        if c.qk_norm is not None:
            x = np.asarray(getattr(inputs, {"q": "query", "k": "key"}[which]), np.float64)
            raw = _norm_groups(_project(x, getattr(params, f"W_{which}"), getattr(params, f"b_{which}"), "float64",
                                        exact=False),
                               c, n_heads)
            inv_sq = np.square(_rms_inverse(_centred(raw, c), c.qk_norm_eps))
            normed[which] = (raw.shape, inv_sq, mean_terms(np.square(raw), raw.shape[-1]) * inv_sq,
                             sq[f"g_{which}"])

    def projected(name, n_heads):
        y = x_sq[name] @ sq[f"W_{name[0]}"]
        if c.bias:
            y = y + sq[f"b_{name[0]}"]
        if name[0] in normed:
            shape, inv_sq, _, gain_sq = normed[name[0]]
            y = mean_terms(y.reshape(shape), shape[-1]) * inv_sq * gain_sq
            if f"beta_{name[0]}" in sq:  # a LayerNorm's bias: one more term
                y = y + sq[f"beta_{name[0]}"]
            y = y.reshape(x_sq[name].shape[:2] + (-1,))
        return _heads(y, n_heads)

    def through_norm(which, d_proj):  # squares of d_proj's terms -> squares of the projection's, the gain's, the bias'
        shape, inv_sq, x_hat_sq, gain_sq = normed[which]
        d = d_proj.reshape(shape)
        n = shape[-1]
        u = mean_terms(gain_sq * d, n)
        d_x = inv_sq * (u + x_hat_sq * (u * x_hat_sq).sum(axis=-1, keepdims=True) / n ** 2)
        groups = tuple(range(d.ndim - 1))
        return d_x.reshape(d_proj.shape), (d * x_hat_sq).sum(axis=groups), d.sum(axis=groups)
    q_pos, k_pos = _call_positions(inputs)
    q = _rotated_squares(projected("query", c.num_heads), q_pos, c)
    k = np.repeat(_rotated_squares(projected("key", c.kv_heads), k_pos, c), c.group, axis=1)
    v = np.repeat(projected("value", c.kv_heads), c.group, axis=1)
    q_exact, k_exact, _, p, _, scale, allowed = _forward_parts(params, inputs, None, "float64")
    p2, scale2 = np.square(p), scale ** 2
    g = np.square(np.asarray(cotangent, np.float64))
    heads = p2 @ v
    b, h, t, dh = heads.shape
    concat = heads.transpose(0, 2, 1, 3).reshape(b, t, h * dh)
    grads = {"W_o": np.einsum("btd,bte->de", concat, g)}
    d_o = _heads(g @ sq["W_o"].T, c.num_heads)
    d_p = d_o @ v.transpose(0, 1, 3, 2)
    held = _held_rows(allowed, p.shape)
    if held is not None:
        d_p = np.where(held, 0.0, d_p)
    d_v = p2.transpose(0, 1, 3, 2) @ d_o
    d_s = p2 * (d_p + (d_p * p2).sum(axis=-1, keepdims=True))
    slope = _softcap_slope(q_exact, k_exact, scale)
    if slope is not None:
        d_s = d_s * np.square(slope)
    d_q = _rotated_squares(d_s @ k * scale2, q_pos, c)
    d_k = _rotated_squares(d_s.transpose(0, 1, 3, 2) @ q * scale2, k_pos, c)

    for name, d_heads, n in (("query", d_q, c.num_heads), ("key", d_k, c.kv_heads), ("value", d_v, c.kv_heads)):
        d_proj = _merge_heads(d_heads, n)
        if name[0] in normed:
            d_proj, grads[f"g_{name[0]}"], d_bias = through_norm(name[0], d_proj)
            if c.qk_norm in QK_NORMS_WITH_BIAS:
                grads[f"beta_{name[0]}"] = d_bias
        grads[f"W_{name[0]}"] = np.einsum("btd,bte->de", x_sq[name], d_proj)
        grads[name] = d_proj @ sq[f"W_{name[0]}"].T
        if c.bias:
            grads[f"b_{name[0]}"] = d_proj.sum(axis=(0, 1))
    if c.bias:
        grads["b_o"] = g.sum(axis=(0, 1))
    return {name: np.sqrt(grad) for name, grad in grads.items()}


def _row_lse(scores: np.ndarray, allowed: np.ndarray, r=lambda x: x):
    """The scores with disallowed ones set to -inf, each row's log-sum-exp over its allowed scores (0 in a row with
    none) and which rows have a visible key, rounding after each stage with ``r``."""
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    visible = np.isfinite(row_max)
    shifted = r(scores - np.where(visible, row_max, 0.0))
    total = r(np.where(allowed, np.exp(shifted), 0.0).sum(axis=-1, keepdims=True))
    lse = r(np.where(visible, row_max, 0.0) + np.log(np.where(total > 0, total, 1.0)))
    return scores, lse, visible


def _flash_weights(params: AttentionParams, inputs: AttentionInputs, q, k, scale, dtype: str,
                   score_error_of: str | None = None, sign: int = 1) -> np.ndarray:
    """The softmax weights as a FlashAttention backward recomputes them, rounding in ``dtype``: scores again (the
    queries scaled first), then ``exp(s - logsumexp)`` from the row's log-sum-exp (rows with no visible key: as
    :func:`empty_rows_convention` says, like the forward's). ``score_error_of``: the exponent ``s - lse`` carries
    that dtype's rounding: per entry two unit roundoffs at the size of ``s``'s dot-product terms and one at
    ``|mask| + |lse|``, per row one at ``|lse|``; ``sign`` -1: all of it the other way."""
    r = lambda x: round_to(x, dtype)  # noqa: E731
    scores, allowed, additive = _scores(params, inputs, None, q, k, scale, dtype, scale_first=True)
    allowed = np.broadcast_to(allowed, scores.shape)
    scores, lse, visible = _row_lse(scores, allowed, r)
    exponent = r(scores - lse)
    if score_error_of is not None:
        # per entry: the score's (two roundings of its dot product's terms, one of s + mask) and one rounding of
        # s - lse at the size of its operands; per row: the stored lse's own rounding, which every weight of the
        # row shares (the row's weights then no longer sum to 1)
        row = np.abs(np.where(visible, lse, 0.0))
        size = 2 * _score_terms(q, k, scale) + row
        if additive is not None:
            size = size + np.abs(additive)
        exponent = exponent + sign * (_rounding_error(np.broadcast_to(size, exponent.shape), score_error_of, None)
                                      + _rounding_error(row, score_error_of, None))
    empty = _empty_row_weight(empty_rows_convention(), scores.shape[-1])
    return np.where(visible, np.where(allowed, r(np.exp(exponent)), 0.0), empty)


#: the fields of :class:`AttentionInputs` that mask keys, which a wrong backward can leave out
MASK_FIELDS = ("causal", "key_padding_mask", "attn_mask")
#: the layer's own mask (``AttentionConfig.sliding_window``), which a wrong backward can leave out too
WINDOW_FIELD = "sliding_window"


def without_masks(params: AttentionParams, inputs: AttentionInputs, fields: tuple[str, ...]):
    """(params, inputs) with the masks named by ``fields`` left out: call fields (:data:`MASK_FIELDS`) set to None,
    and :data:`WINDOW_FIELD` the layer's sliding window."""
    if WINDOW_FIELD in fields:
        params = params.replace(config=dataclasses.replace(params.config, sliding_window=None))
    return params, inputs.replace(**dict.fromkeys(f for f in fields if f != WINDOW_FIELD))


def mistaken_vjp(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray, *, row_term: bool = True,
                 recomputed_without: tuple[str, ...] = (), recompute: str = "softmax",
                 row_from: str = "weights", kv_swapped: bool = False,
                 rotary_turned_forward: bool = False) -> dict[str, np.ndarray]:
    """A known wrong backward of the correct forward, in float64, for diagnoses. ``row_term=False``: the softmax's
    backward taken as ``dS = P * dP``, its row term left out (each weight differentiated as if it depended on its
    own score alone). ``recomputed_without``: the backward recomputes the weights without these masks
    (:data:`MASK_FIELDS`, and :data:`WINDOW_FIELD` for the layer's sliding window) while the forward applied them
    (its output, and so W_o's gradient, stays right): ``recompute="softmax"``, a softmax without them; ``"lse"``, as
    FlashAttention-2 recomputes, ``exp(s - lse)`` with the forward's (masked) log-sum-exp, the dropped masks' keys no
    longer zeroed. ``recompute="max"`` (with every mask): the weights recomputed as ``exp(s - m)`` with the row
    maximum where the log-sum-exp belongs (a tiled forward that saves its running maximum without ``+ log(rowsum)``):
    unnormalised. ``row_from``: the row term as ``rowsum(dP * P)`` of the weights the backward has (``"weights"``) or
    as FlashAttention-2 takes it, ``rowsum(dO * O)`` of the forward's output (``"output"``). ``kv_swapped``: the
    heads' dK returned as dV and dV as dK (a custom backward's results in the wrong order), each then projected as
    the other's.
    ``rotary_turned_forward``: the gradients of a rotary layer's q and k turned by the forward's angles again where
    the backward turns them back (a hand-written rotary backward that reuses the forward's sin)."""
    for field in recomputed_without:
        if field not in (*MASK_FIELDS, WINDOW_FIELD):
            raise ValueError(f"recomputed_without: got {field!r}; accepted: {', '.join((*MASK_FIELDS, WINDOW_FIELD))}")
    if recompute not in ("softmax", "lse", "max"):
        raise ValueError(f"recompute: got {recompute!r}; accepted: softmax, lse, max")
    if row_from not in ("weights", "output"):
        raise ValueError(f"row_from: got {row_from!r}; accepted: weights, output")
    cotangent = np.asarray(cotangent)

    def compute():
        with np.errstate(invalid="ignore", over="ignore"):  # a mistake's NaN (0 / 0 recomputed) is its point
            grads = _mistaken_vjp(params, inputs, cotangent, row_term, tuple(recomputed_without), recompute,
                                  row_from, kv_swapped, rotary_turned_forward)
        _read_only(*grads.values())
        return grads

    key = _content_key("vjp-mistaken", params, inputs, cotangent, empty_rows_convention(), row_term,
                       tuple(recomputed_without), recompute, row_from, kv_swapped, rotary_turned_forward)
    grads = _CACHE.get(key, compute, lambda g: sum(a.nbytes for a in g.values()))
    return {name: grad.copy() for name, grad in grads.items()}


def _mistaken_vjp(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray, row_term: bool,
                  without: tuple[str, ...], recompute: str, row_from: str, kv_swapped: bool,
                  rotary_turned_forward: bool = False) -> dict:
    """:func:`mistaken_vjp`'s backward, in float64."""
    c = params.config
    q, k, v, p, concat, scale, allowed = _forward_parts(params, inputs, None, "float64")
    d_o = _heads(cotangent @ params.W_o.T, c.num_heads)
    d_p = d_o @ v.transpose(0, 1, 3, 2)
    if recompute == "max":  # exp(s - m): the row maximum saved where the log-sum-exp belongs
        scores, allowed = _scores(params, inputs, None, q, k, scale, "float64", False)[:2]
        masked, _, visible = _row_lse(scores, np.broadcast_to(allowed, scores.shape))
        top = np.where(visible, masked.max(axis=-1, keepdims=True), 0.0)
        p = np.where(np.isfinite(masked), np.exp(masked - top), 0.0)
    elif without and recompute == "softmax":
        p = _forward_parts(*without_masks(params, inputs, without), None, "float64")[3]
    elif without:  # exp(s - lse): the forward's lse, the scores without the dropped masks' -inf or bias
        scores, allowed = _scores(params, inputs, None, q, k, scale, "float64", False)[:2]
        _, lse, visible = _row_lse(scores, np.broadcast_to(allowed, scores.shape))
        loose, kept = _scores(*without_masks(params, inputs, without), None, q, k, scale, "float64", False)[:2]
        with np.errstate(over="ignore"):
            p = np.where(visible & np.broadcast_to(kept, loose.shape), np.exp(loose - lse), 0.0)
    row = (d_o * _heads(concat, c.num_heads)).sum(axis=-1, keepdims=True) if row_from == "output" \
        else (d_p * p).sum(axis=-1, keepdims=True)
    return _vjp_from_weights(params, inputs, cotangent, q, k, v, p, concat, scale, d_o, d_p,
                             row if row_term else 0.0, lambda x: x, swap_kv=kv_swapped,
                             rotary_back=not rotary_turned_forward)


def _vjp(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray, dtype: str,
         flash: bool = False, score_error_of: str | None = None, projection_error_of: str | None = None,
         sign: int = 1) -> dict:
    """The backward, rounding after every stage in ``dtype``. ``flash``: as FlashAttention-2 computes it (and
    torch's SDPA kernels and nn.MultiheadAttention's fused path do): the queries scaled first, the weights
    recomputed from the row's log-sum-exp, and the softmax backward's row term taken as ``rowsum(dO * O)`` instead
    of ``rowsum(dP * P)`` (equal in exact arithmetic, not after rounding). ``score_error_of``,
    ``projection_error_of``, ``sign``: as :func:`reference_vjp`'s ``score_error_of``, ``projection_error_of``,
    ``score_error_sign``."""
    c = params.config
    r = lambda x: round_to(x, dtype)  # noqa: E731
    projection_error_of = projection_error_of or score_error_of
    q, k, v, p, concat, scale, allowed = _forward_parts(params, inputs, None, dtype, scale_first=flash,
                                                        score_error_of=None if flash else score_error_of,
                                                        projection_error_of=projection_error_of, sign=sign)
    g = r(cotangent)
    d_o = _heads(r(g @ r(params.W_o).T), c.num_heads)
    d_p = r(d_o @ v.transpose(0, 1, 3, 2))
    if flash:
        p = _flash_weights(params, inputs, q, k, scale, dtype, score_error_of, sign)
        row = r(r(d_o * _heads(concat, c.num_heads)).sum(axis=-1, keepdims=True))
    else:
        row = r((d_p * p).sum(axis=-1, keepdims=True))
    held = _held_rows(allowed, p.shape)
    if held is not None:  # dS = P * (dP - row) = 0 on rows whose scores the layer replaced by a constant
        d_p, row = np.where(held, 0.0, d_p), np.where(held, 0.0, row)
    return _vjp_from_weights(params, inputs, g, q, k, v, p, concat, scale, d_o, d_p, row, r, one_pass=flash,
                             projection_error_of=projection_error_of, dtype=dtype)


# NaN weights (the "nan" empty-row convention a diagnosis tries) and NaN poison spread through these products by
# design: the verdict reads the values, and numpy's warnings printed from the reference looked like a harness fault
@np.errstate(invalid="ignore", over="ignore")
def _vjp_from_weights(params: AttentionParams, inputs: AttentionInputs, g, q, k, v, p, concat, scale, d_o, d_p,
                      row, r, swap_kv: bool = False, one_pass: bool = False,
                      projection_error_of: str | None = None, dtype: str = "float64", rotary_back: bool = True) -> dict:
    """The backward from the softmax weights ``p`` and its row term ``row`` on: dV, dS = P * (dP - row), dQ, dK,
    then through the projections to the inputs and parameters; ``r`` rounds after every stage. ``swap_kv``: the
    heads' dK and dV exchanged before the projections (a diagnosis' wrong backward). ``one_pass``: a LayerNorm's
    variance in one pass (:func:`_norm_parts`), as the forward's fused algorithm takes it. ``projection_error_of``:
    the q and k projections carry that dtype's rounding (:func:`_projection_error`), as in the forward. ``dtype``:
    the one ``r`` rounds to (the rotary tables' and the gradients' turn back in it). ``rotary_back=False``: q's and
    k's gradients turned by the forward's angles again, not back (a diagnosis' wrong backward)."""
    c = params.config
    if _ROTARY_MISTAKE.get() == "before_norm":
        raise ValueError("rotary_mistaken('before_norm') has a forward only; accepted in a backward: None, "
                         + ", ".join(repr(m) for m in ROTARY_MISTAKES if m != "before_norm"))
    if _QK_NORM_AS.get() is not None:
        raise ValueError(f"qk_norm_mistaken({_qk_norm_mistake_name()!r}) has a forward only; accepted in a backward: "
                         "the layer's own q/k norm (no qk_norm_mistaken block)")
    grads = {"W_o": r(np.einsum("btd,bte->de", concat, g))}
    d_v = r(p.transpose(0, 1, 3, 2) @ d_o)
    d_s = r(p * r(d_p - row))
    slope = _softcap_slope(q, k, scale)
    if slope is not None:
        d_s = r(d_s * slope)
    d_q = r(d_s @ k * scale)
    d_k = r(d_s.transpose(0, 1, 3, 2) @ q * scale)
    if c.rotary is not None:  # turned back: the rotation's transpose
        q_pos, k_pos = _call_positions(inputs)
        d_q = rotated(d_q, q_pos, c, dtype, "q", inverse=rotary_back)
        d_k = rotated(d_k, k_pos, c, dtype, "k", inverse=rotary_back)
    if swap_kv:
        d_k, d_v = d_v, d_k

    for name, d_heads, x, n in (("q", d_q, inputs.query, c.num_heads), ("k", d_k, inputs.key, c.kv_heads),
                                ("v", d_v, inputs.value, c.kv_heads)):
        d_proj = r(_merge_heads(d_heads, n))
        if c.qk_norm is not None and name != "v":  # back through the norm to the projection, and to its gain
            w, bias = r(getattr(params, f"W_{name}")), getattr(params, f"b_{name}")
            y = r(r(x) @ w + (0.0 if bias is None else r(bias)))
            if projection_error_of is not None:
                y = y + _projection_error(np.asarray(x, np.float64), params, name, projection_error_of, None)
            d_proj, grads[f"g_{name}"], d_bias = _qk_norm_vjp(y, getattr(params, f"g_{name}"), d_proj, c, n, r,
                                                              one_pass, projection_error_of, name)
            if c.qk_norm in QK_NORMS_WITH_BIAS:
                grads[f"beta_{name}"] = d_bias
        grads[f"W_{name}"] = r(np.einsum("btd,bte->de", r(x), d_proj))
        grads[{"q": "query", "k": "key", "v": "value"}[name]] = r(d_proj @ r(getattr(params, f"W_{name}")).T)
        if c.bias:
            grads[f"b_{name}"] = r(d_proj.sum(axis=(0, 1)))
    if c.bias:
        grads["b_o"] = r(g.sum(axis=(0, 1)))
    return {name: grad.astype(np.float64) for name, grad in grads.items()}
