"""examples/jax_llama_plugin: a hand-written, jitted JAX Llama layer (one x, grouped-query heads, Hugging Face's
rotate_half rotary, no biases) that an outside user wrapped from the README and docs alone passes every case it
declares, and the bug they planted in a copy, the rotary base hard-coded to 10,000, fails on the grid's
``rotary_other_base`` row with the diagnosis naming it (before that row, `check --quick` passed it when the layer
declared no gradients)."""
from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest

import mha_harness

pytest.importorskip("jax")
FOLDER = Path(__file__).resolve().parents[1] / "examples" / "jax_llama_plugin"


@pytest.fixture(scope="module")
def example():
    if str(FOLDER) not in sys.path:  # as `--backend-spec llama_jax_attention:backends` run from that folder
        sys.path.insert(0, str(FOLDER))
    return importlib.import_module("llama_jax_attention")


def test_the_jax_llama_layer_passes_every_case_it_declares_with_its_divergences_verified(example):
    report = mha_harness.check(example.LlamaJax(), include_slow=False, isolate=False)
    assert report.ok, "\n".join(report.summary_lines())
    ran = {r.params.get("variant") for r in report.results if r.status.value == "passed"}
    assert {"rotary_half_split", "rotary_other_base"} <= ran, ran
    assert sum(r.status.value == "expected-divergence" for r in report.results) >= 3


def test_a_rotary_base_hard_coded_in_the_layer_is_caught_without_gradients_and_named(example):
    class BaseTenThousand(example._Loaded):
        def __init__(self, params, dtype, model_module):
            super().__init__(params, dtype, model_module)
            self.layer.rope_theta = 10_000.0  # rope_theta not passed on

    broken = type("BaseHardCoded", (example.LlamaJax,), {
        "name": "llama-jax-base-hard-coded",
        "capabilities": dataclasses.replace(example.LlamaJax.capabilities, gradients=False),
        "load_native": lambda self, params, dtype: BaseTenThousand(params, dtype, self.model_module)})()
    failed = mha_harness.check(broken, cases=["check_output_matches_reference"], include_slow=False,
                               isolate=False).failures()
    assert {r.params["variant"] for r in failed} == {"rotary_other_base"}
    assert all("the output matches rotary embeddings built with base 10000 where config.rotary_base is 500000"
               in r.message for r in failed), [r.message for r in failed]
