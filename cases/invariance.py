"""Structural properties: permutation equivariance, batch independence, stability, determinism."""
from __future__ import annotations

import numpy as np

from mha_harness.cases._fixtures import (
    ALL_FORMS,
    CROSS_FORMS,
    SHORT_BATCH,
    SHORT_SEQ,
    form_inputs,
    short_layer,
    small_layer,
    with_each_input_changed,
)
from mha_harness.cases.agreement import GRID
from mha_harness.conformance.casekit import (
    CaseFailure,
    Measurement,
    assert_close,
    case,
    primary_dtype,
    run,
    scale_hint,
    scores_fit_named,
    tolerance_for,
)
from mha_harness.conformance.diagnoses import cap_after_mask_hint
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import score_scale

#: identical calls compared by check_repeated_calls_are_bitwise_identical
REPEATED_CALLS = 5


@case(requires=("non_causal",), forms=ALL_FORMS)
def check_self_attention_is_permutation_equivariant(backend, *, dtype):
    """Without masks, permuting the tokens of a self-attention input permutes the output rows the same way."""
    params = short_layer(backend)
    inputs = make_inputs(params.config, SHORT_BATCH, SHORT_SEQ, seed=12)
    perm = np.random.default_rng(12).permutation(SHORT_SEQ)
    x = inputs.query[:, perm]
    base = run(backend, params, inputs, dtype).output
    permuted = run(backend, params, inputs.replace(query=x, key=x, value=x), dtype).output
    _, tol = tolerance_for(params, inputs, dtype)
    return Measurement(max_error=assert_close(permuted, base[:, perm], tol, "permuted output", own_output=True))


@case(requires=("non_causal",), forms=CROSS_FORMS)  # needs cross_attention: run() requires it after the form check
def check_cross_attention_is_invariant_to_key_order(backend, *, form, dtype):
    """Without masks, permuting key/value positions together (with shared K/V: the rows of x_kv) leaves the
    cross-attention output unchanged. Not defined for one x, where keys cannot move without the queries."""
    params = small_layer(backend, bias=True)
    inputs = form_inputs(form, params.config, 2, 5, 11)
    perm = np.random.default_rng(13).permutation(11)
    base = run(backend, params, inputs, dtype).output
    key = inputs.key[:, perm]
    value = key if form == "shared_kv" else inputs.value[:, perm]
    shuffled = run(backend, params, inputs.replace(key=key, value=value), dtype).output
    _, tol = tolerance_for(params, inputs, dtype)
    return Measurement(max_error=assert_close(shuffled, base, tol, "output after permuting keys", own_output=True))


@case(forms=ALL_FORMS)
def check_batch_items_are_independent(backend, *, form, dtype):
    """Changing one batch item's inputs changes no other batch item's output."""
    params = short_layer(backend)
    inputs = form_inputs(form, params.config, SHORT_BATCH, SHORT_SEQ)  # items 0 and 2 around the changed item 1
    base = run(backend, params, inputs, dtype).output
    rng = np.random.default_rng(14)

    def new_item_1(array):
        array[1] = rng.standard_normal(array[1].shape) * 5

    after = run(backend, params, with_each_input_changed(inputs, new_item_1), dtype).output
    _, tol = tolerance_for(params, inputs, dtype)
    for b in (0, 2):
        assert_close(after[b:b + 1], base[b:b + 1], tol, f"batch item {b} after changing item 1",
                     own_output=True)
    if np.allclose(after[1], base[1]):
        raise CaseFailure("batch independence: changing batch item 1 did not change its own output")
    return Measurement()


#: named variants: ``short_rows`` (batch 2, Tk = 6, largest logit 1e4: exp overflows in any dtype),
#: ``long_rows`` (batch 1, Tk = 256, largest logit 120: in float32 exp(120) and sums of hundreds of exp(~85) overflow),
#: ``negative_rows`` (the long rows' shape, every score within a few units of -1000: exp(score) underflows to 0 in
#: every dtype, so a softmax that subtracts 0 or any fixed shift instead of the row's maximum, such as an online
#: softmax whose running maximum starts at 0, divides 0 by 0) and ``negative_rows_after_padded_keys`` (the same with
#: the first 200 keys padded, more than a tiled kernel's first key blocks: a running maximum left at a finite
#: placeholder by an all-masked block meets scores far below it, exp(placeholder - m) overflows; backends that take a
#: key padding mask). A negative variant's largest entry is the offset.
LARGE_LOGITS = {"short_rows": (2, 6, 1e4), "long_rows": (1, 256, 120.0), "negative_rows": (1, 256, -1000.0),
                "negative_rows_after_padded_keys": (1, 256, -1000.0)}
#: the largest logit of the control call a large-logit failure is compared with: the same layer and inputs with
#: its scores of order 1 (the negative variants' control: every score near -1, within 4)
ORDINARY_LOGIT = 4.0
#: the keys padded in ``negative_rows_after_padded_keys``
NEGATIVE_ROWS_PADDED_KEYS = 200


def _large_logit_variants(backend):
    limit = backend.capabilities.max_seq_len
    return [{"dtype": primary_dtype(backend), "variant": name} for name, (_, length, _) in LARGE_LOGITS.items()
            if (not limit or length <= limit)
            and (name != "negative_rows_after_padded_keys" or backend.capabilities.key_padding_mask)]


def _scores_far_below_zero(params, inputs, offset: float, spread: float = 4.0):
    """(params, inputs) whose every score is ``offset`` plus a term of at most ``spread`` in magnitude: input feature 0
    is 1 at every position, and in each head the first column of W_q and W_k reads only it (+s and -s, s^2 =
    -offset / scale, the layer's score scale: 1/sqrt(d_head) unless declared otherwise), while the other columns
    read only the remaining features, scaled so that their part of the scores stays within ``spread``. Each
    distinct input array is changed once, so the form is kept."""
    c = params.config
    d = c.d_head
    w_q, w_k = params.W_q.copy(), params.W_k.copy()
    firsts = [h * d for h in range(c.num_heads)]
    w_q[0], w_k[0] = 0.0, 0.0
    w_q[:, firsts], w_k[:, firsts] = 0.0, 0.0
    def feature_0_is_1(array):
        array[..., 0] = 1.0

    inputs = with_each_input_changed(inputs, feature_0_is_1)
    q = (inputs.query @ w_q).reshape(*inputs.query.shape[:2], c.num_heads, d)
    k = (inputs.key @ w_k).reshape(*inputs.key.shape[:2], c.num_heads, d)
    scale = score_scale(d)
    rest = np.abs(np.einsum("bqhd,bkhd->bhqk", q, k)).max() * scale
    shrink = np.sqrt(spread / rest)
    w_q, w_k = w_q * shrink, w_k * shrink
    s = np.sqrt(-offset / scale)
    w_q[0, firsts], w_k[0, firsts] = s, -s
    return params.replace(W_q=w_q, W_k=w_k), inputs


@case(variants=_large_logit_variants, forms=ALL_FORMS)
def check_large_logits_stay_finite_and_correct(backend, *, form, dtype, variant):
    """Large scores give finite outputs equal to the reference: softmax subtracts the row maximum. Short rows
    with logits ~1e4, and long rows (Tk = 256) with logits of order 100, where exp of one score or the sum of
    hundreds of them overflows float32 unless the row maximum is subtracted first; and rows whose every score is
    near -1000, where exp of every score underflows to 0 unless the row's own maximum is subtracted (not 0 or any
    fixed shift), also after a run of padded keys (a key block with no visible key must not leave a finite running
    maximum behind). Padded query rows are not compared."""
    batch, length, largest = LARGE_LOGITS[variant]
    config = AttentionConfig(16, 2)
    params = ordinary = make_params(config, seed=15, scale=1.0)
    masks = {}
    if variant == "negative_rows_after_padded_keys":
        padded = np.zeros((batch, length), bool)
        padded[:, :NEGATIVE_ROWS_PADDED_KEYS] = True
        masks["key_padding_mask"] = padded
    inputs = form_inputs(form, config, batch, length, **masks)
    if largest < 0:  # the control with ordinary logits: the same layer with its scores near -1, not -1000
        ordinary, _ = _scores_far_below_zero(params, inputs, -1.0)
        params, inputs = _scores_far_below_zero(params, inputs, largest)
        what = f"output with every score near {largest:g} over {length} keys" + (
            f", the first {NEGATIVE_ROWS_PADDED_KEYS} padded" if masks else "")
        fix = ("softmax must subtract the row's own maximum: exp(score - 0), or of any fixed shift, underflows when "
               "every score is far below 0 (an online softmax's running maximum must start at -inf"
               + (", and a key block with no visible key must leave it at -inf" if masks else "") + ")")
    else:
        d = config.d_head
        q = (inputs.query @ params.W_q).reshape(batch, length, 2, d)
        k = (inputs.key @ params.W_k).reshape(batch, length, 2, d)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) * score_scale(d)
        boost, calm = (np.sqrt(logit / np.abs(scores).max()) for logit in (largest, ORDINARY_LOGIT))
        params = params.replace(W_q=params.W_q * boost, W_k=params.W_k * boost)
        ordinary = ordinary.replace(W_q=ordinary.W_q * calm, W_k=ordinary.W_k * calm)
        what = f"output with logits up to {largest:g} over {length} keys"
        fix = "softmax must subtract the row maximum"
    real = ~masks["key_padding_mask"][0] if masks and inputs.tq == length else None  # padded queries: unspecified
    got, whole, expected, tol = _output_on_rows(backend, params, inputs, dtype, real)
    if not np.all(np.isfinite(got)):
        failure = CaseFailure(f"{what} has {int(np.sum(~np.isfinite(got)))} non-finite entries")
        _wrong_with_ordinary_logits(backend, ordinary, inputs, dtype, real, failure)
        raise CaseFailure(f"numerical stability: {failure}; {fix}")
    try:
        return Measurement(max_error=assert_close(got, expected, tol, what))
    except CaseFailure as failure:
        diagnosis = scale_hint(whole, params, inputs, tol.bound)
        if diagnosis:  # right for another scale: a scale bug (check_scores_scaled_by_sqrt_d_head), no overflow
            raise CaseFailure(f"{failure}{diagnosis}: a scale bug, not an {'underflow' if largest < 0 else 'overflow'}",
                              failure.max_error, diagnosis=diagnosis.removeprefix("; ").strip()) from None
        fitted = scores_fit_named(failure, whole, params, inputs, tol.bound,
                                  compare=None if real is None else np.broadcast_to(real, whole.shape[:2]))
        if fitted is not failure:  # right for another soft cap or scale on the scores: no overflow either
            raise fitted from None
        capped = cap_after_mask_hint(whole, params, inputs,
                                     rows=None if real is None else np.broadcast_to(real, whole.shape[:2]))
        if capped:  # a declared cap taken after the padding mask: the padded keys' scores are -c like every other
            raise failure.with_hint(capped) from None
        _wrong_with_ordinary_logits(backend, ordinary, inputs, dtype, real, failure)
        why = ("an overflowing normaliser gives wrong finite values; " if largest > 0 else "")
        raise CaseFailure(f"numerical stability: {failure}; {fix} ({why}with ordinary logits the output is right)",
                          failure.max_error) from None


#: what a run of padded keys that breaks a layer whatever its logits says about a tiled kernel
PADDED_RUN_BREAKS_STATE = ("a key block with no visible key corrupts the online softmax's running state: while a row "
                           "has seen no key its running maximum is -inf, and exp(m_old - m_new) with both -inf is NaN "
                           "(subtract 0 instead, or skip the block): the block must leave the maximum at -inf and the "
                           "accumulator and row sum untouched")


def _wrong_with_ordinary_logits(backend, ordinary, inputs, dtype, real, failure: CaseFailure) -> None:
    """Raise ``failure`` as another bug's when the same call with the ``ordinary`` layer (scores of order 1) is wrong
    too, or not finite: the large logits then are not what breaks it, and the max-subtraction advice would send the
    user after the wrong fix (a stranger's layer that added its mask after the softmax got NaN here, with ordinary
    logits as well). With padded keys, when the ordinary call with only its first key padded is right, the run of
    padded keys is what breaks it, and the failure says so (:data:`PADDED_RUN_BREAKS_STATE`; a stranger's flash
    kernel NaN after a fully masked key block was sent to the other cases, none of which pad a whole block).
    Returns when the ordinary call is right."""
    try:
        _assert_right_on_rows(backend, ordinary, inputs, dtype, real, "output with ordinary logits")
    except CaseFailure as wrong_anyway:  # wrong without large logits too: another bug, which other cases name
        also = (f"{failure.without_guess()}; the output is also wrong with ordinary logits (largest "
                f"{ORDINARY_LOGIT:g}: {wrong_anyway.without_guess()})")
        if inputs.key_padding_mask is not None and _right_with_one_padded_key(backend, ordinary, inputs, dtype):
            run = int(inputs.key_padding_mask[0].sum())
            raise CaseFailure(f"{also}, yet right with only its first key padded: the run of {run} padded keys breaks "
                              f"it, not the logits; {PADDED_RUN_BREAKS_STATE}", failure.max_error,
                              diagnosis=PADDED_RUN_BREAKS_STATE) from None
        raise CaseFailure(f"{also}: not a large-logit problem, see the other cases' failures",
                          failure.max_error) from None


def _right_with_one_padded_key(backend, ordinary, inputs, dtype) -> bool:
    """Whether the ``ordinary`` layer's call with only the first key padded (no key block without a visible key) is
    right on its real query rows."""
    one = np.zeros_like(inputs.key_padding_mask)
    one[:, 0] = True
    call = inputs.replace(key_padding_mask=one)
    try:
        _assert_right_on_rows(backend, ordinary, call, dtype, ~one[0] if call.tq == one.shape[1] else None,
                              "output with one padded key")
    except CaseFailure:
        return False
    return True


def _assert_right_on_rows(backend, params, inputs, dtype, real, what: str) -> None:
    """Fail (CaseFailure, described as ``what``) unless one call's output equals the reference on its ``real`` query
    rows (all when None), within the tolerance rule: the large-logits case's control calls."""
    got, _, expected, tol = _output_on_rows(backend, params, inputs, dtype, real)
    assert_close(got, expected, tol, what)


def _output_on_rows(backend, params, inputs, dtype, real=None):
    """(output, whole output, reference, tolerance) of one call, the output and reference on the ``real`` query
    rows only when given (a padded position's query row is unspecified)."""
    got = whole = run(backend, params, inputs, dtype).output
    expected, tol = tolerance_for(params, inputs, dtype)
    if real is not None:
        got, expected = got[:, real], expected[:, real]
    return got, whole, expected, tol


@case(variants=lambda b: [{"dtype": d} for d in b.capabilities.dtypes], forms=ALL_FORMS)
def check_repeated_calls_are_bitwise_identical(backend, *, form, dtype):
    """Five identical forward calls on one loaded layer, each after a call on other inputs of the same shape
    (so a stale cache, a buffer reused across calls or state that drifts from call to call shows), return
    identical bits. The layer and inputs have the shape of the grid's ``eight_heads`` row (T = 64: more than one
    32-row tile, so work split across tiles or threads shows), whose compiled program a backend compiling per shape
    reuses instead of compiling one more per dtype."""
    batch, heads, d_head, seq, _, _, _ = GRID["eight_heads"]
    params = small_layer(backend, d_model=heads * d_head, num_heads=heads)
    inputs = form_inputs(form, params.config, batch, seq)
    other = form_inputs(form, params.config, batch, seq, seed=2)
    loaded = backend.load(params, dtype=dtype)
    first = run(backend, params, inputs, dtype, loaded=loaded).output
    for call in range(2, REPEATED_CALLS + 1):
        run(backend, params, other, dtype, loaded=loaded)
        again = run(backend, params, inputs, dtype, loaded=loaded).output
        if not np.array_equal(first, again, equal_nan=True):
            diff = np.abs(first - again)
            idx = np.unravel_index(int(np.nanargmax(diff)), diff.shape)
            raise CaseFailure(f"determinism: call {call} of {REPEATED_CALLS} identical calls (each after a call on "
                              f"other inputs) differs from the first at (batch, position, feature) "
                              f"{tuple(map(int, idx))}: {first[idx]!r} vs {again[idx]!r}",
                              max_error=float(np.nanmax(diff)))
    return Measurement(max_error=0.0)
