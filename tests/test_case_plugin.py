"""Third parties ship cases through the mha_harness.cases entry-point group: examples/case_plugin, pip-installed
into a private directory, is run by ``mha-harness check`` and bites on a broken backend."""
from __future__ import annotations

import json
import os
import re
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


HALF_REGISTERED = '''
from mha_harness.conformance.casekit import Measurement, case


@case()
def check_registered_before_the_failure(backend, *, dtype):
    """Registered, then the module fails below."""
    return Measurement(max_error=0.0)


raise RuntimeError("cases broke halfway")
'''


def _plugin_site(tmp_path, body: str):
    site = tmp_path / "site"
    dist = site / "half_cases-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: half-cases\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[mha_harness.cases]\nhalf = half_cases\n")
    (site / "half_cases.py").write_text(body)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def test_a_case_plugin_that_fails_halfway_runs_none_of_its_cases_and_is_named_where_they_are_asked_for(tmp_path):
    """All of a plugin or none of it (an outside user's plugin failed after one case had registered, and that case
    ran although the report said its cases did not); asking for one of its cases names the plugin's failure, and
    ``list --cases`` shows the cases there are and the plugin that failed (exit 1)."""
    env = _plugin_site(tmp_path, HALF_REGISTERED)
    out = run_cli("check", "--backend", "numpy-naive", "--case", "check_scores_scaled_by_sqrt_d_head", "--no-isolate",
                  "--results", tmp_path / "res", env=env)
    doc = json.loads((tmp_path / "res" / "conformance" / "conformance.json").read_text())
    assert out.returncode == 1 and [r["case"] for r in doc["results"]] == ["check_scores_scaled_by_sqrt_d_head"]
    asked = run_cli("check", "--backend", "numpy-naive", "--case", "check_registered_before_the_failure",
                    "--results", tmp_path / "res2", env=env)
    assert asked.returncode == 2 and "case plugins that failed to load (their cases are unknown): half_cases: " \
                                      "failed to load" in asked.stderr and "cases broke halfway" in asked.stderr
    listed = run_cli("list", "--cases", env=env)
    assert listed.returncode == 1 and "check_registered_before_the_failure" not in listed.stdout
    assert re.search(r"^check_padding_mask_output_matches_reference +requires key_padding_mask; forms separate, "
                     r"shared_kv, self, kv_cache$", listed.stdout, re.M), listed.stdout
    assert "case plugin half_cases: failed to load" in listed.stderr


def test_a_misspelt_capability_in_requires_is_refused_at_registration():
    from mha_harness.conformance.casekit import case
    with pytest.raises(ValueError, match=r"requires: capability: unknown capability 'additive_mask'; accepted: "
                                         r"\['additive_attn_mask'"):
        case(requires=("additive_mask",))


def test_list_refuses_a_backend_whose_divergence_names_a_case_not_installed(tmp_path):
    """What check refuses at load, list says, and exits 1 on it (an outside user's backend, declaring a divergence
    for a case plugin's case, was "available" in list and refused by check once the plugin was uninstalled)."""
    (tmp_path / "half_mask.py").write_text(
        "import mha_harness\n"
        "from mha_harness.implementations.numpy_naive import NumpyNaive\n\n\n"
        "class HalfMask(NumpyNaive):\n"
        "    name = 'half-mask'\n"
        "    divergences = (mha_harness.Divergence('check_from_a_plugin', 'precision:float16', 'a float16 mask'),)\n")
    out = run_cli("list", "--backend-spec", "half_mask:HalfMask",
                  env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert out.returncode == 1
    assert "half-mask  unavailable: declared divergences refused: divergence for unknown case 'check_from_a_plugin'" \
        in out.stdout and "declare the divergence when `name in mha_harness.case_names()`" in out.stdout
    assert "failed to load or declare divergences check refuses: half-mask" in out.stderr
