"""check_repeated_calls_are_bitwise_identical compares five calls, interleaved with calls on other inputs:
a backend that goes wrong only from its third call is caught (two calls were not enough)."""
from __future__ import annotations

import numpy as np

import mha_harness
from mha_harness.contract.api import AttentionOutput
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

CASE = "check_repeated_calls_are_bitwise_identical"


class _DriftsFromThirdCall(NumpyNaiveLoaded):
    """Correct for two calls, then adds one ulp-sized drift per call (a stale accumulator, say)."""

    calls = 0

    def compute(self, inputs, *, need_weights=False):
        self.calls += 1
        out = super().compute(inputs, need_weights=need_weights)
        if self.calls >= 3:
            return AttentionOutput(np.nextafter(out.output, np.inf), out.weights)
        return out


class DriftsFromThirdCall(NumpyNaive):
    name = "drifts-from-third-call"
    loaded_class = _DriftsFromThirdCall


def test_the_drift_is_invisible_to_two_identical_calls():
    backend = DriftsFromThirdCall()
    params = make_params(mha_harness.AttentionConfig(16, 2), seed=0)
    inputs = make_inputs(params.config, 1, 5, seed=0)
    loaded = backend.load(params, dtype="float64")
    assert np.array_equal(loaded.forward(inputs).output, loaded.forward(inputs).output)


def test_five_interleaved_calls_catch_a_backend_that_goes_wrong_from_its_third_call():
    report = mha_harness.check(DriftsFromThirdCall(), cases=[CASE])
    assert {r.status for r in report.results} == {"failed"}
    assert all("call 2 of 5 identical calls" in r.message for r in report.results)


def test_a_deterministic_backend_passes_all_five_calls():
    report = mha_harness.check(NumpyNaive(), cases=[CASE])
    assert {r.status for r in report.results} == {"passed"}
