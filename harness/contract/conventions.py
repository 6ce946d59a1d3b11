"""The harness's conventions, each stated once: floating-point formats, causal alignments and their offset,
mask polarities and parameter names. Every other module (reference, masks, backends, cases) imports them from here.

NumPy has no bfloat16, so it is emulated by rounding float32 to 8 mantissa bits
(round-to-nearest-even), which is exactly what a bfloat16 store does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# --- floating-point formats -------------------------------------------------------------------------------------

#: every dtype a backend may declare, and its machine epsilon (the spacing of numbers just above 1)
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
DTYPES = tuple(EPS)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round ``x`` to ``dtype``'s precision, returned in the NumPy dtype used to compute in it."""
    if dtype == "float64":
        return np.asarray(x, np.float64)
    if dtype == "float32":
        return np.asarray(x, np.float32)
    if dtype == "float16":
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        f = np.ascontiguousarray(x, dtype=np.float32)
        bits = f.view(np.uint32)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        out = ((bits + rounding) & np.uint32(0xFFFF0000)).view(np.float32)
        return np.where(np.isfinite(f), out, f)
    raise ValueError(f"dtype: got {dtype!r}; accepted: {', '.join(DTYPES)}")


# --- causal masks ----------------------------------------------------------------------------------------------

#: query i sees keys j <= i
TOP_LEFT = "top-left"
#: query i sees keys j <= i + Tk - Tq (the KV-cache convention: the last query sees the last key)
BOTTOM_RIGHT = "bottom-right"
CAUSAL_ALIGNMENTS = (TOP_LEFT, BOTTOM_RIGHT)


def causal_offset(alignment: str, tq: int, tk: int) -> int:
    """The causal mask's diagonal: query i may attend to key j exactly when ``j <= i + causal_offset(...)``."""
    if alignment == TOP_LEFT:
        return 0
    if alignment == BOTTOM_RIGHT:
        return tk - tq
    raise ValueError(f"causal: got {alignment!r}; accepted: {', '.join(map(repr, CAUSAL_ALIGNMENTS))}")


def window_offset(alignment: str | None, tq: int, tk: int) -> int:
    """The sliding window's diagonal: query i is at position ``i + window_offset(...)`` and, in a layer with
    ``AttentionConfig.sliding_window = w``, sees key j only when ``j > i + window_offset(...) - w`` (its own position
    and the w - 1 before it, as Mistral's and Gemma's ``sliding_window`` and transformers' ``kv_idx > q_idx -
    sliding_window``). The diagonal is the causal mask's (:func:`causal_offset`) in a causal call and bottom-right
    without one (the queries are the last Tq of the Tk positions, flash-attn's ``window_size=(w - 1, -1)``)."""
    return causal_offset(alignment, tq, tk) if alignment else tk - tq


def window_allows(window: int | None, alignment: str | None, tq: int, tk: int, q_idx=None,
                  k_idx=None) -> np.ndarray | None:
    """(R, K) bool, True where the sliding window of ``window`` keys lets query ``q_idx`` (all Tq when None) see key
    ``k_idx`` (all Tk when None; a tiled kernel's block of keys) (:func:`window_offset`); None without a window."""
    if window is None:
        return None
    q = np.arange(tq) if q_idx is None else np.asarray(q_idx)
    k = np.arange(tk) if k_idx is None else np.asarray(k_idx)
    return k[None, :] > q[:, None] + window_offset(alignment, tq, tk) - window


def other_alignment(alignment: str) -> str:
    """The alignment that is not ``alignment`` (what a backend that confuses the two computes)."""
    return BOTTOM_RIGHT if alignment == TOP_LEFT else TOP_LEFT


# --- input forms ----------------------------------------------------------------------------------------------

#: how a backend takes its inputs (``Capabilities.inputs``): three arrays, x_q plus one x_kv, one x, or a KV-cache
#: call: x_new plus one x_kv whose last Tq rows are x_new (the earlier rows are the cached positions' input)
INPUT_FORMS = ("separate", "shared_kv", "self", "kv_cache")
#: the forms of AttentionInputs a backend of each declared form accepts: one x is also a KV-cache call with nothing
#: cached, a KV-cache call is also a valid (x_q, x_kv) pair, and each is a valid (query, key, value) triple, never
#: the other way round
ACCEPTED_FORMS = {"separate": INPUT_FORMS, "shared_kv": ("shared_kv", "self", "kv_cache"), "self": ("self",),
                  "kv_cache": ("kv_cache", "self")}
#: the forms whose queries are rows of the key/value input: perturbing a key position moves its query too
COUPLED_FORMS = ("self", "kv_cache")

# --- mask polarities -------------------------------------------------------------------------------------------

#: a boolean attn_mask: True = the query may attend to the key (a float attn_mask is added to the scaled scores)
ATTN_MASK_POLARITY = "True = may attend"
#: key_padding_mask (batch, Tk): True marks a padding key that no query may attend to
KEY_PADDING_POLARITY = "True = padding key to ignore"
#: the short form shown in the policy table for a backend whose own API uses the harness's polarities
MASK_POLARITY = "harness convention (attn_mask True = attend; key_padding_mask True = ignore)"

# --- parameter names -------------------------------------------------------------------------------------------

#: weights in the x @ W convention: W_q, W_o (d_model, d_model); W_k, W_v (d_model, num_kv_heads * d_head)
WEIGHT_NAMES = ("W_q", "W_k", "W_v", "W_o")
BIAS_NAMES = ("b_q", "b_k", "b_v", "b_o")
#: the gains of the q and k norms (:data:`QK_NORMS`): (d_head,) each for a norm per head; (d_model,) and
#: (num_kv_heads * d_head,) for ``rms_over_projection``
NORM_NAMES = ("g_q", "g_k")
#: the biases (shifts) of the q and k LayerNorms that have them (:data:`QK_NORMS_WITH_BIAS`): (d_head,) each
NORM_BIAS_NAMES = ("beta_q", "beta_k")
PARAM_NAMES = WEIGHT_NAMES + BIAS_NAMES + NORM_NAMES + NORM_BIAS_NAMES

# --- q/k norms -------------------------------------------------------------------------------------------------

#: ``AttentionConfig.qk_norm``: a norm of q and of k after their projection (and bias), before the scores. An RMSNorm,
#: ``y / sqrt(mean(y^2) + eps) * g``, over each head's d_head features with one gain vector shared by all heads
#: (``rms_per_head``: Qwen 3, Gemma 3), or over the whole q and k projections (``rms_over_projection``: OLMo 2); or a
#: LayerNorm, ``(y - mean(y)) / sqrt(var(y) + eps) * g + beta`` (the biased variance), over each head's d_head
#: features with one gain vector and one bias vector shared by all heads (``layer_per_head``: timm's
#: ``Attention(qk_norm=True)``, torch's ``nn.LayerNorm(d_head)``), or without the bias
#: (``layer_per_head_no_bias``: ViT-22B, flax's ``MultiHeadDotProductAttention(normalize_qk=True)``)
QK_NORMS = ("rms_per_head", "rms_over_projection", "layer_per_head", "layer_per_head_no_bias")
#: the norms of :data:`QK_NORMS` taken over each head's d_head features (the others: over the whole projection)
QK_NORMS_PER_HEAD = ("rms_per_head", "layer_per_head", "layer_per_head_no_bias")
#: the norms of :data:`QK_NORMS` that subtract the mean before dividing (LayerNorms; the others are RMSNorms)
QK_NORMS_CENTRED = ("layer_per_head", "layer_per_head_no_bias")
#: the norms of :data:`QK_NORMS` that add a bias (``beta_q``, ``beta_k``) after the gain
QK_NORMS_WITH_BIAS = ("layer_per_head",)

# --- rotary position embeddings -------------------------------------------------------------------------------

#: ``AttentionConfig.rotary``: rotary position embeddings (RoPE) applied to each head of q and of k after their
#: projection (and after the q/k norm), before the scores: each pair of features (x_a, x_b) at position p is rotated
#: by the angle p * base^(-2i / r) of its frequency i (i = 0 .. r/2 - 1), where r is the number of each head's
#: leading features turned (``AttentionConfig.rotary_dims``; d_head unless the rotary is partial, as GPT-NeoX's
#: ``rotary_pct``, Phi's ``partial_rotary_factor`` and GPT-J's ``rotary_dim`` make it; the other d_head - r features
#: pass unturned): (x_a cos - x_b sin, x_b cos + x_a sin). ``half_split`` pairs feature i with feature i + r/2
#: (GPT-NeoX, Hugging Face's ``rotate_half``: Llama, Mistral, Qwen in transformers); ``interleaved`` pairs features
#: 2i and 2i + 1 (GPT-J, Meta's original Llama code with complex numbers, ``torchtune``'s
#: RotaryPositionalEmbeddings)
ROTARY_KINDS = ("half_split", "interleaved")
#: the frequency bases of common models (``AttentionConfig.rotary_base``): 10,000 (Llama 1 and 2, GPT-NeoX,
#: Mistral 7B v0.1), 500,000 (Llama 3), 1,000,000 (Qwen 2 and 3, Mistral 7B v0.2, Code Llama)
COMMON_ROTARY_BASES = (10_000.0, 500_000.0, 1_000_000.0)
#: the base a layer's rotary embeddings have unless it says otherwise (the original RoFormer's and Llama 2's)
DEFAULT_ROTARY_BASE = 10_000.0
#: the epsilon a layer's q/k norm adds unless it says otherwise (Qwen 3's and flax's 1e-6)
DEFAULT_QK_NORM_EPS = 1e-6


def rotary_positions(tq: int, tk: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions rotary embeddings use in a call of Tq queries and Tk keys: key j at position j, query i at
    position i + Tk - Tq (the queries are the last Tq positions, as in a KV-cache step: the causal mask's
    bottom-right alignment; at Tq = Tk both are 0 .. T - 1). Returns (query positions, key positions), int64."""
    return np.arange(tq, dtype=np.int64) + (tk - tq), np.arange(tk, dtype=np.int64)


def rotary_pairs(kind: str, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The feature indices ``(a, b)`` of each rotated pair of frequency i (``a[i]``, ``b[i]``) under ``kind``, among
    a head's first ``width`` features (d_head, or a partial rotary's ``rotary_dims``)."""
    half = np.arange(width // 2)
    if kind == "half_split":
        return half, half + width // 2
    if kind == "interleaved":
        return 2 * half, 2 * half + 1
    raise ValueError(f"rotary: got {kind!r}; accepted: {', '.join(map(repr, ROTARY_KINDS))}")


#: ``RotaryScaling.kind``: how a long-context model rescales its rotary frequencies. ``linear``: every frequency
#: divided by the factor (position interpolation; transformers' ``rope_type="linear"``); ``llama3``: Llama 3.1's
#: (``rope_type="llama3"``), frequencies whose wavelength is longer than ``original_max_positions /
#: low_freq_factor`` divided by the factor, those shorter than ``original_max_positions / high_freq_factor`` kept, and
#: those between blended smoothly; ``yarn``: YaRN's (``rope_type="yarn"``: Qwen 2.5's long context, gpt-oss,
#: DeepSeek-V3), the frequencies that turn fewer than ``beta_slow`` times over ``original_max_positions`` divided by
#: the factor, those that turn more than ``beta_fast`` times kept, a linear ramp between them over the frequency
#: index, and q and k scaled by the attention factor (their cos and sin multiplied by it)
ROTARY_SCALING_KINDS = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RotaryScaling:
    """A rescaling of the rotary frequencies (``AttentionConfig.rotary_scaling``), as transformers' ``rope_parameters``
    hold it; the defaults are Llama 3.1's (``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``). ``linear`` uses ``factor`` only;
    ``yarn`` uses ``factor``, ``original_max_positions``, ``beta_fast`` and ``beta_slow`` (transformers' defaults 32
    and 1), ``attention_factor`` (None: transformers' default, ``0.1 * ln(factor) + 1``; DeepSeek's ``mscale`` /
    ``mscale_all_dim`` give their ratio, pass it here) and ``truncate`` (the ramp's ends rounded to whole indices;
    gpt-oss sets ``"truncate": false``). It does not depend on the call's length (dynamic NTK is not among the
    kinds)."""

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ROTARY_SCALING_KINDS:
            raise ValueError(f"RotaryScaling.kind: got {self.kind!r}; accepted: "
                             f"{', '.join(map(repr, ROTARY_SCALING_KINDS))}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"RotaryScaling.{name}: got {value!r}; accepted: a finite number > 0 "
                                 "(Llama 3.1's: factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0)")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"RotaryScaling.high_freq_factor: got {self.high_freq_factor!r} with low_freq_factor "
                             f"{self.low_freq_factor!r}; accepted: a number above low_freq_factor (Llama 3.1's: 4.0 "
                             "and 1.0)")
        n = self.original_max_positions
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"RotaryScaling.original_max_positions: got {n!r}; accepted: an integer >= 1, the "
                             "context length the model was trained at before scaling (Llama 3.1's: 8192)")
        for name in ("beta_fast", "beta_slow") + (("attention_factor",) if self.attention_factor is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"RotaryScaling.{name}: got {value!r}; accepted: a finite number > 0"
                                 + (" or None (0.1 * ln(factor) + 1)" if name == "attention_factor" else
                                    " (YaRN's defaults: beta_fast 32, beta_slow 1)"))
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"RotaryScaling.beta_fast: got {self.beta_fast!r} with beta_slow {self.beta_slow!r}; "
                             "accepted: a number above beta_slow (YaRN's defaults: 32 and 1)")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"RotaryScaling.truncate: got {self.truncate!r}; accepted: True or False")

    @property
    def attention_scale(self) -> float:
        """What q and k are multiplied by with their rotation (the rotary tables' cos and sin are): YaRN's attention
        factor (``attention_factor``, or ``0.1 * ln(factor) + 1`` for a factor above 1), 1 for the other kinds."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def yarn_ramp(self, width: int, base: float) -> tuple[float, float]:
        """YaRN's correction range (low, high) of frequency indices for ``width`` features turned at ``base``: the
        index whose frequency turns ``beta_fast`` times over ``original_max_positions`` and the one turning
        ``beta_slow`` times (rounded outwards to whole indices when ``truncate``), clipped to 0 .. width - 1."""
        def index(turns):
            return width * math.log(self.original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(base))
        low, high = index(self.beta_fast), index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, width - 1)

    def frequencies(self, inv_freq: np.ndarray, base: float = 10_000.0) -> np.ndarray:
        """The rescaled frequencies (radians per position) of the unscaled ``inv_freq``, ``base ** (-2i / r)`` for
        i = 0 .. r/2 - 1 (``base``: YaRN's ramp depends on it and on r)."""
        inv_freq = np.asarray(inv_freq, np.float64)
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "yarn":
            low, high = self.yarn_ramp(2 * len(inv_freq), base)
            ramp = np.clip((np.arange(len(inv_freq)) - low) / ((high + 0.001 if high == low else high) - low), 0, 1)
            return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)
        wavelength = 2 * np.pi / inv_freq
        low_wavelength = self.original_max_positions / self.low_freq_factor
        high_wavelength = self.original_max_positions / self.high_freq_factor
        smooth = (self.original_max_positions / wavelength - self.low_freq_factor) \
            / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return np.where(wavelength > low_wavelength, inv_freq / self.factor,
                        np.where(wavelength < high_wavelength, inv_freq, blended))


#: the scalings the cases and search build (``Capabilities.rotary_scalings`` declares the kinds): Llama 3.1's, a
#: linear position interpolation by 4 (Vicuna 16k's) and Qwen 2.5's YaRN (factor 4 over 32,768 positions)
COMMON_ROTARY_SCALINGS = {"llama3": RotaryScaling(), "linear": RotaryScaling("linear", 4.0),
                          "yarn": RotaryScaling("yarn", 4.0, original_max_positions=32_768)}


# --- ALiBi: linear biases by distance ----------------------------------------------------------------------------

#: how an ALiBi layer (``AttentionConfig.alibi``) biases the score of query position p and key position s, per head h
#: with slope m_h (:func:`alibi_slopes`): ``"symmetric"``, ``-m_h * |p - s|`` (flash-attn's ``alibi_slopes``, MPT's
#: bidirectional layers, xformers); ``"linear"``, ``-m_h * (p - s)``, the ALiBi paper's causal form written for
#: every key (BLOOM's ``m_h * s``, which differs from it by a constant per row, gives the same softmax). The two agree
#: on every key at or before the query's position, so they differ only where a later key is visible.
ALIBI_KINDS = ("symmetric", "linear")


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's head slopes (float64, one per head): for n heads a power of two, ``2 ** (-8 h / n)`` for h =
    1 .. n; otherwise those of the largest power of two m below n, then every other slope of 2m's (the even-indexed:
    the first, third, ...) for the n - m heads left, as the paper's code, BLOOM's ``build_alibi_tensor`` and
    flash-attn's tests compute them (8 heads: 1/2 .. 1/256; 6 heads: 1/4, 1/16, 1/64, 1/256, 1/2, 1/8)."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads: got {num_heads!r}; accepted: an integer >= 1")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    m = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(m) + power_of_two(2 * m)[0::2][:num_heads - m]
    return np.asarray(slopes, dtype=np.float64)


def alibi_bias(kind: str, num_heads: int, tq: int, tk: int, q_idx=None) -> np.ndarray:
    """The ALiBi bias (float64, shape (num_heads, R, Tk)) added to each head's scaled scores of a call with Tq
    queries and Tk keys, at query rows ``q_idx`` (all Tq when None): query i at position i + Tk - Tq and key j at j
    (:func:`rotary_positions`: the queries are the last Tq positions, as in a KV-cache step and flash-attn's
    bottom-right ``alibi_slopes``), biased by ``kind`` (:data:`ALIBI_KINDS`) with :func:`alibi_slopes`."""
    if kind not in ALIBI_KINDS:
        raise ValueError(f"alibi: got {kind!r}; accepted: {', '.join(map(repr, ALIBI_KINDS))}")
    q_pos, k_pos = rotary_positions(tq, tk)
    if q_idx is not None:
        q_pos = q_pos[np.asarray(q_idx)]
    return alibi_bias_from(kind, alibi_slopes(num_heads), q_pos, k_pos)


def alibi_bias_from(kind: str, slopes, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """The bias of ``kind`` (float64, (len(slopes), len(q_pos), len(k_pos))) with any slopes and positions:
    ``-m_h * |p - s|`` ("symmetric") or ``-m_h * (p - s)`` ("linear"); :func:`alibi_bias` gives it the paper's
    slopes and the call's positions, a diagnosis or a mutant wrong ones."""
    distance = (np.asarray(q_pos)[:, None] - np.asarray(k_pos)[None, :]).astype(np.float64)
    if kind == "symmetric":
        distance = np.abs(distance)
    return -np.asarray(slopes, np.float64)[:, None, None] * distance[None]
