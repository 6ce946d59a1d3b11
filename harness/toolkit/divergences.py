"""Ready-made :class:`~mha_harness.Divergence` declarations for behaviours common to attention libraries.

Each returns a tuple to put in your backend's ``divergences``; each declaration is *verified* by the harness
(the case is rerun under the declared behaviour and must pass there), so declaring one that does not match
what your backend does fails the run. Give the library, its version and the mechanism as ``reason``::

    from mha_harness.toolkit.divergences import masked_poison_divergences, uniform_fully_masked_divergences
    divergences = uniform_fully_masked_divergences("mylib masks with a finite minimum (mylib 2.1)") + \\
        masked_poison_divergences("mylib computes P @ V densely, 0 * NaN = NaN (mylib 2.1)")

The vocabulary (``Divergence.behaviour``): ``fully_masked_rows:uniform_average|nan|zeros``,
``precision:<dtype>``, ``masked_poison``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mha_harness.contract.api import Divergence

POISON_CASES = ("check_causal_mask_blocks_future_keys", "check_padding_mask_blocks_padded_keys")
FULLY_MASKED_CASE = "check_fully_masked_rows_output_zeros"
#: the causal-reference variant with query rows that see no key (bottom-right alignment, Tq > Tk)
EMPTY_CAUSAL_ROWS = ("check_causal_output_matches_reference", {"variant": "rows_without_visible_keys"})
#: the gradient variant with a query row whose attn_mask masks every key
EMPTY_ROW_GRADIENTS = ("check_gradients_match_reference", {"empty_row": True})


def masked_poison_divergences(reason: str, cases: Iterable[str] = POISON_CASES) -> tuple[Divergence, ...]:
    """NaN/inf stored in a masked key/value reaches the output (a dense P @ V computes 0 * NaN = NaN).

    Verified: non-finite output only in batch items whose keys/values held NaN/inf (or in rows with no key to
    attend, which follow the empty-row convention), the right output once they are finite, and the finite-value
    (``poison="random"``) variant of the case passing."""
    return tuple(Divergence(case, "masked_poison", reason, when={"poison": ("nan", "inf")}) for case in cases)


def _fully_masked(value: str, reason: str, with_empty_causal_rows: bool,
                  dtypes: Iterable[str] | None) -> tuple[Divergence, ...]:
    only = {} if dtypes is None else {"dtype": tuple(dtypes)}
    out = (Divergence(FULLY_MASKED_CASE, f"fully_masked_rows:{value}", reason, when=only),
           Divergence(EMPTY_ROW_GRADIENTS[0], f"fully_masked_rows:{value}", reason,
                      when={**EMPTY_ROW_GRADIENTS[1], **only}))
    if with_empty_causal_rows:
        case, when = EMPTY_CAUSAL_ROWS
        out += (Divergence(case, f"fully_masked_rows:{value}", reason, when={**when, **only}),)
    return out


def uniform_fully_masked_divergences(reason: str, *, with_empty_causal_rows: bool = True,
                                     dtypes: Iterable[str] | None = None) -> tuple[Divergence, ...]:
    """Rows with every key masked output the uniform average of V (a finite mask value instead of -inf), also
    the bottom-right causal rows that see no key when Tq > Tk (``with_empty_causal_rows``); the backward through
    such a row (the gradient case's ``empty_row`` variant) follows the same convention. ``dtypes``: only in these
    (a layer whose masked value becomes -inf in one dtype: Hugging Face's float64 rows are NaN, declared apart)."""
    return _fully_masked("uniform_average", reason, with_empty_causal_rows, dtypes)


def nan_fully_masked_divergences(reason: str, *, with_empty_causal_rows: bool = True,
                                 dtypes: Iterable[str] | None = None) -> tuple[Divergence, ...]:
    """Rows with every key masked output NaN (softmax of a row of -inf: 0 / 0), also the bottom-right causal rows
    that see no key when Tq > Tk (``with_empty_causal_rows``); the backward through such a row (the gradient case's
    ``empty_row`` variant) is NaN the same way. ``dtypes``: only in these."""
    return _fully_masked("nan", reason, with_empty_causal_rows, dtypes)


def precision_divergences(dtype: str, bound: str, reason: str, cases: Iterable[str],
                          when: Mapping[str, Any] | None = None) -> tuple[Divergence, ...]:
    """Runs in ``dtype`` are computed at the precision of ``bound`` inside the library (e.g. float64 inputs
    computed in float32): the result is compared against the tolerance bound of ``bound``, and must meet it."""
    return tuple(Divergence(case, f"precision:{bound}", reason, when={"dtype": dtype, **(when or {})})
                 for case in cases)
