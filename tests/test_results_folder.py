"""Results folders: concurrent runs keep each other's backends, files get the user's umask, reports escape
what plugins write."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from mha_harness.conformance.report import BackendInfo, Report
from mha_harness.conformance.results import CaseResult
from mha_harness.util.atomic import write_text_atomic
from mha_harness.util.markdown import md_code, md_text
from tests.conftest import ROOT


def test_two_concurrent_check_runs_into_one_folder_keep_both_runs_backends(tmp_path):
    """Each run writes after every backend and at the end; without lock + merge one run's backends were lost."""
    args = ["--results", str(tmp_path), "--case", "check_scores_scaled_by_sqrt_d_head",
            "--case", "check_heads_are_separated", "--jobs", "1"]
    runs = [subprocess.Popen([sys.executable, "-m", "mha_harness", "check", "--backend", name, *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name in ("numpy-naive", "numpy-tiled")]
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, out + err
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert set(doc["backends"]) == {"numpy-naive", "numpy-tiled"}
    assert {r["backend"] for r in doc["results"]} == {"numpy-naive", "numpy-tiled"}
    md = (tmp_path / "conformance" / "conformance.md").read_text()
    assert "numpy-naive" in md and "numpy-tiled" in md


def _report(name, status="passed", message=""):
    return Report(backends={name: BackendInfo(name)},
                  results=[CaseResult(name, "check_x", name, {}, status, message)])


def test_a_later_run_replaces_its_own_backends_and_keeps_the_others(tmp_path):
    _report("a", "failed").write(tmp_path)
    _report("b").write(tmp_path)
    _report("a").write(tmp_path)
    doc = json.loads((tmp_path / "conformance.json").read_text())
    assert [(r["backend"], r["status"]) for r in doc["results"]] == [("a", "passed"), ("b", "passed")]
    assert doc["earlier_runs"] == ["b"] and doc["ok"]


def test_an_unfinished_backend_of_another_run_is_not_carried_over(tmp_path):
    other = Report(backends={"busy": BackendInfo("busy")}, complete=False)
    other.write(tmp_path)
    _report("mine").write(tmp_path)
    doc = json.loads((tmp_path / "conformance.json").read_text())
    assert list(doc["backends"]) == ["mine"]


def test_files_are_written_with_the_users_umask_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_text_atomic(tmp_path / "x.json", "{}")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o077)
        path = write_text_atomic(tmp_path / "y.json", "{}")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_markdown_escaping_keeps_plugin_text_on_one_literal_line():
    forged = "x |\n## Mutation score\n<script>alert(1)</script> `code` [link](http://e)"
    text = md_text(forged)
    assert "\n" not in text and "<" not in text  # no tag can open ('>' alone opens none and stays readable)
    assert md_text("Tq = 64 > Tk = 1") == "Tq = 64 > Tk = 1"
    assert "|" not in text.replace("\\|", "") and "`" not in text.replace("\\`", "")
    assert md_text("# heading").startswith("\\#") and md_text("> quote").startswith("\\>")
    assert md_code("a`b") == "`` a`b ``" and md_code("a|b", in_table=True) == "`a\\|b`"


def test_a_plugin_cannot_forge_a_section_or_raw_html_in_the_report():
    name = "evil |\n\n## Mutation score\n\n21 of 21 mutants caught <img src=x onerror=alert(1)>"
    report = Report(backends={name: BackendInfo(name, available=False, reason="bad\n# Failures\n<b>x</b>",
                                                load_error=True)},
                    results=[])
    report.backends["good"] = BackendInfo("good")
    report.results.append(CaseResult("good", "check_x", "good", {}, "failed", "msg\n## Mutation score\n<i>",
                                     repro="python -c \"x`y\""))
    md = report.to_markdown()
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert headings == ["# mha-harness conformance report", "## Totals",
                        "## Policies that backends legitimately differ on", "## Not run here", "## Failures"]
    assert "<img" not in md and "<b>" not in md and "<i>" not in md
