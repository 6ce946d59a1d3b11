"""The three plugin routes, end to end: entry point package, module:object, and the pytest plugin."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """examples/lesson_plugin pip-installed into a private target directory (the test environment is untouched)."""
    target = tmp_path_factory.mktemp("site")
    # a private copy: pip builds in the source tree, and xdist workers may build at the same time
    source = shutil.copytree(ROOT / "examples" / "lesson_plugin", tmp_path_factory.mktemp("src") / "lesson_plugin",
                             ignore=shutil.ignore_patterns("build", "*.egg-info"))
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return {"PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}


def test_entry_point_plugin_appears_in_list(installed_example):
    out = run_cli("list", env=installed_example)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("lesson-mha"))
    assert "available" in line


def test_entry_point_plugin_is_checked(installed_example, tmp_path):
    out = run_cli("check", "--backend", "lesson-mha", "--quick", "--results", tmp_path, env=installed_example)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert doc["summary"]["lesson-mha"]["passed"] > 40
    assert doc["backends"]["lesson-mha"]["source"].startswith("entry point lesson-mha")


def test_entry_point_plugin_is_benchmarked_by_asv_with_no_harness_change(installed_example, tmp_path):
    from tests.test_asv import asv_config, run_asv
    config = asv_config(tmp_path)
    env = {**installed_example, "MHA_ASV_BACKENDS": "lesson-mha", "MHA_ASV_SEQ_LENS": "64"}
    out = run_asv(config, "run", "--python=same", "--quick", "--machine", "plugin-box",
                  "--bench", "TimeForward", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    result_files = [p for p in (tmp_path / "asv" / "plugin-box").glob("*.json") if p.name != "machine.json"]
    results = json.loads(result_files[0].read_text())["results"]
    timed = results["bench_time.TimeForward.time_forward"]
    assert timed[0][0] is not None  # lesson-mha at T=64 was measured, not skipped


def test_module_object_route_on_the_command_line(tmp_path):
    out = run_cli("check", "--backend-spec", "tests.plugin_objects:RenamedNaive", "--quick", "--results", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert list(doc["summary"]) == ["my-naive"] and doc["summary"]["my-naive"]["passed"] > 60


def test_pytest_plugin_runs_the_conformance_suite_on_a_third_party_backend(pytester):
    pytester.makepyfile(my_attention="""
        from mha_harness.implementations.numpy_tiled import NumpyTiled

        class MyAttention(NumpyTiled):
            name = "my-attention"
    """)
    pytester.syspathinsert()
    result = pytester.runpytest("--pyargs", "mha_harness.cases", "--mha-backend", "my_attention:MyAttention", "-q",
                                "-k", "check_scores or check_padding or check_heads")
    result.assert_outcomes(passed=8)  # the padding output case's cross-attention variant included
    result.stdout.no_fnmatch_line("*error*")


@pytest.mark.parametrize("where", ["nonexistent", "not-on-sys-path"])
def test_pytest_plugin_refuses_an_unimportable_backend_spec_as_a_collection_error(pytester, where):
    """Never "26 skipped ... got empty parameter set" and exit 0: the option, the spec, the import error and what
    to do about it, as a collection error."""
    spec = "nosuchmod_h9a:X"
    if where == "not-on-sys-path":  # the plugin's folder exists but is not where pytest imports from
        pytester.mkpydir("elsewhere").joinpath("unlisted_attention_h9a.py").write_text(
            "from mha_harness.implementations.numpy_naive import NumpyNaive as X\n")
        spec = "unlisted_attention_h9a:X"
    result = pytester.runpytest("--pyargs", "mha_harness.cases", "--mha-backend", spec, "-q", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert f"--mha-backend {spec}" in out and "ModuleNotFoundError" in out, out
    assert "must be importable" in out and "python -m pytest" in out and "PYTHONPATH" in out, out
    assert "skipped" not in out


def test_pytest_plugin_leaves_out_the_sys_path_advice_when_the_plugin_lacks_a_dependency(pytester):
    """A stranger's plugin imported fine but needed a package not installed: the error named the missing package and
    the plugin's line, then advised about sys.path, which did not apply. The advice comes only when the spec's own
    module is what cannot be found."""
    pytester.makepyfile(needs_dep_h9a="import mylab_not_installed_h9a  # noqa: F401\n")
    pytester.syspathinsert()
    result = pytester.runpytest("--pyargs", "mha_harness.cases", "--mha-backend", "needs_dep_h9a:X", "-q",
                                "-p", "no:cacheprovider")
    assert result.ret != 0
    out = result.stdout.str()
    assert "No module named 'mylab_not_installed_h9a'" in out and "needs_dep_h9a.py:1" in out, out
    assert "must be importable" not in out


@pytest.mark.parametrize("option, words", [
    ("my_pkg.attn:MyAttention,jax-dpa", ["--mha-backend: backend spec: got 'my_pkg.attn:MyAttention,jax-dpa'",
                                         "repeat --mha-backend for several"]),
    ("jax_dpa", ["--mha-backend: backend: got 'jax_dpa'; did you mean 'jax-dpa'", "accepted: one of"]),
])
def test_pytest_plugin_names_a_malformed_or_unknown_backend_without_a_traceback(pytester, option, words):
    """A comma-separated --mha-backend gave a traceback from the registry's internals (a stranger's finding)."""
    result = pytester.runpytest("--pyargs", "mha_harness.cases", "--mha-backend", option, "-q",
                                "-p", "no:cacheprovider")
    assert result.ret != 0
    out = result.stdout.str()
    for word in words:
        assert word in out, out
    assert "Traceback" not in out and "registry.py" not in out and "checking.py" not in out, out


def test_pytest_plugin_reports_a_broken_backend_as_failures_with_readable_ids(pytester):
    pytester.makepyfile(broken="""
        from mha_harness.implementations.mutants.zoo import MUTANTS, MutantBackend
        Broken = MutantBackend(next(m for m in MUTANTS if m.name == "mutant-scale-sqrt-d-model"))
    """)
    pytester.syspathinsert()
    result = pytester.runpytest("--pyargs", "mha_harness.cases", "--mha-backend", "broken:Broken", "-q", "-rf",
                                "-k", "check_scores_scaled_by_sqrt_d_head")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*check_scores_scaled_by_sqrt_d_head[[]mutant-scale-sqrt-d-model-float32[]]*",
                                 "*1/sqrt(d_model)*"])


def test_pytest_plugin_turns_declared_divergences_into_xfail(pytester):
    pytest.importorskip("jax")
    result = pytester.runpytest("--pyargs", "mha_harness.cases", "--mha-backend", "jax-dpa", "-q",
                                "-k", "check_fully_masked_rows_output_zeros")
    # padding, bool and additive masks, in each dtype it declares (float32, float64, bfloat16 here): jax-dpa
    # declares the uniform average for all (the count is not read from jax-dpa itself: importing jax into this
    # process beside torch aborted it)
    result.assert_outcomes(xfailed=9)


def test_pytest_plugin_is_inert_in_other_projects(pytester):
    pytester.makepyfile(test_other="def test_one():\n    assert True\n")
    result = pytester.runpytest("-q")
    result.assert_outcomes(passed=1)
