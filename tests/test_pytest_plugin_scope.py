"""The pytest plugin acts only when asked: other projects' runs are untouched, and the scikit-learn style decorator
runs the cases from a user's own test file."""
from __future__ import annotations

import numpy  # noqa: F401 - imported before pytester's in-process runs, which cannot load numpy twice
import pytest

pytest_plugins = ["pytester"]

UNRELATED = '''
from unittest.mock import Mock


class LazyProxy:
    """Like lazy_object_proxy / django's SimpleLazyObject: forwards every attribute, even __class__, to a target
    built on first use -- here a function that even carries the mark mha-harness gives its own case tests."""

    def __init__(self, factory):
        object.__setattr__(self, "_factory", factory)

    @property
    def __class__(self):
        return type(self._factory())

    def __getattr__(self, name):
        return getattr(self._factory(), name)


def _target():
    def check_scores_scaled_by_sqrt_d_head(mha_backend, mha_params):
        raise AssertionError("a proxy was collected as an mha-harness case")
    check_scores_scaled_by_sqrt_d_head._mha_case = "check_scores_scaled_by_sqrt_d_head"
    return check_scores_scaled_by_sqrt_d_head


check_x = Mock()
check_lazy = LazyProxy(_target)


def test_the_project_s_own_test():
    assert check_x.anything is not None
'''


@pytest.mark.parametrize("extra", [[], ["--mha-backend", "numpy-naive"]], ids=["plain", "with-mha-backend"])
def test_an_unrelated_project_with_check_mocks_and_proxies_collects_and_passes(pytester, extra):
    pytester.makepyfile(test_unrelated=UNRELATED)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", *extra)
    result.assert_outcomes(passed=1)
    assert "error" not in result.stdout.str().lower()


def test_the_same_project_passes_alike_with_the_plugin_disabled(pytester):
    pytester.makepyfile(test_unrelated=UNRELATED)
    pytester.runpytest("-q", "-p", "no:mha_harness").assert_outcomes(passed=1)


def test_importing_the_plugin_imports_no_case_backend_or_framework():
    """pytest loads the plugin in every run of the environment: an unrelated project pays for two small modules,
    not for the core (nor NumPy)."""
    import subprocess
    import sys
    code = ("import sys, mha_harness.pytest_plugin; "
            "print(sorted(m for m in sys.modules if m.startswith(('mha_harness', 'numpy', 'torch', 'jax'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['mha_harness', 'mha_harness.pytest_plugin']"


def test_parametrize_with_cases_runs_the_cases_in_a_user_s_test_file(pytester):
    pytester.makepyfile(test_mine='''
        from mha_harness import parametrize_with_cases
        from mha_harness.implementations.numpy_tiled import NumpyTiled


        class MyAttention(NumpyTiled):
            name = "my-attention"


        @parametrize_with_cases(MyAttention(), cases=["check_scores_scaled_by_sqrt_d_head",
                                                      "check_attention_weights_match_reference"])
        def test_my_attention(backend, case):
            case(backend)
    ''')
    result = pytester.runpytest("-q", "-rs", "--collect-only")
    # flat ids: a stranger's node ids nested brackets (test_my_attention[check_...[my-attention-float32]])
    result.stdout.fnmatch_lines(["*test_my_attention[[]check_scores_scaled_by_sqrt_d_head-my-attention-float32[]]"])
    result = pytester.runpytest("-q", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    # a skip is reported at the user's test, not at the harness line that raised it (as_pytest.py)
    result.stdout.fnmatch_lines(["SKIPPED [[]*[]] test_mine.py:*: *does not declare capability 'attention_weights'*"])
    assert "as_pytest.py" not in result.stdout.str()


def test_parametrize_with_cases_shows_the_slow_case_as_skipped_with_how_to_run_it(pytester):
    """A stranger's CI test file left the slow case out silently (the --pyargs route skips it with a reason): it is
    collected and skipped, naming include_slow=True."""
    pytester.makepyfile(test_mine='''
        from mha_harness import parametrize_with_cases
        from mha_harness.implementations.numpy_tiled import NumpyTiled


        @parametrize_with_cases(NumpyTiled(), cases=["check_long_sequence_sampled_rows_match_reference"])
        def test_mine(backend, case):
            case(backend)
    ''')
    result = pytester.runpytest("-q", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*slow case (T = 8192): --mha-include-slow or parametrize_with_cases(..., "
                                 "include_slow=True) runs it*"])


def test_parametrize_with_cases_runs_the_slow_case_with_mha_include_slow(pytester):
    """A stranger's nightly CI passed --mha-include-slow to a decorated test file and still got the skip: the
    option applies to both routes."""
    pytester.makepyfile(test_mine='''
        from mha_harness import parametrize_with_cases
        from mha_harness.implementations.numpy_naive import NumpyNaive


        @parametrize_with_cases(NumpyNaive(), cases=["check_long_sequence_sampled_rows_match_reference"])
        def test_mine(backend, case):
            case(backend)
    ''')
    result = pytester.runpytest("-q", "-rs", "--mha-include-slow", "-W", "error::pytest.PytestConfigWarning")
    result.assert_outcomes(passed=2, warnings=0)  # an outside user's strict project: it warned it had done nothing
    result = pytester.runpytest("-q", "-rs", "--mha-include-slow", "--mha-search", "--mha-backend", "numpy-tiled",
                                "--collect-only")
    result.stdout.fnmatch_lines(["*--mha-backend, --mha-search given: these act only on 'pytest --pyargs "
                                 "mha_harness.cases'; parametrize_with_cases' tests take their backends from the "
                                 "decorator's argument, and the search runs from a test of your own: *"])


def test_parametrize_with_cases_fails_a_broken_backend_with_the_case_message(pytester):
    pytester.makepyfile(test_broken='''
        import numpy as np
        from mha_harness import AttentionOutput, parametrize_with_cases
        from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded


        class _Doubled(NumpyNaiveLoaded):
            def compute(self, inputs, *, need_weights=False):
                out = super().compute(inputs, need_weights=need_weights)
                return AttentionOutput(2 * out.output, out.weights)


        class Doubled(NumpyNaive):
            name = "doubled"
            loaded_class = _Doubled


        @parametrize_with_cases(Doubled(), cases=["check_output_projection_mixes_heads"])
        def test_doubled(backend, case):
            case(backend)
    ''')
    result = pytester.runpytest("-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*failed: output vs concat(heads) @ W_o*", "*repro: python -c*"])
    # a stranger's repro line from parametrize_with_cases named the backend by a name no registry knows: it names
    # the object's module:object now, and reruns the failure from the test's folder
    import re
    import subprocess
    import sys
    repro = re.search(r"repro: (python -c '.*')", str(result.stdout))
    assert repro and "test_broken:Doubled" in repro.group(1), repro
    rerun = subprocess.run(repro.group(1).replace("python", sys.executable, 1), shell=True, cwd=pytester.path,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 1 and "RegistryError" not in rerun.stderr, rerun.stderr[-1500:]


def test_a_spec_backend_s_repro_under_the_plugin_names_the_spec_and_runs(tmp_path):
    """A stranger pasted a repro line printed under `--mha-backend module:object`: it named the backend by a name no
    registry knows and raised RegistryError. It names the spec now, as `check --backend-spec` does, and runs."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    spec = "tests.always_causal_objects:GPTCausalSelfAttentionSeesNextToken"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "mha_harness.cases",
                           "--mha-backend", spec, "-k", "check_causal_output_matches_reference", "-q"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    repro = re.search(r"repro: (python -c '.*')", done.stdout)
    assert done.returncode == 1 and repro, done.stdout[-1500:]
    assert f'repro("{spec}"' in repro.group(1)
    pasted = subprocess.run(repro.group(1), shell=True, cwd=root, capture_output=True, text=True, env=env,
                            timeout=300)
    assert pasted.returncode == 1 and "failed:" in pasted.stdout and "Traceback" not in pasted.stderr, \
        pasted.stdout + pasted.stderr


def test_a_run_with_diagnosed_failures_ends_with_the_mistakes_they_match(pytester):
    """A stranger's pytest run showed each failure's message, but the line `mha-harness check` prints under a FAIL
    ("diagnosed: ... in N variant(s) of ...") had no pytest equivalent: the first failure shown can be a case whose
    message has numbers only. The run now ends with that line per backend."""
    pytester.makepyfile(test_scaled='''
        from mha_harness import parametrize_with_cases
        from mha_harness.implementations.mutants import MUTANTS
        from mha_harness.implementations.mutants.zoo import MutantBackend

        SCALED = MutantBackend(next(m for m in MUTANTS if m.name == "mutant-scale-sqrt-d-model"), weights=False)


        @parametrize_with_cases(SCALED, cases=["check_output_matches_reference"])
        def test_scaled(backend, case):
            case(backend)
    ''')
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*mha-harness diagnoses*",
                                 "mutant-scale-sqrt-d-model: diagnosed: the output matches scores scaled by "
                                 "1/sqrt(d_model)* [[]in * variant(s) of check_output_matches_reference[]]*"])


def test_the_diagnoses_summary_stays_out_of_other_projects_runs(pytester):
    pytester.makepyfile(test_plain='''
        def test_fails():
            assert 1 == 2
    ''')
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    assert result.ret == 1 and "mha-harness diagnoses" not in str(result.stdout)


def test_the_case_options_warn_when_no_mha_harness_case_was_collected(pytester):
    """An outside user's ``pytest --mha-backend mine`` in their own project ran only their own tests, silently: the
    option acts only on mha_harness's cases module, and now a warning says so and how to run them."""
    pytester.makepyfile(test_unrelated=UNRELATED)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", "--mha-backend", "numpy-naive")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*--mha-backend given, but no mha-harness case was collected*"])
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=0)
