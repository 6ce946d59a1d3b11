"""Each convention has one home, mha_harness.contract.conventions, and everything else uses it."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mha_harness.contract.conventions import (
    BOTTOM_RIGHT,
    CAUSAL_ALIGNMENTS,
    DTYPES,
    EPS,
    PARAM_NAMES,
    TOP_LEFT,
    causal_offset,
    other_alignment,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tq, tk", [(5, 5), (3, 8), (8, 3)])
def test_causal_offset_puts_the_diagonal_where_each_alignment_says(tq, tk):
    """top-left: query 0 sees key 0 only; bottom-right: the last query sees the last key and no further."""
    assert causal_offset(TOP_LEFT, tq, tk) == 0
    assert (tq - 1) + causal_offset(BOTTOM_RIGHT, tq, tk) == tk - 1
    assert {other_alignment(a) for a in CAUSAL_ALIGNMENTS} == set(CAUSAL_ALIGNMENTS)


def test_an_unknown_alignment_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match="causal: got 'future'; accepted: 'top-left', 'bottom-right'"):
        causal_offset("future", 3, 3)


def test_dtypes_params_and_polarities_are_stated_once():
    from mha_harness.contract import api, validation
    assert api.DTYPES is DTYPES and tuple(EPS) == DTYPES
    assert api.PARAM_NAMES is PARAM_NAMES and api.CAUSAL_ALIGNMENTS is CAUSAL_ALIGNMENTS
    assert validation.DTYPES is DTYPES
    assert not hasattr(__import__("mha_harness.contract.conventions").contract.conventions, "NUMPY_COMPUTE")


def test_the_causal_offset_formula_is_typed_only_in_conventions():
    """No module computes ``tk - tq`` for a causal mask itself: a second copy could drift from the first."""
    formula = re.compile(r"""["']top-left["']\s+else\s+\w*\.?tk\s*-|["']bottom-right["']\s+else""")
    offenders = []
    for folder in ("harness", "cases", "implementations", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "conventions.py" and formula.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_masks_built_from_the_offset_agree_with_numpy_tril():
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_inputs
    from mha_harness.toolkit.masks import full_mask
    config = AttentionConfig(8, 2)
    for alignment in CAUSAL_ALIGNMENTS:
        inputs = make_inputs(config, 1, 4, 7, causal=alignment, self_attention=False)
        allowed, _ = full_mask(inputs)
        expected = np.tril(np.ones((4, 7), bool), k=causal_offset(alignment, 4, 7))
        assert np.array_equal(allowed.reshape(4, 7), expected)
