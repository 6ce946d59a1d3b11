"""Every built-in CPU backend passes every applicable case or shows a declared divergence."""
from __future__ import annotations

import json

import pytest

from mha_harness.registry import load_registry
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def full_check(tmp_path_factory):
    results = tmp_path_factory.mktemp("all")
    out = run_cli("check", "--results", results, timeout=900)
    return out, json.loads((results / "conformance" / "conformance.json").read_text())


def test_all_available_backends_pass_or_declare(full_check):
    out, doc = full_check
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert doc["ok"] and doc["complete"]
    available = [e.name for e in load_registry().available()]
    assert set(available) <= set(doc["summary"])
    for name in available:
        assert doc["summary"][name].get("passed", 0) > 25, name


def test_policy_table_shows_three_policies_for_every_backend(full_check):
    _, doc = full_check
    for name in (e.name for e in load_registry().available()):
        row = doc["policies"][name]
        assert row["fully_masked_rows"] in {"zeros (verified)", "NaN (declared, verified)",
                                            "uniform average of V (declared, verified)"}, name
        for alignment in doc["backends"][name]["capabilities"]["causal_alignments"]:
            assert f"{alignment} verified" in row["causal_alignment"], name
        assert row["mask_polarity"], name
