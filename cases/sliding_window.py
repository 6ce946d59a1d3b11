"""Layers with a sliding window (``Capabilities.sliding_window``, ``AttentionConfig.sliding_window = w``: Mistral's,
Gemma's and Qwen 2's local layers): each query sees only its own position and the w - 1 before it."""
from __future__ import annotations

from mha_harness.cases._fixtures import ALL_FORMS, form_inputs, small_layer, with_keys_replaced
from mha_harness.cases.masks import _unchanged
from mha_harness.conformance.casekit import (
    CaseFailure,
    Measurement,
    case,
    check_against_reference,
    primary_dtype,
    require,
    run,
    tolerance_for,
)
from mha_harness.contract.conventions import BOTTOM_RIGHT, window_offset
from mha_harness.contract.window_diagnoses import window_hint
from mha_harness.toolkit.masks import padding_mask

#: name: (batch, heads, key/value heads or None, d_head, Tq, Tk, window, causal, biases, real lengths or None):
#: Mistral's layer (grouped-query heads, causal, T three windows long); 12 new queries against 28 cached positions
#: (where a window counted back from a query's index in the call instead of its position differs from no window); a
#: window of one key (each query sees only itself); a window without the causal mask (flash-attn's
#: window_size=(w - 1, -1): only the keys behind it hidden); and a batch whose second sequence is right-padded (the
#: window and the padding mask together, every row keeping a real key)
WINDOW_ROWS = {
    "mistral_grouped_query": (2, 4, 2, 16, 48, 48, 16, True, False, None),
    "new_queries_against_long_cache": (1, 2, None, 16, 12, 40, 8, True, True, None),
    "window_of_one_key": (1, 2, None, 8, 12, 12, 1, True, False, None),
    "without_causal_mask": (2, 2, None, 16, 24, 24, 8, False, True, None),
    "with_key_padding": (2, 2, None, 16, 32, 32, 8, True, True, (32, 28)),
}
#: the row run in every declared dtype (the others run in the primary one)
WINDOW_FIRST_ROW = "mistral_grouped_query"
#: the leak case's layer: a window of 8 keys over 32 positions, causal
LEAK_WINDOW, LEAK_SEQ = 8, 32


def _alignment(backend) -> str:
    """The causal alignment the window's causal rows use: bottom-right where declared (the one a window is used
    with), else the first declared (Tq = Tk rows are the same in both)."""
    declared = backend.capabilities.causal_alignments
    return BOTTOM_RIGHT if BOTTOM_RIGHT in declared or not declared else declared[0]


def _window_variants(backend):
    if not backend.capabilities.sliding_window:
        return [{"unsupported": "does not declare sliding_window (Capabilities.sliding_window: a layer built with "
                                "config.sliding_window, whose queries see only the keys of the last w positions)"}]
    # Mistral's row in every declared dtype, the others in the primary one (a window is a mask: its dtypes differ
    # only by rounding, which the first row covers; a backend compiling per shape compiles four programs, not twenty)
    primary = primary_dtype(backend)
    return ([{"dtype": dtype, "variant": WINDOW_FIRST_ROW} for dtype in backend.capabilities.dtypes]
            + [{"dtype": primary, "variant": name} for name in WINDOW_ROWS if name != WINDOW_FIRST_ROW])


@case(variants=_window_variants, forms=ALL_FORMS)
def check_sliding_window_output_matches_reference(backend, *, form, dtype, variant):
    """A layer built with a sliding window of w keys (``config.sliding_window``) gives the reference's output: each
    query, at position p, sees only the keys at p - w + 1 .. p (on top of the causal, padding and other masks), with
    grouped-query heads (in every declared dtype), new queries against a cache longer than the window, a window of one
    key, a window without the causal mask (the keys after p still seen) and a right-padded sequence."""
    batch, heads, kv_heads, d_head, tq, tk, window, causal, bias, lengths = WINDOW_ROWS[variant]
    params = small_layer(backend, bias=bias, num_kv_heads=kv_heads, d_model=heads * d_head, num_heads=heads,
                         sliding_window=window)
    masks = {"causal": _alignment(backend)} if causal else {}
    if lengths is not None:
        masks["key_padding_mask"] = padding_mask(lengths, tk)
    inputs = form_inputs(form, params.config, batch, tq, tk, **masks)
    require(backend, *inputs.features(), f"dtype:{dtype}")
    return Measurement(max_error=check_against_reference(backend, params, inputs, dtype,
                                                         what=f"sliding window of {window} ({variant})"))


def _leak_variants(backend):
    if not backend.capabilities.sliding_window:
        return _window_variants(backend)
    return [{"dtype": primary_dtype(backend)}]


@case(variants=_leak_variants, forms=ALL_FORMS)
def check_sliding_window_hides_keys_behind_it(backend, *, form, dtype):
    """Changing the keys/values at or before position c (to large random values) leaves unchanged every output whose
    query, at position p, has c behind its window of w keys (c <= p - w): nothing behind the window reaches a query,
    not even through the softmax denominator. A window one key too wide, or one not applied, changes those rows."""
    params = small_layer(backend, bias=True, sliding_window=LEAK_WINDOW)
    inputs = form_inputs(form, params.config, 2, LEAK_SEQ, LEAK_SEQ, causal=_alignment(backend))
    require(backend, *inputs.features(), f"dtype:{dtype}")
    loaded = backend.load(params, dtype=dtype)
    base = run(backend, params, inputs, dtype, loaded=loaded).output
    _, tol = tolerance_for(params, inputs, dtype)
    offset = window_offset(inputs.causal, LEAK_SEQ, LEAK_SEQ)
    worst = 0.0
    for cut in (0, LEAK_WINDOW - 1, 2 * LEAK_WINDOW, LEAK_SEQ - LEAK_WINDOW - 1):
        rows = [r for r in range(LEAK_SEQ) if cut <= r + offset - LEAK_WINDOW]
        changed = run(backend, params, with_keys_replaced(inputs, (slice(None), slice(0, cut + 1)), "random"), dtype,
                      loaded=loaded).output
        try:
            _unchanged(base, changed, rows, tol, f"sliding window leak: keys at positions 0..{cut}, behind the "
                       f"window of {LEAK_WINDOW} of rows {rows[0]}..{rows[-1]}, set to large random values changed "
                       "those rows")
        except CaseFailure as failure:
            raise failure.with_hint(window_hint(base, params, inputs, tol.bound)) from None
        worst = max(worst, float(abs(changed[:, rows] - base[:, rows]).max()))
    return Measurement(max_error=worst)
