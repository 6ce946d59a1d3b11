"""The decode step over a filled KV cache (LoadedAttention.prepare_decode_step): its conformance case catches a step
that attends before it writes or drifts between calls, skips a backend without one, refuses calls that are not a
decode step naming the parameter; the decode workload times it and counts its FLOPs and bytes as a step's."""
from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

import mha_harness
from mha_harness import AttentionConfig, as_kv_cache_call, make_inputs, make_params
from mha_harness.bench.calls import call_arguments, prepared_call
from mha_harness.bench.metrics import Shape, compulsory_bytes, core_flops, projection_flops
from mha_harness.bench.verify import WrongOutput
from mha_harness.implementations.mutants import MUTANTS
from mha_harness.implementations.mutants.zoo import MutantBackend
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

CASE = "check_decode_step_over_filled_cache_matches_reference"
BY_NAME = {m.name: m for m in MUTANTS}


def _step_report(loaded_class) -> mha_harness.Report:
    mutant = dataclasses.replace(BY_NAME["mutant-decode-step-attends-before-writing"], loaded=loaded_class)
    return mha_harness.check(MutantBackend(mutant, weights=False), cases=[CASE])


def test_a_step_that_attends_before_writing_is_caught_only_by_the_decode_step_case_on_its_first_call():
    """Its forward is right, so no other case sees it; the first step's new queries miss their own keys."""
    report = mha_harness.check(MutantBackend(BY_NAME["mutant-decode-step-attends-before-writing"], weights=False),
                               include_slow=False)
    failures = [f for f in report.failures() if f.case != "check_search_regressions_still_pass"]
    assert {f.case for f in failures} == {CASE} and len(failures) == 3  # its three variants
    assert all("decode step, first call" in f.message and "attends before it writes" in f.message
               for f in failures), failures[0].message


def test_a_step_of_a_backend_without_bottom_right_masking_is_checked_at_one_new_query():
    """A layer whose own mask is top-left, with a KV-cache path beside it (an outside user's Flax layer): one new
    query sees every cached key, so its step is checked unmasked at Tq = 1 (bench's decode workload times it so), and
    a step that attends before it writes is caught there; its other steps need the bottom-right mask."""
    backend = MutantBackend(BY_NAME["mutant-decode-step-attends-before-writing"], weights=False)
    backend.capabilities = dataclasses.replace(backend.capabilities, causal_alignments=("top-left",))
    report = mha_harness.check(backend, cases=[CASE])
    assert [(r.params["variant"], r.params["causal"], r.status) for r in report.results] == [
        ("one_new_query", False, "failed")], [r.message[:120] for r in report.results]
    assert "attends before it writes" in report.results[0].message
    right = MutantBackend(BY_NAME["mutant-decode-step-attends-before-writing"], weights=False)
    right.capabilities = backend.capabilities
    right.loaded_class = NumpyNaiveLoaded
    assert [r.status for r in mha_harness.check(right, cases=[CASE]).results] == ["passed"]


class _AddsIntoCache(NumpyNaiveLoaded):
    """A step right on its first call that adds x_new's keys and values into the cache's slots instead of
    overwriting them: every later call attends over doubled keys."""

    def prepare_decode_step(self, inputs):
        step = super().prepare_decode_step(inputs)
        project, calls = self.project, []

        def adding_project(x, which):
            y = project(x, which)
            return y * (1 + len(calls)) if which in "kv" and x.shape[1] == inputs.tq else y

        def counted():
            self.project = adding_project
            try:
                return step()
            finally:
                calls.append(1)
                del self.project
        return counted


def test_a_step_whose_later_calls_attend_over_other_values_is_caught_on_its_second_call():
    failures = _step_report(_AddsIntoCache).failures()
    assert len(failures) == 3
    assert all("decode step, second call" in f.message and "writes past the last Tq slots" in f.message
               for f in failures), failures[0].message


def test_a_backend_without_a_decode_step_skips_naming_the_method():
    class NoStep(NumpyNaiveLoaded):
        prepare_decode_step = mha_harness.LoadedAttention.prepare_decode_step

    report = _step_report(NoStep)
    assert {r.status for r in report.results} == {"skipped"}
    assert "no decode step" in report.results[0].message and "prepare_decode_step" in report.results[0].message


@pytest.mark.parametrize("change, parameter", [
    (lambda i: i.replace(causal="top-left"), "causal"),
    (lambda i: i.replace(key_padding_mask=np.ones((i.batch, i.tk), bool)), "key_padding_mask"),
    (lambda i: i.replace(value=i.key.copy()), "inputs"),
])
def test_a_call_that_is_not_a_decode_step_is_refused_naming_the_parameter(change, parameter):
    params = make_params(AttentionConfig(32, 4), seed=0)
    inputs = as_kv_cache_call(make_inputs(params.config, 2, 3, 20, seed=0, causal="bottom-right"))
    loaded = NumpyNaive().load(params, dtype="float64")
    loaded.decode_step(inputs)  # the call itself is accepted
    with pytest.raises(ValueError, match=f"^{parameter}: got"):
        loaded.decode_step(change(inputs))


def test_the_decode_workload_times_the_step_and_counts_a_steps_work():
    """The bench's decode shape calls the step (the cache filled before it): the call returns the reference's
    output, its K/V projections count Tq rows, its bytes the whole cache, and its causal FLOPs nearly every pair."""
    shape = Shape(1, 4, 256, 64, 4, "float64", causal=True, cached=True)
    step = prepared_call(NumpyNaive(), shape)
    params, inputs = call_arguments(shape, "bottom-right", kv_cache=True)
    np.testing.assert_allclose(step(), mha_harness.reference_attention(params, inputs).output, atol=1e-12)
    full = dataclasses.replace(shape, cached=False)
    assert projection_flops(shape) == 2 * 64 * (2 * 4 * 64 + 2 * 4 * 64)
    assert projection_flops(full) == 2 * 64 * (2 * 4 * 64 + 2 * 256 * 64)
    assert compulsory_bytes(shape) == 8 * (4 * 64 + 2 * (256 + 4) * 64 + 4 * 64 * 64 + 4 * 64)
    assert core_flops(shape) == 4 * 4 * 4 * 256 * 16 * (1 - 3 / 512)
    assert core_flops(Shape(1, 256, 256, 64, 4, causal=True)) == 4 * 4 * 256 * 256 * 16 / 2


class _StepMasksTopLeft(NumpyNaiveLoaded):
    """A fast decode path of its own with a top-left causal mask (torch's is_causal=True), its forward right."""

    def prepare_decode_step(self, inputs):
        self.masks = lambda call: NumpyNaiveLoaded.masks(self, call.replace(causal="top-left"))
        try:
            return super().prepare_decode_step(inputs)
        finally:
            del self.masks


def test_a_step_wrong_on_every_call_is_named_like_the_output_cases_name_the_mistake():
    """A stranger's SDPA decode path with is_causal=True (top-left) failed with numbers only: the step's output is
    now matched against the known mistakes, as the output cases do."""
    failures = _step_report(_StepMasksTopLeft).failures()
    assert {f.params["variant"] for f in failures} == {"one_new_query", "five_new_queries"}
    assert all("the output matches top-left alignment instead" in f.message for f in failures), failures[0].message


class _WritesOneSlotLate(NumpyNaiveLoaded):
    """A stranger's step: the new keys and values written from position Tk - Tq + 1 (pos + 1), the slot before them
    left zero, the queries attending the first Tk slots; its forward right."""

    def prepare_decode_step(self, inputs):
        c, start = self.config, inputs.tk - inputs.tq
        x_new = np.asarray(inputs.query, self.dtype)
        cache = {which: np.zeros((inputs.batch, c.kv_heads, inputs.tk, c.d_head), self.dtype) for which in "kv"}
        for which, kv in cache.items():
            kv[:, :, :start] = self.split_heads(self.project(np.asarray(inputs.cached, self.dtype), which),
                                                c.kv_heads)
        masks = self.masks(inputs)

        def step():
            for which, kv in cache.items():  # the last new position falls off the end of the cache
                kv[:, :, start + 1:] = self.split_heads(self.project(x_new, which), c.kv_heads)[:, :, :inputs.tq - 1]
            q = self.split_heads(self.project(x_new, "q"), c.num_heads)
            return self.output_projection(self.merge_heads(self.attend_projected(q, cache["k"], cache["v"], masks,
                                                                                 inputs)[0]))
        return step


def test_a_step_that_writes_one_slot_too_far_is_named_where_the_layer_can_express_it():
    """check names the write one slot off where the layer has no key/value biases (an empty slot's zeros are then
    the projection of a zero input); with one query and nothing cached it cannot be told apart from a step that
    attends before it writes, and says both."""
    by_variant = {f.params["variant"]: f.message for f in _step_report(_WritesOneSlotLate).failures()}
    assert set(by_variant) == {"one_new_query", "five_new_queries", "prompt_into_empty_cache"}
    late = "writes the new keys and values one slot too far"
    assert late in by_variant["one_new_query"] and late in by_variant["prompt_into_empty_cache"], by_variant
    assert "cannot tell" not in by_variant["one_new_query"]
    assert late not in by_variant["five_new_queries"]  # biases there: not a call of this layer


def test_bench_names_a_decode_step_written_one_slot_too_far():
    shape = Shape(1, 1, 64, 32, 4, "float32", causal=True, cached=True)
    backend = MutantBackend(dataclasses.replace(BY_NAME["mutant-decode-step-attends-before-writing"],
                                                loaded=_WritesOneSlotLate), weights=False)
    with pytest.raises(WrongOutput, match="writes the new keys and values one slot too far"):
        prepared_call(backend, shape)


class _ReturnsNone(NumpyNaiveLoaded):
    def prepare_decode_step(self, inputs):
        step = super().prepare_decode_step(inputs)
        return lambda: (step(), None)[1]


class _ReturnsItsOutput(NumpyNaiveLoaded):
    def prepare_decode_step(self, inputs):
        return super().prepare_decode_step(inputs)()


class _OneTokenOnly(NumpyNaiveLoaded):
    def prepare_decode_step(self, inputs):
        if inputs.tq > 1:
            raise NotImplementedError("this step takes one token at a time")
        return super().prepare_decode_step(inputs)


@pytest.mark.parametrize("loaded_class, status, says", [
    (_ReturnsNone, "error", "the step returned None; accepted: the step's output"),
    (_ReturnsItsOutput, "error", "prepare_decode_step: returned ndarray; accepted: a zero-argument callable"),
])
def test_a_step_that_returns_the_wrong_thing_is_told_what_to_return(loaded_class, status, says):
    report = _step_report(loaded_class)
    assert {r.status for r in report.results} == {status}
    assert all(says in r.message for r in report.results), report.results[0].message


def test_a_step_refusing_one_call_skips_that_call_saying_it_refused_not_that_there_is_no_step():
    by_variant = {r.params["variant"]: r for r in _step_report(_OneTokenOnly).results}
    assert by_variant["one_new_query"].status == "passed"
    skipped = by_variant["five_new_queries"]
    assert skipped.status == "skipped" and "refused this call" in skipped.message
    assert "one token at a time" in skipped.message and "no decode step" not in skipped.message


def test_the_decode_workload_refuses_a_step_that_returns_no_output():
    shape = Shape(1, 1, 64, 32, 4, "float32", causal=True, cached=True)
    backend = MutantBackend(dataclasses.replace(BY_NAME["mutant-decode-step-attends-before-writing"],
                                                loaded=_ReturnsNone))
    with pytest.raises(WrongOutput, match=r"decode step returned None; accepted: the layer's output, shape"):
        prepared_call(backend, shape)


@pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="jax/flax are not installed")
def test_flax_mha_steps_through_flax_own_decode_cache_and_refuses_more_than_one_new_query():
    """flax-mha's step is the module with ``decode=True`` (flax's autoregressive cache), verified like any step: one
    new query passes the case; five are refused naming flax's one-query cache, not reported as a missing step."""
    from mha_harness.implementations.flax_mha import FlaxMha
    report = mha_harness.check(FlaxMha("cpu"), cases=[CASE])
    by_variant = {r.variant: r for r in report.results}
    one, = (r for v, r in by_variant.items() if "one-new-query" in v)
    five, = (r for v, r in by_variant.items() if "five-new-queries" in v)
    assert one.status == "passed", one.message
    assert five.status == "skipped" and "one new query per call" in five.message and "Tq = 5" in five.message

