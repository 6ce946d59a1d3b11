"""Divergence declarations that several library backends share, built from each library's own reason."""
from __future__ import annotations

from mha_harness.contract.api import Divergence

POISON_CASES = ("check_causal_mask_blocks_future_keys", "check_padding_mask_blocks_padded_keys")


def masked_poison_divergences(reason: str) -> tuple[Divergence, ...]:
    """NaN/inf stored in a masked key/value reaches the output (dense P @ V computes 0 * NaN = NaN)."""
    return tuple(Divergence(case, observed=f"{kind} in a masked key/value reaches the output", reason=reason,
                            when={"poison": kind}) for case in POISON_CASES for kind in ("nan", "inf"))


def uniform_fully_masked_divergences(reason: str) -> tuple[Divergence, ...]:
    """Rows with every key masked softmax to uniform weights (a finite mask value instead of -inf)."""
    return (
        Divergence("check_fully_masked_rows_output_zeros", observed="uniform average of V", reason=reason),
        Divergence("check_causal_output_matches_reference", observed="query rows with no visible key "
                   "(bottom-right, Tq > Tk) output the uniform average of V", reason=reason,
                   when={"variant": "rows_without_visible_keys"}),
    )
