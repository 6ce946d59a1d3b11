"""Reports: statuses, divergences (expected and unexpected), the policy table, JSON schema and markdown."""
from __future__ import annotations

import json

import mha_harness
from mha_harness.conformance.report import SCHEMA_VERSION
from mha_harness.contract.api import Divergence
from mha_harness.implementations.numpy_naive import NumpyNaive


class ClaimsNaN(NumpyNaive):
    """Declares a divergence that does not happen: the run must flag it."""
    name = "claims-nan"
    divergences = (Divergence("check_fully_masked_rows_output_zeros", observed="NaN", reason="stale declaration"),)


class NaNRows(NumpyNaive):
    name = "nan-rows"
    divergences = (Divergence("check_fully_masked_rows_output_zeros", observed="NaN",
                              reason="this backend divides 0 by 0"),)

    def load_native(self, params, dtype):
        from mha_harness.implementations.mutants.zoo import FullyMaskedRowsNaN
        return FullyMaskedRowsNaN(params, dtype)


def test_a_declared_divergence_that_does_not_happen_is_an_unexpected_pass_and_fails_the_run():
    report = mha_harness.check(ClaimsNaN(), cases=["check_fully_masked_rows_output_zeros"])
    assert [r.status for r in report.results] == ["unexpected-pass"] and not report.ok
    assert "remove or narrow the declaration" in report.results[0].message


def test_a_declared_divergence_that_happens_is_reported_and_the_run_passes():
    report = mha_harness.check(NaNRows(), cases=["check_fully_masked_rows_output_zeros"])
    result = report.results[0]
    assert result.status == "expected-divergence" and report.ok
    assert result.observed == "NaN" and "this backend divides 0 by 0" in result.message
    assert report.policies()["nan-rows"]["fully_masked_rows"] == "NaN"


def test_json_and_markdown_carry_the_matrix_policies_divergences_and_repro(tmp_path):
    report = mha_harness.check([NumpyNaive(), NaNRows()], cases=["check_fully_masked_rows_output_zeros",
                                                           "check_causal_output_matches_reference"])
    report.mutation = {"caught": 1, "total": 1, "mutants": [{"name": "m", "bug": "b", "caught_by": ["check_x"]}]}
    paths = report.write(tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["complete"]
    assert doc["policies"]["numpy-naive"]["fully_masked_rows"] == "zeros"
    assert "top-left" in doc["policies"]["numpy-naive"]["causal_alignment"]
    assert "bottom-right" in doc["policies"]["numpy-naive"]["causal_alignment"]
    assert doc["results"][0]["repro"].startswith("python -c \"import mha_harness; mha_harness.repro(")
    md = paths["markdown"].read_text()
    assert "| check_fully_masked_rows_output_zeros | pass | diverges |" in md
    assert "## Declared divergences" in md and "this backend divides 0 by 0" in md
    assert "## Mutation score" in md and "1 of 1 mutants caught" in md


def test_failure_messages_say_expected_got_where_and_by_how_much():
    from mha_harness.implementations.mutants import mutant_backends
    backend = next(b for b in mutant_backends() if b.name == "mutant-value-bias-dropped")
    report = mha_harness.check(backend, cases=["check_output_projection_mixes_heads"])
    message = report.failures()[0].message
    for words in ("expected", "got", "batch", "position", "feature", "max error", "tolerance"):
        assert words in message


def test_repro_reruns_one_variant():
    import pytest
    mha_harness.repro("numpy-naive", "check_scores_scaled_by_sqrt_d_head", dtype="float32")
    with pytest.raises(AssertionError):
        mha_harness.repro("tests.plugin_objects:LessonFunction", "check_causal_mask_blocks_future_keys",
                          dtype="float32", alignment="top-left", seq=9, tk=9, poison="nan")
