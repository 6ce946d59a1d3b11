"""Fault injection: hostile plugins never take the run down or lose other backends' results."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_cli

HOSTILE = ["RaisesInForward", "WrongShape", "ReturnsNaN", "Hangs", "KillsProcess", "Segfaults"]
CASES = ["check_output_projection_mixes_heads", "check_scores_scaled_by_sqrt_d_head",
         "check_batch_items_are_independent"]
EXPECTED = {"hostile-raises": {"error"}, "hostile-wrong-shape": {"failed"}, "hostile-nan": {"failed"},
            "hostile-hangs": {"timeout", "error"}, "hostile-exits": {"crashed", "error"},
            "hostile-segfault": {"crashed", "error"}}


def _hostile_args():
    args = []
    for name in HOSTILE:
        args += ["--backend-spec", f"tests.hostile_plugins:{name}"]
    return args + ["--backend-spec", "tests.hostile_import:Backend"]


@pytest.fixture(scope="module")
def hostile_check(tmp_path_factory):
    results = tmp_path_factory.mktemp("hostile")
    args = ["check", *_hostile_args(), "--backend", "numpy-tiled", "--timeout", "4", "--results", results]
    for case in CASES:
        args += ["--case", case]
    return run_cli(*args, timeout=300), results


def test_check_completes_and_fails_only_because_of_the_hostile_plugins(hostile_check):
    out, results = hostile_check
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads((results / "conformance" / "conformance.json").read_text())
    assert doc["complete"] and not doc["ok"]
    healthy = [r for r in doc["results"] if r["backend"] == "numpy-tiled"]
    assert len(healthy) == len(CASES) and all(r["status"] == "passed" for r in healthy)


@pytest.mark.parametrize("backend, statuses", sorted(EXPECTED.items()))
def test_each_hostile_plugin_is_reported_with_its_reason(hostile_check, backend, statuses):
    out, results = hostile_check
    doc = json.loads((results / "conformance" / "conformance.json").read_text())
    mine = [r for r in doc["results"] if r["backend"] == backend]
    assert len(mine) == len(CASES)
    assert {r["status"] for r in mine} <= statuses and mine[0]["status"] in statuses - {"error"} | {"error"}
    assert all(r["message"] for r in mine)
    first = mine[0]["message"]
    reason = {"hostile-raises": "forward exploded", "hostile-wrong-shape": "output shape",
              "hostile-nan": "expected finite values", "hostile-hangs": "no result within 4 s",
              "hostile-exits": "exit code 17", "hostile-segfault": "exit code -11"}[backend]
    assert reason in first


def test_a_plugin_that_fails_to_import_is_a_reported_load_error(hostile_check):
    out, results = hostile_check
    doc = json.loads((results / "conformance" / "conformance.json").read_text())
    info = doc["backends"]["tests.hostile_import:Backend"]
    assert info["load_error"] and "ImportError: hostile plugin" in info["reason"]
    assert "failed to load" in (results / "conformance" / "conformance.md").read_text()


def test_run_survives_hostile_plugins_and_still_benchmarks_the_rest(tmp_path):
    out = run_cli("run", "--backend", "numpy-naive", "--backend-spec", "tests.hostile_plugins:KillsProcess",
                  "--backend-spec", "tests.hostile_plugins:Hangs", "--timeout", "4", "--seq-lens", "32,64,128",
                  "--results", tmp_path, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert {r["status"] for r in doc["results"] if r["backend"] == "numpy-naive"} <= {"passed", "skipped"}
    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert {p["backend"] for p in bench["points"]} == {"numpy-naive"}


def test_sigterm_leaves_every_finished_result_in_valid_json(tmp_path):
    """numpy-naive finishes quickly; the hanging plugin is still running when SIGTERM arrives."""
    proc = subprocess.Popen([sys.executable, "-m", "mha_harness", "check", "--backend", "numpy-naive", "--quick",
                             "--backend-spec", "tests.hostile_plugins:Hangs", "--timeout", "60",
                             "--results", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    path = tmp_path / "conformance" / "conformance.json"
    deadline = time.time() + 120
    while time.time() < deadline and not path.exists():
        time.sleep(0.2)
    assert path.exists(), "no partial report was written"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    doc = json.loads(path.read_text())  # valid JSON, never half-written
    assert doc["complete"] is False
    assert any(r["backend"] == "numpy-naive" and r["status"] == "passed" for r in doc["results"])
    leftovers = [p for p in (tmp_path / "conformance").iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    from mha_harness.util import atomic
    target = tmp_path / "r.json"
    atomic.write_json_atomic(target, {"v": 1})

    def boom(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_json_atomic(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_python_check_with_isolation_reports_crashes_too():
    import mha_harness
    from tests.hostile_plugins import KillsProcess
    report = mha_harness.check(["tests.hostile_plugins:KillsProcess", "numpy-tiled"], isolate=True, timeout=30,
                           cases=["check_output_projection_mixes_heads"])
    statuses = {r.backend: r.status for r in report.results}
    assert statuses == {KillsProcess.name: "crashed", "numpy-tiled": "passed"}
