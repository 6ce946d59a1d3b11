"""Third parties ship cases through the mha_harness.cases entry-point group: examples/case_plugin, pip-installed
into a private directory, is run by ``mha-harness check`` and bites on a broken backend."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli

CASE = "check_identical_values_pass_through_unchanged"

BROKEN = '''
import numpy as np
import mha_harness


def unnormalised(query, key, value, W_q, W_k, W_v, W_o, num_heads):
    """The lesson's attention with the softmax's division forgotten."""
    t, d = query.shape
    dh = d // num_heads
    q, k, v = ((x @ w).reshape(-1, num_heads, dh).transpose(1, 0, 2)
               for x, w in ((query, W_q), (key, W_k), (value, W_v)))
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(dh)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights @ v).transpose(1, 0, 2).reshape(t, d) @ W_o


Unnormalised = mha_harness.function_backend(unnormalised, name="unnormalised")
'''


@pytest.fixture(scope="module")
def with_case_plugin(tmp_path_factory):
    """examples/case_plugin installed into a private target (the test environment itself is untouched), plus a
    module holding a broken backend."""
    target = tmp_path_factory.mktemp("site")
    # a private copy: pip builds in the source tree, and xdist workers may build at the same time
    source = shutil.copytree(ROOT / "examples" / "case_plugin", tmp_path_factory.mktemp("src") / "case_plugin",
                             ignore=shutil.ignore_patterns("build", "*.egg-info"))
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (target / "broken_attention.py").write_text(BROKEN)
    return {"PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}


def _check(env, tmp_path, *backend_args):
    out = run_cli("check", *backend_args, "--case", CASE, "--no-isolate", "--results", tmp_path, env=env)
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    return out, [r for r in doc["results"] if r["case"] == CASE]


def test_an_installed_case_plugin_runs_in_mha_harness_check(with_case_plugin, tmp_path):
    out, results = _check(with_case_plugin, tmp_path, "--backend", "numpy-naive")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [r["status"] for r in results] == ["passed"]


def test_the_plugin_case_fails_on_a_backend_that_breaks_its_property(with_case_plugin, tmp_path):
    out, results = _check(with_case_plugin, tmp_path, "--backend-spec", "broken_attention:Unnormalised")
    assert out.returncode == 1, out.stdout + out.stderr
    assert [r["status"] for r in results] == ["failed"]
    assert "output for identical value tokens" in results[0]["message"]


def test_without_the_plugin_the_case_is_unknown(tmp_path):
    out = run_cli("check", "--backend", "numpy-naive", "--case", CASE, "--results", tmp_path)
    assert out.returncode == 2 and f"case: got '{CASE}'" in out.stderr


@pytest.mark.parametrize("body", ["raise RuntimeError('cases broke')", "import sys; sys.exit(3)"],
                         ids=["raises", "exits"])
def test_a_broken_case_plugin_is_reported_and_the_run_goes_on(tmp_path, body):
    """A case plugin whose import raises (or calls sys.exit) is named in the report with its error, the built-in
    cases still run, and the run is not OK (exit 1) -- never a traceback that kills the run."""
    site = tmp_path / "site"
    dist = site / "broken_cases-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-cases\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[mha_harness.cases]\nbroken = broken_cases\n")
    (site / "broken_cases.py").write_text(body + "\n")
    out = run_cli("check", "--backend", "numpy-naive", "--case", "check_scores_scaled_by_sqrt_d_head", "--no-isolate",
                  "--results", tmp_path / "res", env={"PYTHONPATH": str(site)})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "case plugin broken_cases" in out.stdout
    doc = json.loads((tmp_path / "res" / "conformance" / "conformance.json").read_text())
    assert "broken_cases" in doc["case_plugin_errors"] and not doc["ok"]
    assert ("cases broke" if "raise" in body else "SystemExit") in doc["case_plugin_errors"]["broken_cases"]
    assert [r["status"] for r in doc["results"]] == ["passed"]
