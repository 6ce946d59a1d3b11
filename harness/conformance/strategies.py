"""Hypothesis strategies over the attention input space, drawn only from what a backend declares.

Each strategy shrinks towards the simplest example: one batch item, one query, one key, one head, no mask, no
bias, unscaled logits. Sequence lengths are 1..9 and both sides of tile boundaries (15/16/17 ... 63/64/65,
127/128/129, 255/256/257, 511/512/513, the block sizes of flash-style kernels), head dimensions include odd ones,
heads and kv heads include grouped- and multi-query layouts, masks include fully masked rows (shared or at one
(batch, head)) and a padding mask whose last key is the only real one, and the logit scale reaches the range where a
softmax without max subtraction overflows (x1000).
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from mha_harness.conformance.casekit import bad_calls
from mha_harness.conformance.search_examples import FORMS, Coverage
from mha_harness.contract.api import AttentionBackend
from mha_harness.contract.conventions import COMMON_ROTARY_BASES

#: sequence lengths: every small one, then both sides of power-of-two tile sizes (and one in between), in the order
#: hypothesis shrinks them (towards the front)
LENGTHS = tuple(range(1, 10)) + (15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 511, 512, 513)
QUICK_MAX_LENGTH = 129
LOGIT_SCALES = (1, 10, 100, 1000)
#: ln(largest finite value): exp(x) overflows above it
EXP_OVERFLOW = {"float16": 11.09, "bfloat16": 88.72, "float32": 88.72, "float64": 709.78}
HEADS = (1, 2, 3, 4)


@dataclass(frozen=True)
class SearchSpace:
    """The part of the input space a backend declares (and its divergences do not cover)."""

    dtypes: tuple[str, ...]
    forms: tuple[str, ...]
    causal: tuple[str | None, ...]
    cross_attention: bool
    more_queries_than_keys: bool
    grouped_query: bool
    bias: bool
    padding: bool
    mask_kinds: tuple[str, ...]
    gradients: bool
    poisons: tuple[str, ...]
    max_batch: int
    lengths: tuple[int, ...]
    max_d_head: int
    #: whether examples may also run the backend's decode step (a KV-cache call, bottom-right causal, no other mask)
    decode_step: bool = False
    #: the norms on q and k the backend declares (Capabilities.qk_norms): examples draw one of them or none
    qk_norms: tuple[str, ...] = ()
    #: the rotary embeddings the backend declares (Capabilities.rotary): examples at an even d_head draw one of them
    #: (at a common base) or none
    rotary: tuple[str, ...] = ()
    #: whether the backend declares a partial rotary (Capabilities.partial_rotary): a rotary example at d_head >= 4
    #: then draws how many of each head's features it turns (``rotary_dims``, absent when all)
    partial_rotary: bool = False
    #: the rescalings of the rotary frequencies the backend declares (Capabilities.rotary_scalings): a rotary example
    #: then draws one of them (``rotary_scaling``, the kind of COMMON_ROTARY_SCALINGS; absent when none)
    rotary_scalings: tuple[str, ...] = ()
    #: the head widths are multiples of this (Capabilities.d_head_multiple): up to max_d_head, or the multiple and
    #: its double where it is larger
    d_head_multiple: int = 1
    #: whether the backend declares a sliding window (Capabilities.sliding_window): examples then draw one of 1 .. Tk
    #: keys, or none (``sliding_window``, absent when none)
    sliding_window: bool = False
    #: the ALiBi biases the backend declares (Capabilities.alibi): examples then draw one of them, or none (``alibi``,
    #: absent when none)
    alibi: tuple[str, ...] = ()

    @classmethod
    def for_backend(cls, backend: AttentionBackend, *, quick: bool = False, dtypes: tuple[str, ...] | None = None,
                    gradients: bool = True) -> SearchSpace:
        """What ``backend`` declares, narrowed to ``dtypes`` (None: all) and without gradients unless
        ``gradients``. A ValueError names ``dtypes`` when none of them is declared."""
        caps, coverage = backend.capabilities, Coverage.of(backend)
        limit = QUICK_MAX_LENGTH if quick else (caps.max_seq_len or max(LENGTHS))
        declared = coverage.output_dtypes or caps.dtypes
        chosen = tuple(d for d in declared if dtypes is None or d in dtypes)
        if not chosen:
            left = [d for d in caps.dtypes if d not in declared]
            why = (f" ({', '.join(left)} not: a divergence from the reference declared for check_output_matches_"
                   "reference in that dtype, a precision: one, is not searched)") if left else ""
            raise ValueError(f"--dtype: got {', '.join(dtypes or ())}; {backend.name} is searched in "
                             f"{', '.join(declared)}{why}")
        return cls(
            dtypes=chosen,
            # every form Capabilities.inputs accepts; a KV-cache call (a shared-K/V call whose x_q is x_kv's last
            # rows) only for a backend that declares that form
            forms=tuple(f for f in FORMS if caps.accepts_form(f) and (f != "kv_cache" or caps.inputs == f)),
            causal=((None,) if caps.has("non_causal") else ()) + tuple(caps.causal_alignments),
            cross_attention=caps.cross_attention,
            more_queries_than_keys=caps.more_queries_than_keys,
            grouped_query=caps.grouped_query,
            bias=caps.bias,
            padding=caps.key_padding_mask,
            mask_kinds=tuple(k for k, declared in (("bool", caps.bool_attn_mask), ("additive", caps.additive_attn_mask))
                             if declared),
            gradients=caps.gradients and gradients,
            poisons=coverage.poisons or ("random",),
            max_batch=2 if quick else 3,
            lengths=tuple(t for t in LENGTHS if t <= limit),
            max_d_head=8 if quick else 16,
            # a decode step takes x_new and x_kv (not one x) and its mask is bottom-right; whether the backend has
            # one is known only by asking (a backend without one answers Unsupported and the property is not run)
            decode_step=caps.inputs != "self" and caps.cross_attention and "bottom-right" in caps.causal_alignments,
            qk_norms=caps.qk_norms,
            rotary=caps.rotary,
            partial_rotary=caps.partial_rotary,
            rotary_scalings=caps.rotary_scalings,
            d_head_multiple=caps.d_head_multiple,
            sliding_window=caps.sliding_window,
            alibi=caps.alibi,
        )


def logit_scales(dtype: str) -> tuple[int, ...]:
    """Logit scales up to the first one whose logits (|logit| reaching ~3 x scale) overflow exp in ``dtype`` without
    max subtraction, and no further: larger logits test nothing new about max subtraction, only the conditioning
    of low precision (float32 at x1000 differs from the float64 reference by more than the naive float32 error's
    sample spread allows, even for numpy-naive)."""
    out = []
    for scale in LOGIT_SCALES:
        out.append(scale)
        if 3 * scale > EXP_OVERFLOW[dtype]:
            break
    return tuple(out)


def _length(space: SearchSpace):
    return st.sampled_from(space.lengths)


@st.composite
def padding_masks(draw, batch: int, tk: int):
    """Per batch item, how many keys are real: at the end ("end": the last Tk - valid are padding) or the start
    ("start": valid = 1 leaves the last key as the only real one); valid = 0 pads every key (fully masked rows)."""
    valid = draw(st.lists(st.integers(0, tk).map(lambda v, tk=tk: tk - v), min_size=batch, max_size=batch))
    return {"valid": valid, "side": draw(st.sampled_from(("end", "start")))}


@st.composite
def attn_masks(draw, kinds: tuple[str, ...], tq: int):
    """Bool or additive, shared (Tq, Tk) or per (batch, head), a random pattern of a density, fully masked rows."""
    spec = {"kind": draw(st.sampled_from(kinds)), "per": draw(st.sampled_from(("shared", "batch_head"))),
            "density": draw(st.sampled_from((1.0, 0.5, 0.1))),
            "empty_rows": draw(st.lists(st.integers(0, tq - 1), max_size=2, unique=True)),
            "seed": draw(st.integers(0, 3))}
    if spec["kind"] == "additive":
        spec["magnitude"] = draw(st.sampled_from((1.0, 10.0)))
    return spec


@st.composite
def examples(draw, space: SearchSpace):
    """One search example (the dict :func:`mha_harness.conformance.search_examples.build` turns into inputs)."""
    dtype = draw(st.sampled_from(space.dtypes))
    form = draw(st.sampled_from(space.forms))
    batch = draw(st.integers(1, space.max_batch))
    tq = draw(_length(space))
    tk = draw(_length(space)) if space.cross_attention and form != "self" else tq
    if tq > tk and not space.more_queries_than_keys:  # a layer that needs Tq <= Tk: the longer one is the keys
        tq, tk = tk, tq
    heads = draw(st.sampled_from(HEADS))
    kv_heads = draw(st.sampled_from([heads] + [k for k in range(heads - 1, 0, -1) if heads % k == 0])) \
        if space.grouped_query else heads
    example = {
        "dtype": dtype, "form": form, "batch": batch, "tq": tq, "tk": tk, "heads": heads, "kv_heads": kv_heads,
        "d_head": draw(head_widths(space)),
        "bias": draw(st.booleans()) if space.bias else False,
        "causal": draw(st.sampled_from(space.causal)),
        "padding": draw(st.none() | padding_masks(batch, tk)) if space.padding else None,
        "attn_mask": draw(st.none() | attn_masks(space.mask_kinds, tq)) if space.mask_kinds else None,
        "logit_scale": draw(st.sampled_from(logit_scales(dtype))),
        "cut": draw(st.integers(0, tk - 1).map(lambda c, tk=tk: tk - 1 - c)),
        "poison": draw(st.sampled_from(space.poisons)),
        "gradients": draw(st.booleans()) if space.gradients else False,
        # mostly well-formed: one draw in five also makes one bad call
        "malformed": draw(st.integers(0, 4 * len(_BAD_CALLS) - 1).map(
            lambda m: None if m < 3 * len(_BAD_CALLS) else m - 3 * len(_BAD_CALLS))),
        "seed": draw(st.integers(0, 3)),
    }
    if space.decode_step and tq <= tk and draw(st.booleans()):  # absent when False: saved examples keep their ids
        example["decode_step"] = True
    if space.qk_norms:  # drawn only for a backend that declares a norm (absent when None, as decode_step)
        norm = draw(st.sampled_from((None, *space.qk_norms)))
        if norm:
            example["qk_norm"] = norm
    if space.rotary and example["d_head"] % 2 == 0:  # rotary turns pairs of features (absent when None)
        kind = draw(st.sampled_from((None, *space.rotary)))
        if kind:
            example["rotary"] = kind
            example["rotary_base"] = draw(st.sampled_from(COMMON_ROTARY_BASES))
            if space.partial_rotary and example["d_head"] >= 4:  # an even width below d_head, or all (absent)
                width = draw(st.sampled_from((None, *range(2, example["d_head"], 2))))
                if width:
                    example["rotary_dims"] = width
            if space.rotary_scalings:
                scaling = draw(st.sampled_from((None, *space.rotary_scalings)))
                if scaling:
                    example["rotary_scaling"] = scaling
    if space.sliding_window:  # a window of 1 .. Tk keys, or none (absent)
        window = draw(st.none() | st.integers(1, tk))
        if window:
            example["sliding_window"] = window
    if space.alibi:  # a declared ALiBi bias, or none (absent)
        alibi = draw(st.sampled_from((None, *space.alibi)))
        if alibi:
            example["alibi"] = alibi
    return example


def head_widths(space: SearchSpace):
    """d_head from 1 to ``space.max_d_head``, in multiples of ``space.d_head_multiple`` (the multiple and its double
    where it is larger than max_d_head)."""
    m = space.d_head_multiple
    return st.integers(1, max(2, space.max_d_head // m)).map(lambda k: k * m)


def _count_bad_calls() -> int:
    import numpy as np

    from mha_harness.contract.api import AttentionInputs
    x = np.zeros((2, 6, 4))
    return len(bad_calls(AttentionInputs(x, x, x)))


_BAD_CALLS = range(_count_bad_calls())
