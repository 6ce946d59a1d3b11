"""One import namespace and layers that only point down: what the package installs, what a user's working
directory cannot shadow, and that the import contracts CI checks really bite."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli

DECOYS = ("cases", "harness", "implementations")


def test_the_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python -m pip")]
    assert len(ci) == 1
    assert f"\n    {ci[0]}\n" in (ROOT / "README.md").read_text()
    assert "ruff check ." in ci[0] and "lint-imports" in ci[0] and ci[0].endswith("python -m pytest")


@pytest.mark.parametrize("name", DECOYS)
def test_the_source_folders_are_not_top_level_import_names(name, tmp_path):
    """After install only mha_harness is importable: not cases, harness or implementations (names other
    distributions and many projects' own folders use)."""
    out = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0 and f"No module named '{name}'" in out.stderr


def test_the_test_suite_itself_cannot_import_the_source_folders():
    """conftest.py takes the repository root off sys.path, so the tests exercise the installed namespace."""
    for name in DECOYS:
        with pytest.raises(ModuleNotFoundError):
            __import__(name)


def test_check_in_a_directory_with_its_own_cases_harness_and_implementations_runs_the_real_cases(tmp_path):
    """A user's own cases/, harness/ and implementations/ packages (here: ones that refuse to be imported) shadow
    nothing: ``python -m mha_harness`` (which puts the working directory first on sys.path) runs the real cases."""
    for name in DECOYS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the decoy {name} package was imported')\n")
    results = tmp_path / "out"
    out = run_cli("check", "--backend", "numpy-naive", "--case", "check_scores_scaled_by_sqrt_d_head",
                  "--case", "check_heads_are_separated", "--no-isolate", "--results", results, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "decoy" not in out.stdout + out.stderr
    doc = json.loads((results / "conformance" / "conformance.json").read_text())
    assert doc["summary"]["numpy-naive"]["passed"] >= 2


def _lint_imports(cwd, env=None):
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def test_the_layer_contract_refuses_an_import_that_points_up(tmp_path):
    """A copy of the package where the contract imports the registry (a layer above) breaks the contract."""
    pytest.importorskip("importlinter")
    copy = tmp_path / "mha_harness"
    shutil.copytree(ROOT / "harness", copy, ignore=shutil.ignore_patterns("__pycache__"))  # follows the links
    offender = copy / "contract" / "numerics.py"
    offender.write_text(offender.read_text() + "\nfrom mha_harness import registry  # noqa: E402,F401\n")
    import os
    out = _lint_imports(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"mha_harness\.contract is not allowed to import\s+mha_harness\.registry", out.stdout), out.stdout
    assert "mha_harness.contract.numerics -> mha_harness.registry" in out.stdout
