"""``Capabilities.d_head_multiple``: a layer built only at head widths that are multiples of a number (a Hugging Face
rotary layer's config refuses an odd d_head even with rotary off; FlashAttention's kernels want multiples of 8)."""
from __future__ import annotations

import dataclasses

import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, Capabilities, Unsupported
from mha_harness.contract.params import make_params
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded


def _backend(multiple: int, refuses_others: bool = False):
    """numpy-naive declaring ``d_head_multiple``; ``refuses_others``: its module raises at other widths, as a
    Hugging Face config does (so a width the harness let through would be an error, not a skip)."""
    class Loaded(NumpyNaiveLoaded):
        def __init__(self, params, dtype):
            if refuses_others and params.config.d_head % multiple:
                raise RuntimeError(f"RoPE requires an even rotary dimension (d_head = {params.config.d_head})")
            super().__init__(params, dtype)
    caps = dataclasses.replace(NumpyNaive.capabilities, d_head_multiple=multiple)
    return type(f"Multiple{multiple}", (NumpyNaive,), {"name": f"d-head-multiple-{multiple}", "loaded_class": Loaded,
                                                       "capabilities": caps})()


def test_a_malformed_multiple_is_refused_naming_it_and_the_accepted_values():
    for bad in (0, True, 2.0, "2"):
        with pytest.raises(ValueError, match=r"Capabilities.d_head_multiple: got .*; accepted: an integer >= 1"):
            Capabilities(d_head_multiple=bad)


def test_a_layer_at_another_width_is_refused_at_load_as_unsupported_naming_the_declaration():
    backend = _backend(8)
    with pytest.raises(Unsupported, match=r"d_head = 4: d-head-multiple-8 declares d_head_multiple=8"):
        backend.load(make_params(AttentionConfig(8, 2)))
    backend.load(make_params(AttentionConfig(32, 4)))


def test_the_cases_at_other_widths_skip_naming_it_and_the_rest_pass():
    report = mha_harness.check(_backend(8, refuses_others=True), include_slow=False, isolate=False)
    assert report.ok and not [r for r in report.results if r.status == "error"], report.summary_lines()
    skipped = [r for r in report.results if r.status == "skipped" and "declares d_head_multiple=8" in r.message]
    assert {r.case for r in skipped} >= {"check_lesson_worked_example_head_weights"}, {r.case for r in skipped}
    assert sum(r.status == "passed" for r in report.results) > 60


def test_search_draws_only_multiples_and_rejects_nothing_for_the_width(tmp_path):
    """An outside user's Llama 3.1 wrapper had 266 of 466 draws rejected for an odd d_head."""
    pytest.importorskip("hypothesis")
    from mha_harness.conformance.isolation import Target
    from mha_harness.conformance.search import search_backend
    outcome = search_backend(Target(_backend(2, refuses_others=True), "d-head-multiple-2"), results=tmp_path,
                             isolate=False, max_examples=150, seed=0)
    assert outcome.passed, outcome.lines()
    assert not [r for r in outcome.rejections if "d_head" in r or "RoPE" in r], outcome.rejections
