"""Plugin code run in the parent (import, construction, availability()) can neither end nor hang the run,
and a run with a failing or missing plugin never exits 0. Fixtures: tests/hostile_loading.py and
tests/hostile_import_*.py."""
from __future__ import annotations

import json
import time

import pytest

import mha_harness
from mha_harness.registry import load_registry
from tests.conftest import run_cli

FAST = {"MHA_HARNESS_PLUGIN_TIMEOUT": "3"}

HOSTILE = {
    "sys:exit": "SystemExit",
    "tests.hostile_import_exit:Backend": "import raised SystemExit: 0",
    "tests.hostile_import_interrupt:Backend": "import raised KeyboardInterrupt",
    "tests.hostile_import_hang:Backend": "import timed out after 3 s",
    "tests.hostile_import_os_exit:Backend": "exited with code 0 before reporting",
    "tests.hostile_loading:ExitsInConstructor": "constructing the backend raised SystemExit: 0",
    "tests.hostile_loading:interrupts_in_factory": "constructing the backend raised KeyboardInterrupt",
    "tests.hostile_loading:ExitsInAvailability": "availability() raised SystemExit: 0",
    "tests.hostile_loading:InterruptsInAvailability": "availability() raised KeyboardInterrupt",
    "tests.hostile_loading:HangsInAvailability": "availability() timed out after 3 s",
}


@pytest.fixture
def fast_timeout(monkeypatch):
    monkeypatch.setenv("MHA_HARNESS_PLUGIN_TIMEOUT", "3")


def test_every_hostile_plugin_is_a_recorded_load_error_and_the_registry_survives(fast_timeout):
    start = time.perf_counter()
    registry = load_registry(list(HOSTILE) + ["tests.hostile_loading:FineNaive"], entry_points=False)
    elapsed = time.perf_counter() - start
    by_spec = {e.spec: e for e in registry.entries.values()}
    for spec, words in HOSTILE.items():
        entry = by_spec[spec]
        assert not entry.available and entry.error and words in entry.error, (spec, entry.error)
    assert by_spec["tests.hostile_loading:FineNaive"].available
    assert registry.get("numpy-naive").available
    assert elapsed < 40  # two 3 s hangs, probed in parallel, never waited on twice


def test_a_spec_is_imported_once_per_process_even_when_it_hangs(fast_timeout):
    load_registry(["tests.hostile_import_hang:Backend"], entry_points=False, builtins=False)
    start = time.perf_counter()
    entry = load_registry(["tests.hostile_import_hang:Backend"], entry_points=False, builtins=False).get(
        "tests.hostile_import_hang:Backend")
    assert time.perf_counter() - start < 1.0 and "timed out" in entry.error


def test_check_in_python_reports_hostile_objects_and_specs_instead_of_exiting(fast_timeout):
    from tests.hostile_loading import ExitsInAvailability, InterruptsInAvailability
    report = mha_harness.check([ExitsInAvailability(), InterruptsInAvailability, "sys:exit"],
                               cases=["check_scores_scaled_by_sqrt_d_head"])
    assert not report.ok
    assert {info.load_error for info in report.backends.values()} == {True}
    assert len(report.backends) == 3


@pytest.mark.parametrize("spec", ["sys:exit", "tests.hostile_import_exit:Backend",
                                  "tests.hostile_import_interrupt:Backend", "tests.hostile_import_os_exit:Backend",
                                  "tests.hostile_loading:ExitsInAvailability",
                                  "tests.hostile_loading:HangsInAvailability"])
def test_check_with_a_hostile_plugin_exits_1_with_the_reason(spec, tmp_path):
    out = run_cli("check", "--backend-spec", spec, "--backend", "numpy-naive", "--results", tmp_path,
                  "--case", "check_scores_scaled_by_sqrt_d_head", env=FAST)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert not doc["ok"] and doc["summary"]["numpy-naive"]["passed"] == 1
    assert [n for n, b in doc["backends"].items() if b["load_error"]] != []


def test_list_survives_hanging_and_exiting_plugins():
    out = run_cli("list", "--backend-spec", "tests.hostile_import_hang:Backend", "--backend-spec", "sys:exit",
                  "--backend-spec", "tests.hostile_loading:HangsInAvailability", env=FAST, timeout=120)
    # every line printed, and exit 1: a spec that does not load is the command's failure (a script can tell)
    assert out.returncode == 1 and "3 --backend-spec backend(s) failed to load" in out.stderr, out.stderr
    assert "import timed out after 3 s" in out.stdout and "availability() timed out after 3 s" in out.stdout
    # like check, list with specs shows only the specs' backends, and says how to see the registered ones
    assert "numpy-naive" not in out.stdout and "registered backends not listed: mha-harness list" in out.stdout


def test_a_report_is_ok_only_when_complete_and_every_available_backend_has_results():
    from mha_harness.conformance.report import BackendInfo, Report
    from mha_harness.conformance.results import CaseResult
    report = Report(backends={"a": BackendInfo("a")})
    assert not report.ok and report.missing_results() == ["a"]
    report.results.append(CaseResult("a", "check_x", "a", {}, "passed"))
    assert report.ok
    report.complete = False
    assert not report.ok


def test_sys_exit_escaping_into_a_command_is_exit_1_not_the_plugins_code(monkeypatch, capsys):
    from mha_harness import cli

    def exits(args):
        raise SystemExit(0)
    monkeypatch.setattr(cli, "cmd_list", exits)
    assert cli.main(["list"]) == 1
    assert "sys.exit(0)" in capsys.readouterr().err


def test_check_rejects_what_it_cannot_take_naming_the_parameter():
    with pytest.raises(TypeError, match="backends: got int 42; accepted: a registered backend name"):
        mha_harness.check(42)
    with pytest.raises(TypeError, match="backends: got an item of type float"):
        mha_harness.check(["numpy-naive", 1.5])
    with pytest.raises(ValueError, match="timeout: got nan"):
        mha_harness.check("numpy-naive", timeout=float("nan"))
    with pytest.raises(ValueError, match="jobs: got 0"):
        mha_harness.check("numpy-naive", jobs=0)
    with pytest.raises(TypeError, match="cases: got 3"):
        mha_harness.check("numpy-naive", cases=3)


def test_repro_with_a_misspelt_case_names_the_closest_cases():
    with pytest.raises(ValueError, match=r"case: got 'check_scores_scaled_by_sqrt_dhead'; did you mean "
                                         r"'check_scores_scaled_by_sqrt_d_head'"):
        mha_harness.repro("numpy-naive", "check_scores_scaled_by_sqrt_dhead")


def test_an_import_error_names_the_plugin_line_that_raised():
    """The load error carries the last frame outside the harness and importlib: the plugin's file and line."""
    import os
    entry = load_registry(["tests.hostile_import:Backend", "nosuchmod_h9a:X"], entry_points=False,
                          builtins=False).entries
    raised = entry["tests.hostile_import:Backend"].error
    assert "import raised ImportError: hostile plugin" in raised
    assert raised.endswith(f"(at {os.path.join('tests', 'hostile_import.py')}:2)") or \
        f"{os.sep}tests{os.sep}hostile_import.py:2)" in raised, raised
    missing = entry["nosuchmod_h9a:X"].error
    assert missing.endswith("No module named 'nosuchmod_h9a'"), missing  # no harness or importlib frame shown


def test_a_syntax_error_in_a_plugin_names_its_file_and_line(tmp_path, monkeypatch):
    """A stranger's syntax slip printed "import raised SyntaxError: invalid syntax. Maybe you meant '==' ..." with
    no file or line: a SyntaxError's traceback ends in the import machinery, so its own filename and lineno say it."""
    (tmp_path / "slip_mod_q3.py").write_text("import numpy\n\nif numpy = 1:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    raised = load_registry(["slip_mod_q3:X"], entry_points=False, builtins=False).entries["slip_mod_q3:X"].error
    assert "import raised SyntaxError" in raised, raised
    assert raised.endswith(f"(at {tmp_path / 'slip_mod_q3.py'}:3)"), raised
