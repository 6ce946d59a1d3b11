"""examples/flax_nnx_plugin: a Flax NNX layer wrapped from the README alone by an outside user passes every case it
declares (its divergences verified), and the bug that user planted in a copy (the harness's key_padding_mask handed
to nnx without inverting it) fails with the diagnosis naming it, under the uniform-average rows flax declares."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import mha_harness
from tests.example_modules import module_from_file

pytest.importorskip("flax.nnx")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flax_nnx_plugin" / "flax_nnx_attention" / "__init__.py"


@pytest.fixture(scope="module")
def example():
    name = "flax_nnx_attention"
    return sys.modules.get(name) or module_from_file(EXAMPLE, name)


def test_the_flax_nnx_layer_passes_every_case_it_declares_with_its_divergences_verified(example):
    report = mha_harness.check(example.NNXMultiHeadAttention(), include_slow=False, isolate=False)
    assert report.ok, "\n".join(report.summary_lines())
    statuses = [r.status.value for r in report.results]
    assert statuses.count("passed") >= 80 and statuses.count("expected-divergence") >= 20, report.summary_lines()


def test_the_key_padding_mask_handed_over_uninverted_is_named(example):
    def padding_read_as_attend(inputs):  # the harness's True = padding passed where nnx wants True = attend
        import jax.numpy as jnp
        return None if inputs.key_padding_mask is None else jnp.asarray(inputs.key_padding_mask[:, None, None, :])

    broken = type("PaddingPolarityBug", (example.NNXMultiHeadAttention,),
                  {"name": "nnx-mha-padding-polarity-bug", "to_mask": staticmethod(padding_read_as_attend)})()
    report = mha_harness.check(broken, cases=["check_padding_mask_output_matches_reference"], include_slow=False,
                               isolate=False)
    failures = report.failures()
    assert failures and all("the key_padding_mask read with the opposite polarity" in f.message for f in failures), \
        [f.message for f in failures]


def test_the_flax_nnx_forward_backward_call_is_checked_by_its_gradients(example):
    from mha_harness.bench.calls import prepare_point
    from mha_harness.bench.metrics import Shape
    from mha_harness.bench.verify import check_point
    backend = example.NNXMultiHeadAttention()
    shape = Shape(1, 32, 32, 64, 4, "float32", True, True)
    point = prepare_point(backend, shape)
    record = check_point(backend, shape, point.checked_values(point.fn()))
    assert record["rows"] == 16 and {"query", "key", "value", "W_q", "W_o"} <= set(record["gradients"])
    assert record["max_error"] <= record["bound"]
