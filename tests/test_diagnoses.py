"""A failed whole-output comparison names the known wrong layer its output matches (harness/conformance/diagnoses.py):
each diagnosis is proved on a backend that makes exactly that mistake."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.implementations.mutants import MUTANTS
from mha_harness.implementations.mutants.zoo import MutantBackend
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded


class _SoftmaxOverQueries(NumpyNaiveLoaded):
    def softmax(self, scores):  # normalises each key's column over the queries
        top = scores.max(axis=-2, keepdims=True)
        e = np.exp(scores - np.where(np.isfinite(top), top, 0))
        return e / np.maximum(e.sum(axis=-2, keepdims=True), np.finfo(e.dtype).tiny)


class _PaddingReadInverted(NumpyNaiveLoaded):
    def masks(self, inputs):
        flipped = None if inputs.key_padding_mask is None else ~inputs.key_padding_mask
        return super().masks(inputs.replace(key_padding_mask=flipped))


def _backend(name, loaded):
    return type(name, (NumpyNaive,), {"name": name, "loaded_class": loaded})()


def _messages(backend, case):
    return [f.message for f in mha_harness.check(backend, cases=[case]).failures()]


@pytest.mark.parametrize("backend, case, named", [
    (_backend("softmax-over-queries", _SoftmaxOverQueries), "check_output_matches_reference",
     "a softmax over the queries (axis -2"),
    (MutantBackend(next(m for m in MUTANTS if m.name == "mutant-no-output-projection"), weights=False),
     "check_output_matches_reference", "without the output projection W_o"),
    (MutantBackend(next(m for m in MUTANTS if m.name == "mutant-split-tokens"), weights=False),
     "check_output_matches_reference", "'split tokens instead of features'"),
    (_backend("padding-inverted", _PaddingReadInverted), "check_padding_mask_output_matches_reference",
     "key_padding_mask read with the opposite polarity"),
], ids=["softmax-axis", "no-w-o", "split-tokens", "padding-polarity"])
def test_the_failure_names_the_wrong_layer_it_matches(backend, case, named):
    messages = _messages(backend, case)
    assert messages and all(named in m for m in messages), [m for m in messages if named not in m][:2]
