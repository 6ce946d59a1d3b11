"""The plugin API: what a backend declares and what it must do.

A backend is a factory (:class:`AttentionBackend`) that declares its capabilities as
data and, given canonical parameters, loads them into its own native form
(:class:`LoadedAttention`). Everything framework-specific lives behind these two
classes; the harness and the cases only ever see NumPy arrays.

Conventions (stated in :mod:`mha_harness.contract.conventions`, pinned by the float64 reference in
:mod:`mha_harness.contract.reference`):

* weights use the ``x @ W`` convention: ``W_q`` is (d_model, d_model), ``W_k`` and
  ``W_v`` are (d_model, num_kv_heads * d_head), ``W_o`` is (d_model, d_model);
* query head ``n`` uses key/value head ``n // (num_heads // num_kv_heads)``;
* ``attn_mask`` boolean: True means *may attend*; float: added to the scaled scores;
* ``key_padding_mask`` boolean (batch, Tk): True marks a *padding* key to ignore;
* ``causal`` is None, ``"top-left"`` (query i sees keys j <= i) or ``"bottom-right"``
  (query i sees keys j <= i + Tk - Tq, the KV-cache convention);
* a query row with no key it may attend to outputs zeros before W_o (so the output
  row equals the bias of W_o), the flash-attention / torch SDPA >= 2.5 convention.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mha_harness.contract.conventions import (
    ACCEPTED_FORMS,
    ALIBI_KINDS,
    BOTTOM_RIGHT,
    CAUSAL_ALIGNMENTS,
    DEFAULT_QK_NORM_EPS,
    DEFAULT_ROTARY_BASE,
    DTYPES,
    INPUT_FORMS,
    PARAM_NAMES,
    QK_NORMS,
    ROTARY_KINDS,
    ROTARY_SCALING_KINDS,
    RotaryScaling,
)
from mha_harness.contract.scoped import scoped
from mha_harness.contract.score_scale import checked_score_scale
from mha_harness.contract.validation import (
    qk_norm_bias_shapes,
    qk_norm_gain_shapes,
    validate_config,
    validate_cotangent,
    validate_decode_step,
    validate_dtype,
    validate_form,
    validate_inputs,
    validate_params,
)

__all__ = ["ACCEPTED_FORMS", "CAUSAL_ALIGNMENTS", "DTYPES", "INPUT_FORMS", "PARAM_NAMES", "AttentionBackend",
           "AttentionConfig", "AttentionInputs", "AttentionOutput", "AttentionParams", "Capabilities", "Divergence",
           "LoadedAttention", "Unsupported", "as_kv_cache_call", "implicitly_causal", "supported"]


class Unsupported(Exception):
    """Raised by a backend for an input it cannot run (e.g. a kernel that refuses masks on this device).

    The case is reported as skipped with this message as the reason, never as passed.
    """


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, as data. Cases that need a missing capability skip with its name.

    ``inputs`` is the input form the backend takes (see :class:`AttentionInputs`):

    * ``"separate"`` (default): three arrays ``query``, ``key``, ``value``; it accepts the other two forms too;
    * ``"shared_kv"``: ``x_q`` and one ``x_kv`` that makes both K and V (encoder-decoder cross-attention);
      the backend receives ``AttentionInputs(query=x_q, key=x_kv, value=x_kv)`` with ``key is value``;
    * ``"self"``: one ``x`` (the lesson's ``multi_head_attention(X, ...)``, GPT-2's attention); the backend
      receives ``AttentionInputs(x, x, x)`` with ``query is key is value``. It implies ``cross_attention=False``.
    * ``"kv_cache"``: a KV-cache step, ``layer(x_new, cache)``: the backend receives
      ``AttentionInputs(query=x_new, key=x_kv, value=x_kv)`` with ``key is value`` and ``x_new`` equal to the last
      Tq rows of ``x_kv``; the earlier rows, :attr:`AttentionInputs.cached`, are the input of the positions in the
      cache (the backend projects them to fill its cache, then runs its step on ``x_new``, whose keys and values
      it projects from ``x_new`` itself). With nothing cached (Tq = Tk) the call is one x. It implies
      ``more_queries_than_keys=False``, and its causal mask is bottom-right (the new queries are the last
      positions): ``causal_alignments`` is ``("bottom-right",)`` or ``()``.

    A call in a form the backend does not accept is refused by validation (ValueError naming ``inputs``);
    cases build their inputs in the backend's form, and a case defined only for another form skips naming it.

    Defaults (the table in docs/plugins.md says why): ON for what the harness's convention says
    every MHA layer takes -- both causal alignments, key padding, boolean and additive masks, Tq != Tk, biases and
    grouped-query heads -- so a backend that ignores one is caught, and leaving one out is a visible declaration;
    OFF for what needs code beyond ``compute``: ``attention_weights`` (returning per-head weights), ``gradients``
    (``compute_vjp``); ``native_parameters`` is ON because the base class answers Unsupported (a skip) until the
    backend implements ``native_parameter_shapes``. ``always_causal`` (OFF) declares a layer that cannot attend
    without its causal mask (nanoGPT's ``CausalSelfAttention``, GPT-2's attention): every case then runs causal in
    the first declared alignment (see :func:`implicitly_causal`), and the cases whose property holds only
    without a mask skip naming it. ``more_queries_than_keys`` (ON; meaningful with ``cross_attention``) off declares a
    layer that needs Tq <= Tk, such as a KV-cache decode kernel whose queries are the last Tq keys.
    ``logit_softcap`` (None) declares soft-capped scores: the layer replaces each scaled score s by
    ``c * tanh(s / c)`` before any mask is applied (Gemma 2's ``attn_logit_softcapping``, flash-attn's ``softcap``,
    a FlexAttention ``score_mod``), and every case compares it with the reference capped the same way (the report
    shows the cap; the lesson's printed weights are then not compared). ``score_scale`` (None: the standard
    1/sqrt(d_head)) declares a layer built with another scale (:mod:`~mha_harness.contract.score_scale`): ``"1/d_head"``
    (muP) or a number applied at every head width (``1.0``: T5's unscaled scores; Gemma's
    ``query_pre_attn_scalar ** -0.5``); every case, search and bench then compare it with the reference scaled so, and
    the scale case checks that scale (the report shows it). ``qk_norms`` (empty) names the norms on q and k the layer
    can be built with (:data:`~mha_harness.contract.conventions.QK_NORMS`: ``"rms_per_head"``, Qwen 3 and Gemma 3;
    ``"rms_over_projection"``, OLMo 2; ``"layer_per_head"``, timm's qk_norm; ``"layer_per_head_no_bias"``, ViT-22B and
    flax's normalize_qk): the cases then also run layers whose ``config.qk_norm`` is one of them, with the norm's gains
    ``g_q`` and ``g_k`` (and a LayerNorm's biases ``beta_q``, ``beta_k``) among the parameters, and every other case a
    layer without one (a wrapper builds its module's norms from ``config.qk_norm``, the identity when it is None).
    ``rotary`` (empty) names the rotary position embeddings the layer can be built with
    (:data:`~mha_harness.contract.conventions.ROTARY_KINDS`: ``"half_split"``, Hugging Face's Llama, Mistral and Qwen;
    ``"interleaved"``, GPT-J and Meta's Llama code): the cases then also run layers whose ``config.rotary`` is one of
    them, at the positions :func:`~mha_harness.contract.conventions.rotary_positions` gives, and every other case a
    layer without it (a wrapper of a layer that always rotates gives every token one position there: see
    docs/plugins.md). ``partial_rotary`` (OFF) declares a layer whose rotary can turn fewer than d_head features of
    each head (``config.rotary_dims``: GPT-NeoX and StableLM's ``rotary_pct``, Phi's ``partial_rotary_factor``,
    GPT-J's ``rotary_dim``); the cases then also run such layers. ``rotary_scalings`` (empty) names the rescalings of
    the rotary frequencies the layer can be built with (``config.rotary_scaling``'s kind,
    :data:`~mha_harness.contract.conventions.ROTARY_SCALING_KINDS`: ``"llama3"``, Llama 3.1's ``rope_type``;
    ``"linear"``, position interpolation). ``d_head_multiple`` (1) declares a layer built only at head widths that are
    multiples of it (2: one whose rotary code needs an even d_head even when rotary is off, as transformers'
    ``LlamaConfig``; 8: FlashAttention's kernels): search draws only such widths, and a case whose layer has another
    skips, naming it. ``sliding_window`` (OFF) declares a layer that can be built with a sliding window
    (``config.sliding_window = w``: each query sees only its own position and the w - 1 before it, as Mistral's,
    Gemma's and Qwen 2's local layers): the cases then also run such layers, and every other case a layer without one.
    ``alibi`` (empty) names the ALiBi biases the layer can be built with
    (:data:`~mha_harness.contract.conventions.ALIBI_KINDS`: ``"symmetric"``, ``-m_h * |p - s|``, flash-attn's
    ``alibi_slopes`` and MPT's; ``"linear"``, ``-m_h * (p - s)``, the paper's and BLOOM's): the cases then also run
    layers whose ``config.alibi`` is one of them, with the paper's slopes
    (:func:`~mha_harness.contract.conventions.alibi_slopes`), and every other case a layer without it.
    Malformed values (a string where a tuple belongs, an unknown dtype or alignment, a truthy non-bool) are refused
    here, so nothing is declared by accident.
    """

    causal_alignments: tuple[str, ...] = CAUSAL_ALIGNMENTS
    key_padding_mask: bool = True
    bool_attn_mask: bool = True
    additive_attn_mask: bool = True
    cross_attention: bool = True
    attention_weights: bool = False
    gradients: bool = False
    grouped_query: bool = True
    bias: bool = True
    native_parameters: bool = True
    dtypes: tuple[str, ...] = ("float32", "float64")
    devices: tuple[str, ...] = ("cpu",)
    max_seq_len: int | None = None
    inputs: str = "separate"
    always_causal: bool = False
    more_queries_than_keys: bool = True
    logit_softcap: float | None = None
    score_scale: float | str | None = None
    qk_norms: tuple[str, ...] = ()
    rotary: tuple[str, ...] = ()
    partial_rotary: bool = False
    rotary_scalings: tuple[str, ...] = ()
    d_head_multiple: int = 1
    sliding_window: bool = False
    alibi: tuple[str, ...] = ()

    def accepts_form(self, form: str) -> bool:
        """True when inputs of ``form`` (an :attr:`AttentionInputs.form`) may be passed to this backend."""
        return form in ACCEPTED_FORMS[self.inputs]

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"Capabilities.{f.name}: got {value!r} of type {type(value).__name__}; "
                                "accepted: True or False")
        self._names("causal_alignments", CAUSAL_ALIGNMENTS, allow_empty=True)
        self._names("dtypes", DTYPES, allow_empty=False)
        self._names("devices", None, allow_empty=False)
        self._names("qk_norms", QK_NORMS, allow_empty=True)
        self._names("rotary", ROTARY_KINDS, allow_empty=True)
        self._names("rotary_scalings", ROTARY_SCALING_KINDS, allow_empty=True)
        self._names("alibi", ALIBI_KINDS, allow_empty=True)
        m = self.d_head_multiple
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"Capabilities.d_head_multiple: got {m!r}; accepted: an integer >= 1, the number every "
                             "head width the layer can be built with is a multiple of (1: any; 2: even ones, as a "
                             "Hugging Face rotary layer's config needs; 8: FlashAttention's)")
        if self.max_seq_len is not None and (isinstance(self.max_seq_len, bool)
                                             or not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ValueError(f"Capabilities.max_seq_len: got {self.max_seq_len!r}; accepted: None or an integer >= 1")
        if not isinstance(self.inputs, str) or self.inputs not in INPUT_FORMS:
            raise ValueError(f"inputs: got {self.inputs!r}; accepted: {', '.join(map(repr, INPUT_FORMS))} "
                             "(separate query/key/value, one x_q plus one x_kv, one x, or a KV-cache step: x_new "
                             "plus one x_kv whose last Tq rows are x_new)")
        if self.inputs == "self" and self.cross_attention:
            object.__setattr__(self, "cross_attention", False)  # one x cannot have Tq != Tk
        if self.inputs == "kv_cache":
            object.__setattr__(self, "more_queries_than_keys", False)  # the new queries are among the keys
            if any(a != BOTTOM_RIGHT for a in self.causal_alignments):
                raise ValueError(f"Capabilities.causal_alignments: got {self.causal_alignments!r} with "
                                 "inputs='kv_cache'; accepted: ('bottom-right',) or () (a KV-cache step's new queries "
                                 "are the last Tq of the Tk positions, so its causal mask is bottom-right)")
        cap = self.logit_softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap)
                                or cap <= 0):
            raise ValueError(f"Capabilities.logit_softcap: got {cap!r}; accepted: None (scores as they are) or a "
                             "finite number > 0, the cap c of scores soft-capped as c * tanh(s / c) before any mask "
                             "(e.g. 50.0, Gemma 2's attn_logit_softcapping)")
        if cap is not None:
            object.__setattr__(self, "logit_softcap", float(cap))
        object.__setattr__(self, "score_scale", checked_score_scale(self.score_scale, "Capabilities.score_scale"))
        if self.always_causal and not self.causal_alignments:
            raise ValueError("Capabilities.always_causal: got True with causal_alignments=(); accepted: "
                             "always_causal=True with the alignment the layer applies, e.g. "
                             "causal_alignments=('top-left',), or always_causal=False")

    def _names(self, field_name: str, accepted: tuple[str, ...] | None, *, allow_empty: bool) -> None:
        """A tuple (a list is converted) of distinct strings from ``accepted``; never a bare string."""
        value = getattr(self, field_name)
        shown = f"a tuple of {', '.join(map(repr, accepted))}" if accepted else "a tuple of names such as ('cpu',)"
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            raise TypeError(f"Capabilities.{field_name}: got {value!r}; accepted: {shown}")
        bad = [v for v in value if not isinstance(v, str) or (accepted is not None and v not in accepted)]
        if bad:
            raise ValueError(f"Capabilities.{field_name}: got unknown {', '.join(map(repr, bad))}; accepted: {shown}")
        if not value and not allow_empty:
            raise ValueError(f"Capabilities.{field_name}: got an empty tuple; accepted: {shown} (at least one)")
        if len(set(value)) != len(value):
            raise ValueError(f"Capabilities.{field_name}: got duplicates in {value!r}; accepted: {shown}")
        object.__setattr__(self, field_name, tuple(value))

    def has(self, capability: str) -> bool:
        """True when the named boolean capability, or ``causal:<alignment>``, ``dtype:<name>``, is declared."""
        if capability.startswith("causal:"):
            return capability.split(":", 1)[1] in self.causal_alignments
        if capability.startswith("dtype:"):
            return capability.split(":", 1)[1] in self.dtypes
        if capability.startswith("inputs:"):
            return self.accepts_form(capability.split(":", 1)[1])
        if capability == "causal":
            return bool(self.causal_alignments)
        if capability == "non_causal":  # attention without a causal mask
            return not self.always_causal
        value = getattr(self, capability, None)
        if not isinstance(value, bool):
            raise ValueError(f"capability: unknown capability {capability!r}; accepted: "
                             f"{sorted(f.name for f in dataclasses.fields(self) if f.type == 'bool')}"
                             " or causal, non_causal, causal:<alignment>, dtype:<name>, inputs:<form>")
        return value

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


#: fully masked rows (no key to attend to) -> what the backend outputs for them before W_o
FULLY_MASKED_ROWS = {"uniform_average": "uniform average of V", "nan": "NaN", "zeros": "zeros"}


def describe_behaviour(behaviour: str) -> str:
    """A declared behaviour in words, e.g. ``precision:float32`` -> "compared against the bound of dtype float32"."""
    kind, _, value = behaviour.partition(":")
    if kind == "fully_masked_rows":
        return f"fully masked rows output the {FULLY_MASKED_ROWS[value]}" if value == "uniform_average" else \
            f"fully masked rows output {FULLY_MASKED_ROWS[value]}"
    if kind == "precision":
        return f"compared against the bound of dtype {value}"
    return "NaN/inf held by a masked key/value reaches the output (only there)"


def parse_behaviour(behaviour: str) -> str:
    """Check a declared behaviour against the vocabulary; a ValueError lists the accepted forms."""
    accepted = ([f"fully_masked_rows:{v}" for v in FULLY_MASKED_ROWS] + [f"precision:{d}" for d in DTYPES]
                + ["masked_poison"])
    if behaviour not in accepted:
        features = {"score_scale": ("a score scale of its own", "Capabilities(score_scale=1.0) or \"1/d_head\""),
                    "softcap": ("soft-capped scores", "Capabilities(logit_softcap=c)"),
                    "alibi": ("ALiBi", "Capabilities(alibi=(\"linear\",)) or (\"symmetric\",)"),
                    "rotary": ("rotary embeddings", "Capabilities(rotary=(\"half_split\",))"),
                    "window": ("a sliding window", "Capabilities(sliding_window=True)"),
                    "qk_norm": ("a q/k norm", "Capabilities(qk_norms=(...))")}
        named = next((pair for key, pair in features.items() if isinstance(behaviour, str) and key in behaviour), None)
        feature = (f"; a layer built with {named[0]} declares it as a capability, {named[1]}, which every case then "
                   "checks: not a divergence (docs/plugins.md, 'Layers that cannot run every call')") if named else ""
        raise ValueError(f"Divergence behaviour: got {behaviour!r}; accepted: {', '.join(accepted)} "
                         f"(ready-made: mha_harness.toolkit.divergences){feature}")
    return behaviour


@dataclass(frozen=True)
class Divergence:
    """A declared, reasoned difference between a backend and the harness's convention, which the harness verifies.

    ``case`` names the check; ``when`` restricts it to case parameters (e.g. ``{"dtype": "float64"}``; a list or
    tuple value means "any of these"); ``reason`` says why (library behaviour and version). ``behaviour`` names
    the alternative from a small vocabulary the harness checks:

    * ``fully_masked_rows:uniform_average`` | ``fully_masked_rows:nan`` | ``fully_masked_rows:zeros``: rows with
      no key to attend to are compared against that output instead of the convention;
    * ``precision:<dtype>``: the result is compared against the tolerance bound of ``dtype`` (a float64 run
      declared ``precision:float32`` must still meet the float32 bound);
    * ``masked_poison``: NaN/inf may come out only in batch items where a masked key/value held NaN/inf, the
      output must be right once those are finite, and the finite-value variant of the case must pass.

    When the case fails, it is rerun under the declaration (under every declaration the variant matches, at once:
    an empty-row output and a precision, say): passing there is an *expected divergence*; failing
    there is a failure ("fails even under its declared divergence (...): ..."). A declaration whose case passes
    anyway is an *unexpected pass* and fails the run, so declarations cannot rot. Unknown case names or ``when``
    keys are refused when the backend is checked.
    """

    case: str
    behaviour: str
    reason: str
    when: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("case", "behaviour", "reason"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise TypeError(f"Divergence {name}: got {getattr(self, name)!r}; accepted: a non-empty string")
        parse_behaviour(self.behaviour)
        if not isinstance(self.when, Mapping):
            raise TypeError(f"Divergence when: got {type(self.when).__name__}; accepted: a mapping of case "
                            "parameter names to values")

    @property
    def observed(self) -> str:
        """The declared behaviour in words (shown in reports)."""
        return describe_behaviour(self.behaviour)

    def matches(self, case: str, params: Mapping[str, Any]) -> bool:
        def fits(key, wanted):
            if isinstance(wanted, (list, tuple, set, frozenset)):
                return params.get(key) in wanted
            return params.get(key) == wanted
        return case == self.case and all(fits(k, v) for k, v in self.when.items())


@dataclass(frozen=True)
class AttentionConfig:
    """Shape of one attention layer."""

    d_model: int
    num_heads: int
    num_kv_heads: int | None = None
    bias: bool = False
    #: a norm of q and of k after their projections, before the scores (None: none): an RMSNorm, ``"rms_per_head"``
    #: over each head's d_head features (Qwen 3, Gemma 3), ``"rms_over_projection"`` over the whole projection
    #: (OLMo 2); or a LayerNorm over each head's d_head features, ``"layer_per_head"`` with a bias (timm's qk_norm)
    #: or ``"layer_per_head_no_bias"`` (ViT-22B, flax's normalize_qk); its gains are the parameters ``g_q`` and
    #: ``g_k``, a LayerNorm's biases ``beta_q`` and ``beta_k`` (:data:`~mha_harness.contract.conventions.QK_NORMS`)
    qk_norm: str | None = None
    #: the epsilon added to the mean square (a LayerNorm's variance) inside the norm's square root
    qk_norm_eps: float = DEFAULT_QK_NORM_EPS
    #: rotary position embeddings on each head of q and k after the projections and the q/k norm (None: none):
    #: ``"half_split"`` (Hugging Face's rotate_half: Llama, Mistral, Qwen) or ``"interleaved"`` (GPT-J, Meta's
    #: Llama code); key j at position j, query i at i + Tk - Tq (:data:`~mha_harness.contract.conventions.ROTARY_KINDS`,
    #: :func:`~mha_harness.contract.conventions.rotary_positions`)
    rotary: str | None = None
    #: the rotary frequencies' base: pair i turns by position * rotary_base ** (-2i / r), r = :attr:`rotary_width`
    rotary_base: float = DEFAULT_ROTARY_BASE
    #: how many of each head's leading features the rotary embeddings turn (None: all d_head); fewer makes a partial
    #: rotary, whose other features pass unturned and whose frequencies are over these r (GPT-NeoX's and StableLM's
    #: ``rotary_pct``, Phi's ``partial_rotary_factor``, GPT-J's ``rotary_dim``); an even number, only with ``rotary``
    rotary_dims: int | None = None
    #: a rescaling of the rotary frequencies for long contexts (None: none), e.g. Llama 3.1's
    #: ``RotaryScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=8192)``
    #: (:class:`~mha_harness.contract.conventions.RotaryScaling`); only with ``rotary``
    rotary_scaling: RotaryScaling | None = None
    #: a sliding window of w keys (None: every key): the query at position p sees only the keys at p and the w - 1
    #: positions before it, on top of every other mask (Mistral's and Gemma's ``sliding_window``, flash-attn's
    #: ``window_size=(w - 1, -1)``); p is the causal mask's diagonal in a causal call, the last Tq of the Tk positions
    #: without one (:func:`~mha_harness.contract.conventions.window_offset`)
    sliding_window: int | None = None
    #: ALiBi: a bias on each head's scaled scores by the distance between query and key positions (None: none),
    #: ``-m_h * |p - s|`` for ``"symmetric"`` (flash-attn's ``alibi_slopes``, MPT), ``-m_h * (p - s)`` for
    #: ``"linear"`` (the ALiBi paper's, BLOOM's), with the paper's slopes m_h; query i at position i + Tk - Tq, key j at
    #: j (:data:`~mha_harness.contract.conventions.ALIBI_KINDS`, :func:`~mha_harness.contract.conventions.alibi_bias`)
    alibi: str | None = None

    def __post_init__(self):
        validate_config(self)

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_heads

    @property
    def rotary_width(self) -> int:
        """The number r of each head's leading features the rotary embeddings turn: ``rotary_dims``, or d_head."""
        return self.d_head if self.rotary_dims is None else int(self.rotary_dims)

    @property
    def partial_rotary(self) -> bool:
        """True for rotary embeddings that turn fewer than d_head of each head's features."""
        return self.rotary is not None and self.rotary_width < self.d_head

    def expected_parameter_count(self) -> int:
        """4*d_model^2 (+4*d_model with biases); K/V shrink to num_kv_heads*d_head columns for grouped-query; a q/k
        norm adds its gains (2*d_head per head-wise norm, d_model + num_kv_heads*d_head over the projections), a
        LayerNorm with a bias its biases (2*d_head)."""
        kv_width = self.kv_heads * self.d_head
        count = 2 * self.d_model * self.d_model + 2 * self.d_model * kv_width
        if self.bias:
            count += 2 * self.d_model + 2 * kv_width
        norms = {**qk_norm_gain_shapes(self), **qk_norm_bias_shapes(self)}
        return count + sum(int(np.prod(shape)) for shape in norms.values())


@dataclass
class AttentionParams:
    """Canonical parameters in the ``x @ W`` convention (float64 NumPy arrays)."""

    config: AttentionConfig
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray
    b_q: np.ndarray | None = None
    b_k: np.ndarray | None = None
    b_v: np.ndarray | None = None
    b_o: np.ndarray | None = None
    #: the q and k norms' gains, present exactly when ``config.qk_norm`` is set (their shapes: ``qk_norm_gain_shapes``)
    g_q: np.ndarray | None = None
    g_k: np.ndarray | None = None
    #: the q and k LayerNorms' biases, present exactly when ``config.qk_norm`` has them (``qk_norm_bias_shapes``)
    beta_q: np.ndarray | None = None
    beta_k: np.ndarray | None = None

    def __post_init__(self):
        validate_params(self)

    def arrays(self) -> dict[str, np.ndarray]:
        return {n: getattr(self, n) for n in PARAM_NAMES if getattr(self, n) is not None}

    def replace(self, **arrays) -> AttentionParams:
        return dataclasses.replace(self, **arrays)


@dataclass
class AttentionInputs:
    """One call's inputs: (batch, T, d_model) arrays and masks in the harness's conventions.

    The input form is carried by identity (see :attr:`form`): ``query is key is value`` is one ``x``
    (self-attention), ``key is value`` is one ``x_kv`` (shared K/V). Arrays may arrive strided
    (non-contiguous views); a backend that needs contiguous memory copies them itself.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    causal: str | None = None
    key_padding_mask: np.ndarray | None = None
    attn_mask: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def tq(self) -> int:
        return self.query.shape[1]

    @property
    def tk(self) -> int:
        return self.key.shape[1]

    @property
    def is_self_attention(self) -> bool:
        return self.query is self.key and self.key is self.value

    @property
    def form(self) -> str:
        """``"self"`` when query is key is value; ``"kv_cache"`` when key is value and the query holds the last Tq
        rows of it (a KV-cache step, see :class:`Capabilities`); ``"shared_kv"`` when key is value; else
        ``"separate"``."""
        if self.key is self.value:
            if self.query is self.key:
                return "self"
            return "kv_cache" if queries_are_last_rows(self.query, self.key) else "shared_kv"
        return "separate"

    @property
    def cached(self) -> np.ndarray:
        """A KV-cache call's cached positions' input: the first Tk - Tq rows of x_kv (``key``), (batch, Tk - Tq,
        d_model); empty when nothing is cached."""
        return self.key[:, :max(self.tk - self.tq, 0)]

    def __post_init__(self):
        if self.causal is None:
            self.causal = _IMPLICIT_CAUSAL.get()

    def replace(self, **fields) -> AttentionInputs:
        """A copy with ``fields`` replaced, its causal mask the one given or else this call's, also inside
        :func:`implicitly_causal` (which fills in the causal of inputs made without one, not of a copy):
        ``replace(causal=None)`` is the call without its causal mask, and a copy of it stays without one."""
        with scoped(_IMPLICIT_CAUSAL, None):
            return dataclasses.replace(self, **fields)

    def features(self) -> set[str]:
        """Capabilities this call needs from a backend."""
        needs = {f"inputs:{self.form}"}
        if self.causal:
            needs.add(f"causal:{self.causal}")
        if self.key_padding_mask is not None:
            needs.add("key_padding_mask")
        if self.attn_mask is not None:
            needs.add("bool_attn_mask" if self.attn_mask.dtype == np.bool_ else "additive_attn_mask")
        if self.tq != self.tk:
            needs.add("cross_attention")
        if self.tq > self.tk:
            needs.add("more_queries_than_keys")
        return needs


def queries_are_last_rows(query, x_kv) -> bool:
    """Whether ``query`` equals the last Tq rows of ``x_kv`` (NaN where NaN): a KV-cache call's x_new and x_kv.
    False for arrays of other ranks, batch sizes or widths, or Tq > Tk."""
    q, kv = np.asarray(query), np.asarray(x_kv)
    if q.ndim != 3 or kv.ndim != 3 or q.shape[0] != kv.shape[0] or q.shape[2] != kv.shape[2] \
            or not 0 < q.shape[1] <= kv.shape[1] or q.dtype != kv.dtype:
        return False
    return bool(np.array_equal(q, kv[:, kv.shape[1] - q.shape[1]:], equal_nan=q.dtype.kind in "fc"))


def as_kv_cache_call(inputs: AttentionInputs) -> AttentionInputs:
    """``inputs`` as a KV-cache step: one x_kv, a copy of ``inputs.key`` whose last Tq rows are ``inputs.query``,
    as both key and value (Tq <= Tk; the masks unchanged)."""
    x_kv = np.array(inputs.key, copy=True)
    x_kv[:, inputs.tk - inputs.tq:] = inputs.query
    return inputs.replace(key=x_kv, value=x_kv)


#: the alignment AttentionInputs made without ``causal`` take (None: they stay non-causal); see implicitly_causal
_IMPLICIT_CAUSAL: contextvars.ContextVar[str | None] = contextvars.ContextVar("mha_harness_implicit_causal",
                                                                              default=None)


@contextlib.contextmanager
def implicitly_causal(alignment: str | None) -> Iterator[None]:
    """Inside this block every :class:`AttentionInputs` made with ``causal=None`` is causal in ``alignment``.

    How the cases run for a backend that declares ``Capabilities(always_causal=True)``: the case's inputs, the
    reference computed from them and the backend's call are one causal call, so every property the case
    proves is proved for the causal layer the backend is. ``alignment=None`` changes nothing."""
    if alignment is not None and alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"alignment: got {alignment!r}; accepted: None, {' or '.join(map(repr, CAUSAL_ALIGNMENTS))}")
    with scoped(_IMPLICIT_CAUSAL, alignment):
        yield


@dataclass
class AttentionOutput:
    """Output (batch, Tq, d_model) and optional per-head weights (batch, heads, Tq, Tk)."""

    output: np.ndarray
    weights: np.ndarray | None = None


class LoadedAttention:
    """A backend holding one set of parameters in its native form, on its device, in its dtype.

    How a plugin makes one: subclass it, give the subclass any ``__init__`` you like (the base class has none and
    needs no ``super().__init__()``), build it in your :meth:`AttentionBackend.load_native` from the canonical
    ``params`` and ``dtype`` (convert the weights once, there), and implement :meth:`compute`. Set nothing else:
    :meth:`AttentionBackend.load`, which the harness calls, validates, calls ``load_native`` and then sets
    :attr:`config` (``params.config``) and :attr:`input_form` (``capabilities.inputs``) on the returned object,
    which :meth:`forward` and :meth:`vjp` use to validate every call before your code sees it. (An instance made
    without ``load`` has no ``config``: call ``backend.load(params, dtype=...)``, not your class directly.)

    Optional: :meth:`compute_vjp` (with ``gradients=True``), :meth:`prepare` (for ``mha-harness bench``),
    :meth:`prepare_decode_step` (a step over a filled KV cache: ``bench --workload decode`` and its conformance case).
    """

    #: set by :meth:`AttentionBackend.load` after ``load_native`` returns: the layer's shape (``params.config``)
    config: AttentionConfig
    #: set by :meth:`AttentionBackend.load` after ``load_native`` returns: the backend's ``Capabilities.inputs``
    input_form: str = "separate"
    #: set by :meth:`AttentionBackend.load`: the backend's ``Capabilities.always_causal``
    always_causal: bool = False

    def forward(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        """Validate, then run the layer on NumPy inputs and return NumPy outputs."""
        self._require_loaded()
        validate_inputs(inputs, self.config)
        validate_form(inputs, self.input_form)
        self._require_causal(inputs)
        return self.compute(inputs, need_weights=need_weights)

    def compute(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        """The backend's computation on already-validated inputs. Backends implement this."""
        raise NotImplementedError

    def vjp(self, inputs: AttentionInputs, cotangent: np.ndarray) -> dict[str, np.ndarray]:
        """Vector-Jacobian product of the output with ``cotangent``.

        Returns gradients keyed by ``query``, ``key``, ``value`` and the parameter names
        (``W_q`` ...), all in the canonical layout. Only for backends declaring ``gradients``.
        One gradient per argument of the module's call, as its declared form has them: a ``separate`` backend
        returns ``query``, ``key`` and ``value`` (also for a call with one x: three leaves, not the total), a
        ``self`` backend ``query`` (d/dx), a ``shared_kv`` backend ``query`` (d/dx_q) and ``key`` (d/dx_kv); a
        ``value`` entry is then ignored.
        Validates like :meth:`forward`, and ``cotangent`` like an output (shape, dtype, finite), then calls
        :meth:`compute_vjp`.
        """
        self._require_loaded()
        validate_inputs(inputs, self.config)
        validate_form(inputs, self.input_form)
        self._require_causal(inputs)
        validate_cotangent(cotangent, inputs, self.config)
        return self.compute_vjp(inputs, cotangent)

    def _require_causal(self, inputs: AttentionInputs) -> None:
        if self.always_causal and inputs.causal is None:
            raise Unsupported(f"causal: got None; accepted: {' or '.join(map(repr, CAUSAL_ALIGNMENTS))} "
                              "(the backend declares always_causal=True: it cannot attend without a causal mask)")

    def _require_loaded(self) -> None:
        if not isinstance(getattr(self, "config", None), AttentionConfig):
            raise TypeError(f"{type(self).__name__} has no config: it was not made by AttentionBackend.load(); "
                            "accepted: backend.load(params, dtype=...), which calls load_native and sets config "
                            "and input_form")

    def compute_vjp(self, inputs: AttentionInputs, cotangent: np.ndarray) -> dict[str, np.ndarray]:
        """The backend's gradients on already-validated inputs. Backends with gradients implement this."""
        raise NotImplementedError(f"{type(self).__name__} does not compute gradients")

    def decode_step(self, inputs: AttentionInputs) -> Callable[[], Any]:
        """Validate a decode step's call (see :meth:`prepare_decode_step`), then return that method's callable."""
        self._require_loaded()
        validate_inputs(inputs, self.config)
        validate_decode_step(inputs)
        step = self.prepare_decode_step(inputs)
        if not callable(step):
            raise TypeError(f"prepare_decode_step: returned {type(step).__name__}; accepted: a zero-argument callable "
                            "that runs one step and returns its output (the step itself, not its output)")
        return step

    def prepare_decode_step(self, inputs: AttentionInputs) -> Callable[[], Any]:
        """One decode step over a KV cache filled before it: what ``mha-harness bench --workload decode`` times and
        ``check_decode_step_over_filled_cache_matches_reference`` verifies.

        ``inputs`` is a KV-cache call (:func:`as_kv_cache_call` makes one): ``query`` is x_new, the Tq new positions,
        and ``key`` (which is ``value``) is x_kv, all Tk positions, whose last Tq rows are x_new; its causal mask is
        None or bottom-right, and it has no other mask. Here, untimed: project :attr:`AttentionInputs.cached` (the
        first Tk - Tq rows of x_kv) to keys and values, store them in a cache with room for all Tk positions, and
        convert x_new to your framework's tensors. Each call of the returned function is one step: project x_new to
        queries, keys and values, write the new keys and values into the cache's last Tq slots, attend the Tq
        queries over all Tk cached keys (with the causal mask when ``inputs.causal`` is set), apply W_o, and return
        the output (batch, Tq, d_model) once the device finished. Every call writes the same slots, so every call
        returns the same output; the harness reads it with :meth:`decode_step_output` and compares the first two
        calls with the float64 reference (a step that attends before it writes, or appends past the last slot,
        fails). Without it (this default raises NotImplementedError) the backend has no decode step: the case
        skips and the decode workload leaves it out, saying so; a step that cannot run a call raises
        :class:`Unsupported` (or NotImplementedError) naming why, and that call skips.
        """
        raise NotImplementedError(f"{type(self).__name__} has no decode step (prepare_decode_step)")

    def native_output(self, value) -> np.ndarray:
        """The output a prepared forward call (:meth:`prepare`) or a decode step returned, as a NumPy array:
        ``np.asarray(value)`` (an :class:`AttentionOutput`'s ``output``). Override it when NumPy cannot read your
        framework's arrays as they are (a CUDA tensor, bfloat16, a tuple of output and weights)."""
        return np.asarray(value.output if isinstance(value, AttentionOutput) else value)

    def native_gradients(self, value) -> dict[str, np.ndarray]:
        """The gradients a prepared forward + backward call (:meth:`prepare` with ``backward=True``) returned, as
        NumPy arrays under the names and in the layout :meth:`vjp` returns (``query``/``key``/``value`` per the
        declared input form, ``W_q`` ... ``b_o`` as (d_in, d_out) and (d_out,)): the gradients of
        ``output.sum()``. The default raises NotImplementedError: bench then times the call without checking it."""
        raise NotImplementedError(f"{type(self).__name__} does not read its forward + backward call's gradients "
                                  "(native_gradients)")

    def decode_step_output(self, value) -> np.ndarray:
        """The output a decode step returned, as a NumPy array: :meth:`native_output`. Override that one, which
        reads what :meth:`prepare`'s calls return too, unless a decode step returns something else."""
        return self.native_output(value)

    def prepare(self, inputs: AttentionInputs, *, backward: bool = False) -> Callable[[], Any]:
        """What ``mha-harness bench`` times: a zero-argument callable that runs the native op once.

        Convert ``inputs`` to your framework's tensors here, before returning (conversion is not timed); each call
        of the returned function runs one forward (``backward=True``: forward plus backward to every input and
        parameter) on those tensors and returns only after the device finished (synchronise on a GPU). A forward
        call returns the layer's output, shape (batch, Tq, d_model), which :meth:`native_output` reads: before
        timing a point, bench compares one call's output at a few query rows (all of them when Tq <= 16) with the
        float64 reference, under the tolerance conformance uses, and times no call that returns something else or a
        wrong output (the point is reported ``wrong-output``). A forward + backward call runs the backward of
        ``output.sum()`` (the cotangent all ones, as ``out.backward(torch.ones_like(out))`` or ``jax.grad`` of the
        sum) to every input array and parameter, as a training step does, and returns those gradients, which
        :meth:`native_gradients` reads: bench checks them like the forward's output (a few rows of each), before and
        after timing, so each call must compute them afresh (set a torch leaf's ``.grad`` to None before its
        backward: gradients that accumulate over calls are right only at the first). Without
        :meth:`native_gradients` its return value is not read and its points are timed unchecked, saying so. It is
        called many times, so it must not change its inputs. Without it (the default raises NotImplementedError)
        the backend is not benchmarked; conformance never calls it.
        """
        raise NotImplementedError(f"{type(self).__name__} has no prepared callable")


class AttentionBackend:
    """Base class of every backend. Subclasses set ``name`` and ``capabilities`` and implement ``load_native``.

    ``load_native(params, dtype)`` returns your :class:`LoadedAttention` subclass; the harness calls :meth:`load`,
    which validates ``params`` and ``dtype`` against the declared capabilities, calls ``load_native`` and sets
    ``config`` and ``input_form`` on the result (do not override ``load``).

    Descriptive class attributes (text for the report; none changes what is tested):

    * ``native_causal``: what the wrapped library's own causal flag does, e.g. "is_causal=True is top-left;
      bottom-right through the mask" (column "its own causal flag" of the policy table). Unset, the table says
      "not declared" (or "no causal mask declared" when ``causal_alignments`` is empty), never a guess;
    * ``native_mask_polarity``: what masks mean at the library's own API, e.g. nn.MultiheadAttention's "attn_mask
      True = NOT allowed" (column "mask polarity at its own API"). Unset: "not declared" (or "no masks declared");
      the masks your ``compute`` receives are always in the harness's convention (attn_mask True = may attend,
      key_padding_mask True = ignore) whatever you write here;
    * ``memory_method``: how ``mha-harness bench`` measures peak extra memory: ``"rss"`` (default; any CPU code,
      page-granular), ``"tracemalloc"`` (pure NumPy: exact), ``"cuda"`` (torch on a CUDA device),
      ``"jax-device"`` (JAX on a GPU). A GPU backend must set it: RSS does not see device memory;
    * ``compiles_per_shape``: True when the backend compiles a program per input shape and dtype (XLA, inductor),
      so that compilation dominates its conformance run: ``check`` starts such backends first, so that the slowest
      are not the last to start on a machine with few cores (scheduling only).
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()
    divergences: tuple[Divergence, ...] = ()
    #: what the backend's own API takes as masks, shown in the policy table (None: "not declared")
    native_mask_polarity: str | None = None
    #: what the backend's own causal flag does, shown in the policy table next to the verified alignments
    #: (None: "not declared")
    native_causal: str | None = None
    device: str = "cpu"
    #: how mha_harness.bench.memory measures this backend's peak extra memory: rss, tracemalloc, cuda, jax-device
    memory_method: str = "rss"
    #: compiles per input shape and dtype (conformance starts it before the backends that do not)
    compiles_per_shape: bool = False
    #: why the backend runs only when named (``--backend NAME``), e.g. minutes of compilation per shape; None
    #: (default): it runs whenever no backend is named. ``list`` shows the reason.
    opt_in: str | None = None

    def availability(self) -> str | None:
        """None when usable here, else a human reason ("jax is not installed", "no CUDA device")."""
        return None

    def native_parameter_shapes(self, config: AttentionConfig) -> dict[str, tuple[int, ...]]:
        """Allocate the backend's own parameters for ``config`` and report their shapes.

        Measured from what the backend really allocates (module.parameters(), a param tree),
        never from a formula. Optional: the default raises :class:`Unsupported`, so the parameter-count
        case is skipped with that reason, never an error.
        """
        raise Unsupported(f"{self.name} does not report its native parameters "
                          "(implement native_parameter_shapes(config) to run the parameter-count case)")

    def direct_callable(self, inputs: AttentionInputs, params: AttentionParams, *,
                        dtype: str = "float32") -> Callable[[], Any]:
        """The backend's direct library call: optional, for ``mha-harness fidelity``'s harness-overhead figure.

        Returns a zero-argument callable that runs the same layer as :meth:`LoadedAttention.prepare` would, written
        the way a user calls the library without the harness (the projections and the library's attention op on
        tensors converted once, synchronised before returning). Raises :class:`Unsupported` (the default) when the
        backend offers none, or not for these inputs.
        """
        raise Unsupported(f"{self.name} offers no direct library call")

    def _require_declared(self, name: str, value: str | None, declared: str, none: str) -> None:
        """A ValueError naming the config field ``name`` when its ``value`` is not None and not among the kinds the
        capability ``declared`` lists (``none``: what an empty declaration means, in words)."""
        kinds = getattr(self.capabilities, declared)
        if value is not None and value not in kinds:
            raise ValueError(f"{name}: got {value!r} but {self.name} declares "
                             + (f"{declared}={kinds!r}" if kinds else f"{none} (Capabilities.{declared} is empty)")
                             + f"; accepted: {' or '.join(map(repr, (None, *kinds)))}")

    def load(self, params: AttentionParams, *, dtype: str = "float32") -> LoadedAttention:
        """Validate, then load canonical ``params`` into the backend's native form in ``dtype``."""
        if not isinstance(params, AttentionParams):
            raise TypeError(f"params: got {type(params).__name__}; accepted: mha_harness.AttentionParams")
        validate_dtype(dtype, self.capabilities.dtypes)
        if params.config.bias and not self.capabilities.bias:
            raise ValueError(f"params: got biases but {self.name} does not support them; accepted: config.bias=False")
        m = self.capabilities.d_head_multiple
        if params.config.d_head % m:
            raise Unsupported(f"d_head = {params.config.d_head}: {self.name} declares d_head_multiple={m} (a layer "
                              f"built only at head widths that are multiples of {m})")
        self._require_declared("qk_norm", params.config.qk_norm, "qk_norms", "no norm on q and k")
        self._require_declared("rotary", params.config.rotary, "rotary", "no rotary position embeddings")
        scaling = params.config.rotary_scaling
        self._require_declared("rotary_scaling", None if scaling is None else scaling.kind, "rotary_scalings",
                               "no rescaled rotary frequencies")
        if params.config.partial_rotary and not self.capabilities.partial_rotary:
            raise ValueError(f"rotary_dims: got {params.config.rotary_dims} of d_head = {params.config.d_head} but "
                             f"{self.name} does not declare Capabilities.partial_rotary; accepted: None or "
                             f"{params.config.d_head} (every feature of each head turned)")
        if params.config.sliding_window is not None and not self.capabilities.sliding_window:
            raise ValueError(f"sliding_window: got {params.config.sliding_window} but {self.name} does not declare "
                             "Capabilities.sliding_window; accepted: None (every key visible), or declare "
                             "Capabilities(sliding_window=True) for a layer built with config.sliding_window")
        self._require_declared("alibi", params.config.alibi, "alibi", "no ALiBi bias")
        if params.config.kv_heads != params.config.num_heads and not self.capabilities.grouped_query:
            raise ValueError(f"num_kv_heads: got {params.config.kv_heads} but {self.name} does not support "
                             f"grouped-query heads; accepted: num_kv_heads == num_heads ({params.config.num_heads})")
        loaded = self.load_native(params, dtype)
        for name, runs in (("forward", "compute"), ("vjp", "compute_vjp")):
            if name in getattr(loaded, "__dict__", {}):  # e.g. self.vjp = jax.jit(...): the harness's call is gone
                raise TypeError(f"{type(loaded).__name__}.{name}: an attribute of that name set on the loaded object "
                                f"hides LoadedAttention.{name}, which the harness calls (it validates, then calls "
                                f"{runs}); accepted: another name, e.g. self._{name}_fn")
        if self.capabilities.gradients and type(loaded).compute_vjp is LoadedAttention.compute_vjp:
            raise TypeError(f"{self.name} declares gradients=True but its {type(loaded).__name__} does not implement "
                            "compute_vjp(inputs, cotangent); accepted: implement it, or declare gradients=False")
        loaded.config = params.config
        loaded.input_form = self.capabilities.inputs
        loaded.always_causal = self.capabilities.always_causal
        return loaded

    def load_native(self, params: AttentionParams, dtype: str) -> LoadedAttention:
        """Convert canonical parameters to the backend's own layout. Backends implement this."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_native(params, dtype)")

    def versions(self) -> dict[str, str]:
        """Library versions this backend runs on, recorded in reports."""
        return {"numpy": np.__version__}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def policy_texts(backend: AttentionBackend) -> tuple[str, str]:
    """(its own causal flag, mask polarity at its own API) for the policy table: the backend's declared
    ``native_causal`` / ``native_mask_polarity``, or, unset, what its capabilities allow saying without a guess."""
    caps = backend.capabilities
    causal = backend.native_causal
    if not isinstance(causal, str) or not causal:
        causal = "not declared" if caps.causal_alignments else "no causal mask declared"
    polarity = backend.native_mask_polarity
    if not isinstance(polarity, str) or not polarity:
        masks = caps.key_padding_mask or caps.bool_attn_mask or caps.additive_attn_mask
        polarity = "not declared" if masks else "no masks declared"
    return causal, polarity


def supported(backend: AttentionBackend, features: Sequence[str] | set[str]) -> str | None:
    """None if the backend declares every feature, else the reason naming the first missing one."""
    for feature in sorted(features):
        if not backend.capabilities.has(feature):
            if feature == "non_causal":
                return (f"{backend.name} declares always_causal=True; the property holds only without a causal mask "
                        "(capability 'non_causal')")
            if feature == "causal":
                return (f"{backend.name} does not declare capability 'causal': it declares no causal mask "
                        "(Capabilities.causal_alignments=())")
            if feature == "more_queries_than_keys" and backend.capabilities.inputs == "kv_cache":
                return (f"{backend.name}: a call with more queries than keys cannot be expressed as a KV-cache step "
                        "(inputs='kv_cache': the new queries are the last Tq of the Tk positions)")
            if feature.startswith("causal:"):
                return (f"{backend.name} does not declare capability {feature!r}: its Capabilities.causal_alignments "
                        f"are {backend.capabilities.causal_alignments!r}")
            return f"{backend.name} does not declare capability {feature!r}"
    return None
