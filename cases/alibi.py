"""Layers with ALiBi (``Capabilities.alibi``, ``AttentionConfig.alibi``: BLOOM's, MPT's, flash-attn's
``alibi_slopes``): each head's scores biased by the distance between query and key positions, with the paper's
slopes."""
from __future__ import annotations

from mha_harness.cases._fixtures import ALL_FORMS, form_inputs, small_layer
from mha_harness.conformance.casekit import Measurement, case, check_against_reference, primary_dtype, require
from mha_harness.contract.conventions import BOTTOM_RIGHT
from mha_harness.toolkit.masks import padding_mask

#: name: (batch, heads, key/value heads or None, d_head, Tq, Tk, causal, biases, real lengths or None): BLOOM's
#: layer (8 heads, slopes 1/2 .. 1/256, causal); 6 heads, not a power of two (the paper's interleaved slopes); every
#: key visible (where the two kinds differ: a key after the query is penalised by ``-m |p - s|``, favoured by
#: ``-m (p - s)``); 6 new queries against 40 positions with grouped-query heads, causal (the queries at the last
#: positions, one slope per query head); a cross-attention call without a mask (Tq < Tk, the queries at the last
#: positions in the symmetric bias); and a right-padded batch (the bias and the padding mask together)
ALIBI_ROWS = {
    "bloom_causal": (2, 8, None, 8, 48, 48, True, True, None),
    "six_heads": (1, 6, None, 8, 24, 24, True, False, None),
    "every_key_visible": (2, 4, None, 16, 20, 20, False, True, None),
    "new_queries_grouped_query": (1, 8, 2, 8, 6, 40, True, False, None),
    "cross_attention_more_keys": (2, 4, None, 8, 7, 19, False, True, None),
    "with_key_padding": (2, 4, None, 8, 16, 16, True, True, (16, 11)),
}
#: the row run in every declared dtype (the others run in the primary one)
ALIBI_FIRST_ROW = "bloom_causal"


def _alignment(backend) -> str:
    """The causal alignment of the causal rows: bottom-right where declared (the queries at the last positions, as
    ALiBi's positions are), else the first declared (Tq = Tk rows are the same in both)."""
    declared = backend.capabilities.causal_alignments
    return BOTTOM_RIGHT if BOTTOM_RIGHT in declared or not declared else declared[0]


def _alibi_variants(backend):
    caps = backend.capabilities
    if not caps.alibi:
        return [{"unsupported": "does not declare alibi (Capabilities.alibi: a layer built with config.alibi, whose "
                                "scores are biased by the distance between query and key positions)"}]
    primary = primary_dtype(backend)
    out = []
    for kind in caps.alibi:  # BLOOM's row in every declared dtype, the others in the primary one
        out += [{"dtype": dtype, "alibi": kind, "variant": ALIBI_FIRST_ROW} for dtype in caps.dtypes]
        out += [{"dtype": primary, "alibi": kind, "variant": name} for name in ALIBI_ROWS if name != ALIBI_FIRST_ROW]
    return out


@case(variants=_alibi_variants, forms=ALL_FORMS)
def check_alibi_output_matches_reference(backend, *, form, dtype, alibi, variant):
    """A layer built with ALiBi (``config.alibi``) gives the reference's output: each head h adds ``-m_h |p - s|``
    (``"symmetric"``) or ``-m_h (p - s)`` (``"linear"``) to its scaled score of query position p and key position s,
    with the paper's slopes m_h (:func:`~mha_harness.contract.conventions.alibi_slopes`: 1/2 .. 1/256 at 8 heads, the
    interleaved ones at 6), the queries at the last Tq of the Tk positions; causal (in every declared dtype), every
    key visible, new queries against longer keys with grouped-query heads (one slope per query head), a
    cross-attention call and a right-padded batch. A backend that declares no causal alignment (an encoder's layer,
    MPT's bidirectional one) runs the causal rows without the mask: every row checks its bias, slopes and positions
    (an outside user's MPT layer with wrong slopes at 6 heads passed when those rows were skipped)."""
    batch, heads, kv_heads, d_head, tq, tk, causal, bias, lengths = ALIBI_ROWS[variant]
    params = small_layer(backend, bias=bias, num_kv_heads=kv_heads, d_model=heads * d_head, num_heads=heads,
                         alibi=alibi, seed=31)
    masks = {"causal": _alignment(backend)} if causal and backend.capabilities.causal_alignments else {}
    if lengths is not None:
        masks["key_padding_mask"] = padding_mask(lengths, tk)
    inputs = form_inputs(form, params.config, batch, tq, tk, seed=31, **masks)
    require(backend, *inputs.features(), f"dtype:{dtype}")
    return Measurement(max_error=check_against_reference(backend, params, inputs, dtype,
                                                         what=f"ALiBi {alibi!r} ({variant})"))
