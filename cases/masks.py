"""Masking: causal and padding leakage, attention masks, fully masked rows."""
from __future__ import annotations

import numpy as np

from mha_harness.cases._fixtures import (
    ALL_FORMS,
    additive_mask_from,
    causal_output_variants,
    causal_variants,
    cross_ok,
    form_inputs,
    key_limit,
    key_position_gradients,
    poison_kinds,
    random_allowed_mask,
    small_layer,
    with_keys_replaced,
)
from mha_harness.conformance.casekit import (
    FLOAT32_SIZED,
    CaseFailure,
    CaseSkipped,
    Measurement,
    assert_close,
    case,
    check_against_reference,
    expected_fully_masked_rows,
    gradient_mistake_hint,
    on_primary_dtype,
    precision_level_hint,
    primary_dtype,
    record_comparison,
    require,
    run,
    scores_fit_named,
    tolerance_for,
)
from mha_harness.conformance.diagnoses import CAP_AFTER_MASK, cap_after_mask_hint, mask_mistake
from mha_harness.conformance.gradient_diagnoses import DOUBLE_WHERE_TRAP
from mha_harness.contract.reference import empty_rows_as, logit_softcap, reference_attention
from mha_harness.contract.validation import causal_future_poison_allowed

#: the other reading of NaN in rows without a key: a layer that means zeros there, where NaN comes from a mistake
_NOT_MEANT = ("; if it means zeros there: an online softmax gets NaN from exp(m_old - m_new) with both -inf in a key "
              "block with no visible key (subtract 0 while a row has seen no key), a plain one from 0 / 0 (divide by "
              "max(sum, tiny))")


def _unchanged(before, after, rows, tol, what):
    """Rows of ``after`` must equal ``before`` within the tolerance (NaN counts as a change). Both are the
    backend's own outputs in one dtype: no precision explains a change, so the failure guesses none."""
    assert_close(after[:, rows], before[:, rows], tol, what, row_ids=rows, own_output=True)


#: how each gradient entry's input is called in each form (a self-form ``query`` entry is d/dx)
INPUT_NAMES = {"separate": {"key": "key", "value": "value"}, "shared_kv": {"key": "x_kv"}, "self": {"query": "x"},
               "kv_cache": {"sequence": "the sequence's input (x_kv's cached rows, then x_new)"}}


def _what_changed(form: str) -> str:
    """What a leakage case perturbs in each input form."""
    return {"separate": "keys/values", "shared_kv": "x_kv rows (keys and values)",
            "self": "x rows (their queries, keys and values)",
            "kv_cache": "x_kv rows (keys and values; in the new rows, x_new and their queries too)"}[form]


def _poison_verdict(failure: CaseFailure, poison: str, finite_unchanged, changed_finite: bool = False) -> CaseFailure:
    """The failure of a NaN/inf poison case, told apart from a leak: ``finite_unchanged()`` says whether random
    finite values at the same masked positions leave the output unchanged. Then the NaN/inf reached the output
    only as 0 * NaN in a dense P @ V (the masked weight is exactly 0), which is not a leak, and the message says
    so and points to the declaration, unless the changed outputs are finite (``changed_finite``): 0 * NaN in P @ V
    leaves NaN, so finite wrong values mean the poison entered a computation before the mask (a row maximum over
    scores masked by a where that later zeroes the row: a stranger's JAX layer), which the declaration does not
    cover; otherwise it is a leak whatever the values."""
    if poison == "random":
        return failure
    if not finite_unchanged():
        return CaseFailure(f"{failure}; the same positions set to random finite values change the output too: a "
                           "real leak, not only NaN/inf propagation", failure.max_error)
    value = "NaN" if poison == "nan" else "inf"
    if changed_finite:
        return CaseFailure(f"{failure}; the changed outputs are finite: {value} held by masked positions reached a "
                           f"computation before the mask, not only 0 * {value} in P @ V (which leaves {value}), e.g. "
                           "a row maximum or sum over scores the mask had not yet replaced, whose row a later where "
                           "then zeroes or rewrites; random finite values there leave the output unchanged, so only "
                           "non-finite ones show it. Mask the scores (where(mask, s, -inf)) before any reduction over "
                           "them; masked_poison_divergences does not cover this", failure.max_error)
    return CaseFailure(f"not a leak: {value} held by masked positions propagated through 0 * {value} (a dense P @ V "
                       "multiplies the masked weights, exactly 0, by the masked values); the same positions set to "
                       "random finite values leave the output unchanged. A kernel of your own can zero the values "
                       "of keys no query may see (padded keys) before P @ V; a key hidden only from some queries "
                       "(causal, attn_mask) cannot be zeroed for all, so a dense P @ V there, and a library or model "
                       "layer you wrap as it is, needs the declaration: "
                       "divergences = masked_poison_divergences(\"why\", cases=[...]) from "
                       "mha_harness.toolkit.divergences, naming the cases that fail so (without cases= it covers the "
                       "causal and the padding case, and one that passes is an unexpected pass; docs/plugins.md, "
                       "'Good to know'). The strict check said: "
                       f"{failure}", failure.max_error)


def _poisoned(variants, *, cached_rows: bool = False):
    """Each variant with every poison the backend's input form can carry (one x: random values only; a KV-cache
    step: NaN/inf too where the case poisons only cached rows with them, ``cached_rows``)."""
    return lambda backend: [{**v, "poison": kind} for v in variants(backend)
                            for kind in poison_kinds(backend.capabilities.inputs, cached_rows=cached_rows)]


@case(requires=("causal",), variants=_poisoned(causal_variants), forms=ALL_FORMS)
def check_causal_mask_blocks_future_keys(backend, *, form, dtype, alignment, variant, seq, tk, poison):
    """Changing keys/values after position i (to large random values, NaN or inf) leaves every output that
    may only see keys <= i unchanged: no future information leaks through the causal mask, not even through
    the softmax denominator. With one x (self-attention) x itself is changed after i, which moves the
    queries, keys and values there; with shared K/V, x_kv is changed. The layer has biases where declared (a
    key or value bias is one more path to the future), as in check_causal_output_matches_reference, whose compiled
    programs a backend compiling per shape so reuses."""
    params = small_layer(backend, bias=True)
    inputs = form_inputs(form, params.config, 2, seq, tk, causal=alignment)
    require(backend, *inputs.features(), f"dtype:{dtype}")
    loaded = backend.load(params, dtype=dtype)
    base = run(backend, params, inputs, dtype, loaded=loaded).output
    _, tol = tolerance_for(params, inputs, dtype)
    worst = 0.0
    for cut in sorted(set(future_cuts(alignment, seq, tk)) | {tk - 2}):  # tk - 2: only the last key is future
        rows = [r for r in range(seq) if 0 <= key_limit(alignment, r, seq, tk) <= cut]
        future = (slice(None), slice(cut + 1, None))
        changed = with_keys_replaced(inputs, future, poison)
        with causal_future_poison_allowed():  # later queries see the poison; rows <= cut must not
            poisoned = run(backend, params, changed, dtype, loaded=loaded).output
        try:
            _unchanged(base, poisoned, rows, tol,
                       f"{alignment} causal leak: {_what_changed(form)} after position {cut} set to {poison} changed "
                       "the output")
        except CaseFailure as failure:
            if poison == "random":
                blind = np.zeros(base.shape[:2], bool)
                blind[:, rows] = True
                failure = failure.with_hint(cap_after_mask_hint(poisoned, params, changed, rows=blind))
            def finite_unchanged(future=future, rows=rows):
                finite = run(backend, params, with_keys_replaced(inputs, future, "random"), dtype, loaded=loaded).output
                return bool(np.all(np.abs(finite[:, rows] - base[:, rows]) <= tol.bound))
            raise _poison_verdict(failure, poison, finite_unchanged,
                                  bool(np.all(np.isfinite(poisoned[:, rows])))) from None
        worst = max(worst, float(np.max(np.abs(poisoned[:, rows] - base[:, rows]))))
    return Measurement(max_error=worst)


@case(requires=("causal",), variants=causal_output_variants, forms=ALL_FORMS)
def check_causal_output_matches_reference(backend, *, form, dtype, alignment, variant, seq, tk, rotary=None,
                                          rotary_base=10_000.0, qk_norm=None, kv_heads=None):
    """With a causal mask of the declared alignment (top-left, or bottom-right when Tq != Tk) the output
    equals the reference: the diagonal is kept, the future removed, and the alignment is the one declared. A layer
    that declares rotary embeddings or a q/k norm is checked with them under the mask too (the ``_with_features``
    variants: its rotary, norm and grouped-query heads, as a decoder layer runs them)."""
    params = small_layer(backend, bias=True, rotary=rotary, rotary_base=rotary_base, qk_norm=qk_norm,
                         num_kv_heads=kv_heads)
    inputs = form_inputs(form, params.config, 2, seq, tk, causal=alignment)
    try:
        return Measurement(max_error=check_against_reference(backend, params, inputs, dtype,
                                                             what=f"{alignment} causal output"))
    except CaseFailure as failure:
        raise failure.with_hint(_empty_causal_rows_hint(backend, params, inputs, dtype)) from None


def _empty_causal_rows_hint(backend, params, inputs, dtype: str) -> str:
    """A message suffix when the output is NaN on exactly the rows a bottom-right mask leaves without a key (Tq > Tk)
    and finite elsewhere: the kernel's convention for a row with no key, which the backend can declare; "" otherwise
    or while a declared convention is verified. Calls the backend once more, on a failure only."""
    empty = _rows_without_keys(inputs.causal, inputs.tq, inputs.tk)
    if not empty or expected_fully_masked_rows() != "zeros":
        return ""
    try:
        got = np.asarray(run(backend, params, inputs, dtype).output, np.float64)
    except Exception:  # noqa: BLE001 - a diagnosis only: the failure is reported as it is
        return ""
    nan_rows = np.isnan(got).all(axis=-1)
    if not (nan_rows[:, empty].all() and np.isfinite(np.delete(got, empty, axis=1)).all()):
        return ""
    return (f"; rows {empty[0]}..{empty[-1]} see no key ({inputs.causal}, Tq {inputs.tq} > Tk {inputs.tk}) and output "
            "NaN, the other rows are finite: a row with no key outputs NaN (softmax of a row of -inf); if that is the "
            "kernel's convention, declare it: divergences = nan_fully_masked_divergences(\"why\") from "
            f"mha_harness.toolkit.divergences (it covers this variant and the fully-masked-rows case){_NOT_MEANT}")


@case(requires=("causal", "gradients"), variants=causal_variants, forms=ALL_FORMS)
def check_causal_jacobian_zero_for_future_inputs(backend, *, form, dtype, alignment, variant, seq, tk):
    """The Jacobian of outputs at positions <= i with respect to keys and values after i is exactly zero
    (with one x: with respect to x after i; with shared K/V: with respect to x_kv after i). A failure also says
    which of the call's gradients are wrong against the reference and where that places the error: a backward
    that ignores the causal mask is named so, one with a bug elsewhere that makes a gradient depend on the future
    (dV from P where P^T belongs) is placed where it is, and a forward that is itself wrong (a mask read inverted)
    is named instead of the backward."""
    params = small_layer(backend)
    inputs = form_inputs(form, params.config, 2, seq, tk, causal=alignment)
    require(backend, *inputs.features(), f"dtype:{dtype}")
    loaded = backend.load(params, dtype=dtype)
    for cut in future_cuts(alignment, seq, tk):
        rows = [r for r in range(seq) if 0 <= key_limit(alignment, r, seq, tk) <= cut]
        cotangent = np.zeros((2, seq, params.config.d_model))
        cotangent[:, rows] = np.random.default_rng(5).standard_normal((2, len(rows), params.config.d_model))
        grads = loaded.vjp(inputs, cotangent)
        for name, by_key in key_position_gradients(grads, form).items():
            future = by_key[:, cut + 1:]
            if np.any(future != 0):
                b, t, f = np.argwhere(future != 0)[0]
                shown = INPUT_NAMES[form][name]
                seen = f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]}..{rows[-1]}"
                wrt = shown if " " not in shown else f"({shown})"  # a phrase goes in parentheses
                what = (f"d(output {seen}, which may see keys <= {cut})/d{wrt} at position {cut + 1 + t} is "
                        f"{future[b, t, f]:.3g} (batch {b}, feature {f}); expected exactly 0")
                if not np.isfinite(future[b, t, f]):
                    raise CaseFailure(f"{alignment} causal gradients not finite: {what}"
                                      f"{_nan_backward_hint(seq, tk, alignment, loaded, inputs)}")
                hint = gradient_mistake_hint(grads, params, inputs, cotangent, dtype, form,
                                             forward=lambda: loaded.forward(inputs).output)
                raise CaseFailure(f"{alignment} causal leak in gradients: {what}").with_hint(*hint)
    return Measurement(max_error=0.0)


def _nan_backward_hint(tq: int, tk: int, alignment: str, loaded=None, inputs=None) -> str:
    """Why a causal backward's gradients can be NaN without a leak: rows that see no key (bottom-right, Tq > Tk)
    whose output is NaN spread NaN through the backward into every key's gradient (0 * NaN), whatever the cotangent;
    "" when no row is without a key. When the forward (``loaded`` on ``inputs``) is finite on those rows, the NaN is
    the backward's own: a where that selects 0 over a NaN branch still differentiates that branch (a stranger's JAX
    layer passed every forward case so)."""
    empty = _rows_without_keys(alignment, tq, tk)
    if not empty:
        return ""
    if loaded is not None:
        try:
            finite = bool(np.all(np.isfinite(np.asarray(loaded.forward(inputs).output, np.float64)[:, empty])))
        except Exception:  # noqa: BLE001 - a diagnosis only: the failure is reported as it is
            finite = False
        if finite:
            return (f"; rows {empty[0]}..{empty[-1]} see no key and the forward's output there is finite: the NaN is "
                    f"the backward's own. {DOUBLE_WHERE_TRAP}")
    return (f"; rows {empty[0]}..{empty[-1]} see no key: a layer whose rows with no key output NaN (softmax of a row "
            "of -inf) spreads NaN through its backward into every key's gradient (0 * NaN), which hides whether the "
            "mask holds there; this case checks a backward whose empty rows give zeros (torch's SDPA kernels do; "
            "nn.MultiheadAttention takes that path with need_weights=False)")


def _rows_without_keys(alignment: str, tq: int, tk: int) -> list[int]:
    """The query rows the causal mask of ``alignment`` leaves without a key (bottom-right with Tq > Tk)."""
    return [r for r in range(tq) if key_limit(alignment, r, tq, tk) < 0]


def future_cuts(alignment: str, tq: int, tk: int) -> list[int]:
    """The key positions ``cut`` at which the causal Jacobian is checked: the last key seen by the first query that
    sees any and has later keys, and by the middle one of those queries. Taken from the alignment's key limits, so
    every variant checks something: under bottom-right with 5 queries and 65 keys the first query sees keys up to
    60 (fixed cuts 0 and tk // 2 selected no query there, and a backward that ignored the mask passed)."""
    limits = [key_limit(alignment, r, tq, tk) for r in range(tq)]
    seeing = [limit for limit in limits if 0 <= limit < tk - 1]
    if not seeing:
        raise AssertionError(f"{alignment} causal variant {tq} x {tk}: no query sees some keys but not all")
    return sorted({seeing[0], seeing[len(seeing) // 2]})


def _padding(batch: int, tk: int) -> np.ndarray:
    """Item 0 unpadded, item 1 left-padded (its first half: batched prompts of a decoder are), item 2 right-padded
    to its first key (True = padding). Under top-left causal, right padding is hidden from every real query by the
    causal mask already (query i sees keys <= i), so an always-causal layer that ignored the padding mask passed on
    right padding alone; item 1's real queries see its padded keys."""
    pos = np.arange(tk)
    mask = np.stack([pos < 0, pos < tk // 2, pos >= 1])
    return mask[:batch]


#: new tokens of a KV-cache step in the padding cases: 3 queries against the PADDING_KEYS keys, so the left-padded
#: item's padded keys are cached rows (batched decoding of prompts of different lengths)
PADDING_NEW_TOKENS = 3
#: keys of the padding cases' call: across three 128-key blocks (FlexAttention's block size, and many 16-128-key
#: blocks of a tiled kernel), so items 1 and 2 have whole blocks of padding that item 0 does not: a block mask built
#: for one item and shared by the batch (create_block_mask(B=None) with a mask_mod that reads the batch index: an
#: outside user's FlexAttention layer passed every case at 10 keys, where one block is partly masked for every item)
#: lets them through
PADDING_KEYS = 300


#: queries of the padding output case's ``cross_attention`` variant: a decoder's few queries against an encoder's
#: PADDING_KEYS padded keys (Tq != Tk), where a mask built or sliced by the query length (``mask[:, :Tq]``, a
#: (Tq, Tq) mask) is wrong; at Tq = Tk it is right
PADDING_CROSS_QUERIES = 7


def _padding_call(form: str, config, mask: np.ndarray, tq: int | None = None):
    """The padding cases' call: one x of PADDING_KEYS positions (any form), or for a KV-cache step
    PADDING_NEW_TOKENS new tokens against them, or ``tq`` queries against them (cross-attention: no query is
    padded); and the (batch, Tq) mask of the queries at padded positions (not compared)."""
    tk = mask.shape[1]
    if tq is not None:
        return form_inputs(form, config, mask.shape[0], tq, tk, key_padding_mask=mask), np.zeros((len(mask), tq), bool)
    tq = PADDING_NEW_TOKENS if form == "kv_cache" else tk
    return form_inputs(form, config, mask.shape[0], tq, tk, key_padding_mask=mask), mask[:, tk - tq:]


def _padding_output_variants(backend):
    """The primary dtype at Tq = Tk (a KV-cache step: PADDING_NEW_TOKENS new tokens) and, where cross-attention
    is declared (not for a KV-cache step, whose call has Tq < Tk already), ``cross_attention``:
    PADDING_CROSS_QUERIES queries against the PADDING_KEYS keys."""
    out = on_primary_dtype(backend)
    if cross_ok(backend) and backend.capabilities.inputs != "kv_cache":
        out.append({**out[0], "variant": "cross_attention", "seq": PADDING_CROSS_QUERIES})
    return out


@case(requires=("key_padding_mask",), variants=_poisoned(on_primary_dtype, cached_rows=True), forms=ALL_FORMS)
def check_padding_mask_blocks_padded_keys(backend, *, form, dtype, poison):
    """Changing padded key/value positions (to large random values, NaN or inf) leaves the outputs of real queries
    unchanged, not even through the softmax denominator. Outputs at padded query positions are unspecified and
    not compared. With one x the padded positions of x are changed; with shared K/V those of x_kv; in a KV-cache
    step (3 new tokens, left padding in the cache) those of x_kv, NaN/inf in cached rows only."""
    params = small_layer(backend, bias=True)
    tk = PADDING_KEYS
    mask = _padding(3, tk)
    inputs, query_padded = _padding_call(form, params.config, mask)
    where = mask
    if form == "kv_cache" and poison != "random":  # NaN/inf only where no query is: the cached rows
        where = mask & (np.arange(tk) < tk - inputs.tq)[None, :]
    loaded = backend.load(params, dtype=dtype)
    base = run(backend, params, inputs, dtype, loaded=loaded).output
    _, tol = tolerance_for(params, inputs, dtype)
    changed = with_keys_replaced(inputs, where, poison)
    after = run(backend, params, changed, dtype, loaded=loaded).output
    real = ~query_padded[:, :, None]
    diff = np.where(real, np.abs(after - base), 0)
    bad = np.argwhere(real & ~(diff <= tol.bound))
    if np.isfinite(diff).all():
        record_comparison(float(np.max(diff)), tol.bound)
    if len(bad):
        b, t, f = bad[0]
        failure = CaseFailure(f"padding leak: padded {_what_changed(form)} set to {poison} changed the output of real "
                              "query "
                              f"(batch {b}, position {t}, feature {f}) from {base[b, t, f]:.6g} to "
                              f"{after[b, t, f]:.6g}; {tol.describe()}", max_error=float(np.nanmax(diff)))
        if poison == "random":
            failure = failure.with_hint(cap_after_mask_hint(after, params, changed, rows=~query_padded))

        def finite_unchanged():
            finite = run(backend, params, with_keys_replaced(inputs, where, "random"), dtype, loaded=loaded).output
            return bool(np.all(np.where(real, np.abs(finite - base), 0) <= tol.bound))
        raise _poison_verdict(failure, poison, finite_unchanged, bool(np.all(np.isfinite(np.where(real, after, 0)))))
    worst = float(np.max(diff))
    return Measurement(max_error=worst)


@case(requires=("key_padding_mask",), variants=_padding_output_variants, forms=ALL_FORMS)
def check_padding_mask_output_matches_reference(backend, *, form, dtype, variant=None, seq=None):
    """With a key padding mask (True = padding) the outputs of real queries equal the reference, at Tq = Tk and,
    with cross-attention (``cross_attention``: ``seq`` queries, none padded), at Tq < Tk."""
    params = small_layer(backend, bias=True)
    mask = _padding(3, PADDING_KEYS)
    inputs, query_padded = _padding_call(form, params.config, mask, tq=seq)
    got = run(backend, params, inputs, dtype).output
    expected, tol = tolerance_for(params, inputs, dtype)
    real = ~query_padded[:, :, None]
    try:
        return Measurement(max_error=assert_close(np.where(real, got, 0), np.where(real, expected, 0), tol,
                                                  "padding-masked output (real queries)"))
    except CaseFailure as failure:
        hint = mask_mistake(got, params, inputs, rows=~query_padded)
        raise (failure.with_hint(hint) if hint else
               scores_fit_named(failure, got, params, inputs, tol.bound, compare=~query_padded)) from None


def _mask_variants(backend):
    """Named variants ``square`` (8, 8) and, with cross-attention, ``more_keys`` (6, 11); mask shared or per head."""
    dtype = primary_dtype(backend)
    shapes = [("square", 8, 8)] + ([("more_keys", 6, 11)] if cross_ok(backend) else [])
    return [{"dtype": dtype, "variant": name, "seq": tq, "tk": tk, "per_head": per_head}
            for name, tq, tk in shapes for per_head in (False, True)]


def _keeps_a_visible_key(allowed: np.ndarray, backend) -> np.ndarray:
    """``allowed`` with key 0 kept in every row for an always-causal layer, whose causal mask can hide the one key a
    random row keeps (a row left with no key, in some head, is the fully-masked case's subject, not this one's: an
    outside user's Llama failed here on exactly those rows). Key 0 is visible to every row of these shapes."""
    if not backend.capabilities.always_causal:
        return allowed
    allowed = np.array(allowed)
    allowed[..., 0] = True
    return allowed


@case(requires=("bool_attn_mask",), variants=_mask_variants, forms=ALL_FORMS)
def check_bool_attn_mask_matches_reference(backend, *, form, dtype, variant, seq, tk, per_head):
    """An arbitrary boolean attn_mask (True = may attend), shared or per batch and head, gives the reference output."""
    params = small_layer(backend, bias=True)
    mask = random_allowed_mask(seq, tk)
    if per_head:
        mask = np.stack([[random_allowed_mask(seq, tk, seed=10 * b + h) for h in range(4)] for b in range(2)])
    mask = _keeps_a_visible_key(mask, backend)
    inputs = form_inputs(form, params.config, 2, seq, tk, attn_mask=mask)
    return Measurement(max_error=check_against_reference(backend, params, inputs, dtype, "bool-masked output"))


@case(requires=("additive_attn_mask",), variants=_mask_variants, forms=ALL_FORMS)
def check_additive_attn_mask_matches_reference(backend, *, form, dtype, variant, seq, tk, per_head):
    """A float attn_mask is added to the scaled scores (finite biases and -inf), giving the reference output."""
    params = small_layer(backend, bias=True)
    shape = (2, 4, seq, tk) if per_head else (seq, tk)
    mask = additive_mask_from(_keeps_a_visible_key(np.broadcast_to(random_allowed_mask(seq, tk), shape), backend))
    inputs = form_inputs(form, params.config, 2, seq, tk, attn_mask=mask)
    return Measurement(max_error=check_against_reference(backend, params, inputs, dtype, "additive-masked output"))


def classify_fully_masked_rows(rows: np.ndarray, zero_out: np.ndarray, uniform_out: np.ndarray,
                               zero_bound: float, uniform_bound: float) -> str:
    """Name what a backend outputs for fully masked query rows: zeros (before W_o) or the uniform average of V
    when within the bound the tolerance rule gives the layer's dtype for that output (a bfloat16 layer's uniform
    rows are a bfloat16 computation of the average: a fixed float32-sized bound could never name them)."""
    if np.all(np.isnan(rows)):
        return "NaN"
    if np.any(np.isnan(rows)):
        return "partly NaN"
    if np.allclose(rows, zero_out, rtol=0, atol=zero_bound):
        return "zeros"
    if np.allclose(rows, uniform_out, rtol=0, atol=uniform_bound):
        return "uniform average of V"
    return "other"


def _other_rows_detail(got: np.ndarray, far: float, uniform: np.ndarray, uniform_bound: float, params,
                       inputs, dtype: str, rows) -> str:
    """What fully masked rows that are neither zeros, NaN nor the uniform average of V are: how far (``far``) from
    the zero rows and from the uniform average (with its bound), and whether they equal the same rows with no mask at
    all (every key seen: the mask not applied to them, or read with the opposite polarity)."""
    got = np.asarray(got, np.float64)
    from_uniform = float(np.max(np.abs(got - uniform)))
    unmasked, unmasked_tol = tolerance_for(params, inputs.replace(key_padding_mask=None, attn_mask=None), dtype)
    if np.allclose(got, unmasked[rows], rtol=0, atol=unmasked_tol.bound):
        return (f" (up to {far:.3g} from the zero rows; they equal the same rows with no mask: every key is seen, "
                "so the mask is not applied to them, or is read with the opposite polarity)")
    if inputs.causal is not None:
        # zero queries (and no b_q) make every score 0: the uniform average of the keys the causal mask leaves
        flat = params if params.b_q is None else params.replace(b_q=np.zeros_like(params.b_q))
        visible, visible_tol = tolerance_for(flat, inputs.replace(key_padding_mask=None, attn_mask=None,
                                                                  query=np.zeros_like(inputs.query)), dtype)
        if np.allclose(got, visible[rows], rtol=0, atol=visible_tol.bound):
            return (f" (the uniform average of the keys the {inputs.causal} causal mask leaves, up to "
                    f"{from_uniform:.3g} from that of every key: the padding or attn_mask is a finite minimum while "
                    "the causal mask is -inf; the uniform-average convention averages every key, as one finite "
                    "minimum for both masks gives, so no declaration covers this: mask both alike)")
    return (f" (neither zeros, NaN nor the uniform average of V: up to {far:.3g} from the zero rows and "
            f"{from_uniform:.3g} from the uniform average of V, whose {dtype} bound is {uniform_bound:.3g}, and not "
            "the unmasked rows either)")


#: the ways a row can lose every key, each a separate variant: a backend may handle one and not another (a layer that
#: turns bool masks into "allowed" but adds a float mask outputs NaN for a row of -inf biases)
FULLY_MASKED_ROUTES = ("key_padding_mask", "bool_attn_mask", "additive_attn_mask")


def _fully_masked_variants(backend):
    """One variant per mask kind the backend declares (``route``) and dtype: a layer's masked value can differ by
    dtype (Hugging Face's eager layers add their dtype's most negative value, which their float32 softmax reads as
    -inf in a float64 call: NaN rows where float32 ones average, an outside user's Gemma layer)."""
    routes = [route for route in FULLY_MASKED_ROUTES if getattr(backend.capabilities, route)]
    return [{"dtype": dtype, "route": route} for dtype in backend.capabilities.dtypes for route in routes or [None]]


@case(requires=(), variants=_fully_masked_variants, forms=ALL_FORMS)
def check_fully_masked_rows_output_zeros(backend, *, form, dtype, route="key_padding_mask"):
    """A query row whose keys are all masked outputs zeros before W_o (the output row equals b_o), the
    flash-attention / SDPA convention, whichever mask masks them all (padding, a bool attn_mask, an additive one of
    -inf); the observed behaviour is named (zeros, NaN, uniform average of V)."""
    params = small_layer(backend, bias=True)
    tk = 6
    if route == "key_padding_mask":
        mask = np.zeros((2, tk), bool)
        mask[1] = True
        inputs = form_inputs(form, params.config, 2, tk, key_padding_mask=mask)
        rows = (1, slice(None))
    elif route in ("bool_attn_mask", "additive_attn_mask"):
        mask = np.ones((tk, tk), bool)
        mask[2] = False
        if route == "additive_attn_mask":  # finite biases elsewhere, -inf across row 2
            mask = np.where(mask, np.random.default_rng(5).standard_normal((tk, tk)), -np.inf)
        inputs = form_inputs(form, params.config, 2, tk, attn_mask=mask)
        rows = (slice(None), 2)
    elif route is None:
        raise CaseSkipped(f"{backend.name} declares none of {', '.join(FULLY_MASKED_ROUTES)}: no row can be masked")
    else:
        raise ValueError(f"route: got {route!r}; accepted: {', '.join(FULLY_MASKED_ROUTES)}")
    got = run(backend, params, inputs, dtype).output
    expected = reference_attention(params, inputs, empty_rows="zeros").output
    _, zero_tol = tolerance_for(params, inputs, dtype)
    # the uniform average over every key, as the reference's convention defines it: also for an always-causal layer,
    # whose finite minimum (Hugging Face's and flax's masks) masks causal and padded keys alike
    with empty_rows_as("uniform_average"):
        uniform, uniform_tol = tolerance_for(params, inputs, dtype)
    observed = classify_fully_masked_rows(got[rows], expected[rows], uniform[rows], zero_tol.bound, uniform_tol.bound)
    wanted = expected_fully_masked_rows()  # zeros, or the backend's declared alternative while it is verified
    if observed != wanted:
        builder = {"NaN": "nan_fully_masked_divergences", "uniform average of V": "uniform_fully_masked_divergences"}
        advice = (f"; if that is the kernel's convention, declare it: divergences = {builder[observed]}(\"why\") from "
                  "mha_harness.toolkit.divergences" + (_NOT_MEANT if observed == "NaN" else "")
                  if wanted == "zeros" and observed in builder else "")
        guess = ""
        if observed == "other":
            far = float(np.max(np.abs(np.asarray(got[rows], np.float64) - expected[rows])))  # from the zero rows
            advice = _other_rows_detail(got[rows], far, uniform[rows], uniform_tol.bound, params, inputs, dtype, rows)
            # zero rows off by a float32 rounding of b_o: a float64 call computing in float32 (an outside user's
            # float32 kernel, declared for the output cases only, read "neither zeros, NaN nor ..." here)
            guess = precision_level_hint(far, zero_tol)
            advice += guess + (" (here: a row without keys outputs b_o alone, so b_o, or the output projection "
                               "that adds it, is held in float32)" if FLOAT32_SIZED in guess else "")
        empty = np.zeros(got.shape[:2], bool)
        empty[rows] = True
        if observed in ("uniform average of V", "other") and cap_after_mask_hint(got, params, inputs, rows=empty):
            advice += ("; or, with the declared soft cap, " + CAP_AFTER_MASK.format(cap=logit_softcap())
                       + " (the float-mask and mask-composition cases name it where it is so)")
        raise CaseFailure(f"fully masked rows: expected {wanted}"
                          f"{' before W_o (output = b_o)' if wanted == 'zeros' else ''}, observed {observed}{advice}",
                          observed=observed, guess=guess)
    return Measurement(max_error=float(np.max(np.abs(got[rows] - expected[rows]))), observed=observed)


#: mask compositions: name -> (what is combined, the capabilities it needs besides the causal alignment)
COMPOSITIONS = {
    "causal_with_padding": ("key_padding_mask",),
    "causal_with_bool_mask": ("bool_attn_mask",),
    "causal_with_additive_mask": ("additive_attn_mask",),
    "padding_with_bool_mask": ("key_padding_mask", "bool_attn_mask"),
    "padding_with_additive_mask": ("key_padding_mask", "additive_attn_mask"),
}


def _composition_variants(backend):
    """Each composition the backend can run, in each declared alignment (causal ones), at ``square`` (8, 8) and,
    with cross-attention, ``more_keys`` (5, 11) shapes; every query keeps key 0, so no row is fully masked."""
    caps, dtype = backend.capabilities, primary_dtype(backend)
    shapes = [("square", 8, 8)] + ([("more_keys", 5, 11)] if cross_ok(backend) else [])
    out = []
    for name, needs in COMPOSITIONS.items():
        if not all(caps.has(n) for n in needs):
            continue
        alignments = caps.causal_alignments if name.startswith("causal") else (None,)
        out += [{"dtype": dtype, "variant": name, **({"alignment": a} if a else {}), "shape": shape,
                 "seq": tq, "tk": tk} for a in alignments for shape, tq, tk in shapes]
    if not out:  # one skip that says what would make a composition
        return [{"dtype": dtype, "unsupported": "declares no two masks to combine (a composition needs two of: a "
                 "causal alignment, key_padding_mask, bool_attn_mask, additive_attn_mask)"}]
    return out


def _composed_inputs(form, config, name, alignment, seq, tk) -> tuple:
    """Inputs with the named masks combined, and a description such as 'causal top-left with key_padding_mask'."""
    masks, parts = {}, []
    if alignment:
        masks["causal"] = alignment
        parts.append(f"causal {alignment}")
    if "padding" in name:
        # batch 0 ignores keys 1 and 2, batch 1 is right-padded. Under top-left causal, right padding is hidden
        # from every real query by the causal mask already (query i sees keys <= i), so a kernel that drops the
        # padding mask when causal is on would pass on right padding alone; keys 1 and 2 lie inside every causal
        # window, and key 0 stays, so no row is fully masked.
        ignored = np.arange(tk)[None, :] >= np.array([tk, tk // 2 + 1])[:, None]
        ignored[0, 1:3] = True
        masks["key_padding_mask"] = ignored
        parts.append("key_padding_mask")
    allowed = random_allowed_mask(seq, tk, seed=7)
    allowed[:, 0] = True
    if "bool" in name:
        masks["attn_mask"] = allowed
        parts.append("bool attn_mask")
    if "additive" in name:
        masks["attn_mask"] = np.where(allowed, np.random.default_rng(8).standard_normal((seq, tk)) * 2.0, -np.inf)
        parts.append("additive attn_mask")
    return form_inputs(form, config, 2, seq, tk, **masks), " with ".join(parts)


@case(requires=(), variants=_composition_variants, forms=ALL_FORMS)
def check_mask_compositions_match_reference(backend, *, form, dtype, variant, shape, seq, tk, alignment=None):
    """Two masks given together act as their intersection on the OUTPUT (no weights needed): causal (each
    declared alignment) with key padding, causal with a bool or an additive attn_mask, key padding with a bool or
    an additive attn_mask. A kernel that drops one mask when another is present is caught here."""
    params = small_layer(backend, bias=True)
    inputs, label = _composed_inputs(form, params.config, variant, alignment, seq, tk)
    got = run(backend, params, inputs, dtype).output
    expected, tol = tolerance_for(params, inputs, dtype)
    real = np.ones((2, seq, 1), bool)
    if inputs.key_padding_mask is not None and seq == tk:  # outputs at padded query positions are unspecified
        real = ~inputs.key_padding_mask[:, :, None]
    try:
        return Measurement(max_error=assert_close(np.where(real, got, 0), np.where(real, expected, 0), tol,
                                                  f"mask composition {label} output"))
    except CaseFailure as failure:
        hint = mask_mistake(got, params, inputs, rows=real[..., 0])
        raise (failure.with_hint(hint) if hint else
               scores_fit_named(failure, got, params, inputs, tol.bound, compare=real[..., 0])) from None
