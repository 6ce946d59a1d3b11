"""mha-harness search: hypothesis finds mutants, shrinks them to small runnable repros that are saved as regression
cases `check` replays, honours declared capabilities and divergences, and passes on numpy-tiled."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mha_harness
from mha_harness.conformance.isolation import Target
from mha_harness.conformance.search import MUTANT_SPEC, search_backend
from mha_harness.conformance.search_examples import (
    SEARCH_DIR_ENV,
    Coverage,
    build,
    load_regression,
    repro_line,
    saved_regressions,
)
from mha_harness.conformance.strategies import SearchSpace, logit_scales
from mha_harness.contract.api import AttentionInputs, Capabilities
from mha_harness.implementations.mutants import mutant_backends
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.toolkit.divergences import (
    masked_poison_divergences,
    nan_fully_masked_divergences,
    uniform_fully_masked_divergences,
)

pytest.importorskip("hypothesis")
MUTANTS = {b.name: b for b in mutant_backends()}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _search(name, tmp_path, **options):
    return search_backend(Target(MUTANTS[name], MUTANT_SPEC), results=tmp_path, isolate=False,
                          **{"max_examples": 200, "seed": 0, **options})


@pytest.mark.parametrize("name, needs", [
    # a decode step is bottom-right causal too
    ("mutant-causal-always-top-left", lambda e: e["causal"] == "bottom-right" or e.get("decode_step")),
    ("mutant-nan-poison-leaks", lambda e: e["poison"] == "nan"),
    ("mutant-fully-masked-rows-nan", lambda e: e["padding"] or e["attn_mask"] or e["tq"] > e["tk"]),
    ("mutant-heads-reversed", lambda e: e["heads"] == 2),
], ids=lambda x: x if isinstance(x, str) else "")
def test_search_finds_a_mutant_and_shrinks_it_to_a_tiny_example(name, needs, tmp_path):
    outcome = _search(name, tmp_path)
    assert not outcome.passed, f"{name} was not found"
    e = outcome.example
    assert max(e["batch"], e["tq"], e["tk"], e["heads"], e["d_head"]) <= 2, outcome.lines()
    assert needs(e), outcome.lines()
    saved = load_regression(outcome.saved)
    assert saved["example"] == e and saved["backend"] == name and saved["repro"] == outcome.repro
    # the folder the pytest route replays it from: the one that holds a folder per backend (a stranger pointed
    # MHA_HARNESS_SEARCH_DIR at the --results folder and saw the regression skipped)
    assert f"MHA_HARNESS_SEARCH_DIR={tmp_path / 'search'})" in outcome.lines()[-1], outcome.lines()[-1]


def test_printed_repro_runs_when_pasted_into_bash(tmp_path):
    outcome = _search("mutant-no-scale", tmp_path)
    assert outcome.repro.startswith("python -c '")
    done = subprocess.run(["bash", "-c", outcome.repro.replace("python", sys.executable, 1)], cwd=tmp_path,
                          capture_output=True, text=True, env=ENV, timeout=120)
    # like check's repro: one "failed: ..." line naming the mistake, exit 1, no traceback
    assert done.returncode == 1 and "failed: output: expected" in done.stdout, done.stdout[-800:] + done.stderr[-800:]
    assert "the output matches scores scaled by 1 (no scaling)" in done.stdout, done.stdout[-800:]
    assert "Traceback" not in done.stderr, done.stderr[-800:]
    fixed = repro_line("numpy-naive", None, outcome.example)
    done = subprocess.run(["bash", "-c", fixed.replace("python", sys.executable, 1)], cwd=tmp_path,
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 0 and "passed" in done.stdout, done.stderr[-800:]


def test_a_search_failure_names_the_common_mistake_like_check(tmp_path):
    """The shrunk example's message says which known mistake the output matches, as check's cases do."""
    outcome = _search("mutant-scale-sqrt-d-model", tmp_path)
    assert "the output matches scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)" in outcome.message, \
        outcome.lines()


def test_no_scale_diagnosis_where_every_common_scale_is_the_right_one():
    """d_model = d_head = 1: 1/sqrt(d_model), none and 1/d_head are all 1/sqrt(d_head); nothing to name."""
    from mha_harness.conformance.casekit import wrong_scale
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_inputs, make_params
    params = make_params(AttentionConfig(1, 1), seed=0)
    inputs = make_inputs(params.config, 1, 2, 2, seed=0)
    assert wrong_scale(np.zeros((1, 2, 1)), params, inputs, 1e-7) is None


def test_replay_called_from_code_raises_the_failure():
    from mha_harness.checking import replay
    from mha_harness.conformance.casekit import CaseFailure
    example = {"dtype": "float32", "form": "separate", "batch": 1, "tq": 1, "tk": 2, "heads": 1, "kv_heads": 1,
               "d_head": 2, "bias": False, "causal": None, "padding": None, "attn_mask": None, "logit_scale": 1,
               "cut": 1, "poison": "random", "gradients": False, "malformed": None, "seed": 0}
    with pytest.raises(CaseFailure, match=r"scaled by 1 \(no scaling\)"):
        replay("mha_harness.implementations.mutants:mutant_backends", example, name="mutant-no-scale")


def test_same_seed_same_search(tmp_path):
    first = _search("mutant-value-bias-dropped", tmp_path / "a")
    second = _search("mutant-value-bias-dropped", tmp_path / "b")
    assert (first.example, first.examples) == (second.example, second.examples)


def test_saved_regression_is_replayed_by_check_and_fails_the_mutant(tmp_path, monkeypatch):
    outcome = _search("mutant-no-output-projection", tmp_path)
    monkeypatch.setenv(SEARCH_DIR_ENV, str(tmp_path / "search"))
    assert [p.name for p in saved_regressions("mutant-no-output-projection")] == [Path(outcome.saved).name]
    report = mha_harness.check(MUTANTS["mutant-no-output-projection"], cases=["check_search_regressions_still_pass"])
    assert [r.status for r in report.results] == ["failed"] and "output" in report.results[0].message
    # the same example replayed on a correct backend passes
    (tmp_path / "search" / "numpy-naive").mkdir()
    Path(outcome.saved).rename(tmp_path / "search" / "numpy-naive" / Path(outcome.saved).name)
    report = mha_harness.check(NumpyNaive(), cases=["check_search_regressions_still_pass"])
    assert [r.status for r in report.results] == ["passed"]


def test_regression_case_skips_with_a_reason_when_none_is_saved(tmp_path, monkeypatch):
    monkeypatch.setenv(SEARCH_DIR_ENV, str(tmp_path))
    result = mha_harness.check(NumpyNaive(), cases=["check_search_regressions_still_pass"]).results[0]
    assert result.status == "skipped" and "no search regression saved" in result.message


def test_search_draws_only_what_the_backend_declares():
    class Narrow(NumpyNaive):
        name = "narrow"
        capabilities = Capabilities(dtypes=("float64",), causal_alignments=("top-left",), key_padding_mask=False,
                                    additive_attn_mask=False, cross_attention=False, grouped_query=False, bias=False)
    space = SearchSpace.for_backend(Narrow())
    assert space.dtypes == ("float64",) and space.causal == (None, "top-left") and not space.padding
    assert space.mask_kinds == ("bool",) and not space.cross_attention and not space.grouped_query
    from hypothesis import given, settings

    from mha_harness.conformance.strategies import examples

    @settings(max_examples=60, deadline=None, database=None)
    @given(examples(space))
    def drawn(e):
        assert e["dtype"] == "float64" and e["tq"] == e["tk"] and e["kv_heads"] == e["heads"]
        assert e["padding"] is None and not e["bias"] and e["causal"] in (None, "top-left")
        assert e["attn_mask"] is None or e["attn_mask"]["kind"] == "bool"
        params, inputs = build(e)
        assert isinstance(inputs, AttentionInputs) and inputs.features() <= {"causal:top-left", "bool_attn_mask",
                                                                          f"inputs:{e['form']}"}
    drawn()


def test_dtype_and_no_gradients_narrow_the_search_and_a_dtype_not_declared_is_named(tmp_path):
    """--dtype keeps only those declared dtypes, --no-gradients draws no gradient example; a --dtype the backend does
    not declare is a usage error (exit 2) naming the option and what the backend is searched in."""
    from mha_harness.implementations.torch_eager import TorchEager

    space = SearchSpace.for_backend(TorchEager(), dtypes=("float32",), gradients=False)
    assert space.dtypes == ("float32",) and not space.gradients
    assert SearchSpace.for_backend(TorchEager()).gradients
    with pytest.raises(ValueError, match=r"--dtype: got float16; numpy-naive is searched in float32, float64"):
        SearchSpace.for_backend(NumpyNaive(), dtypes=("float16",))
    done = subprocess.run([sys.executable, "-m", "mha_harness", "search", "--backend", "numpy-naive", "--dtype",
                           "float16", "--no-isolate", "--results", str(tmp_path)], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert done.returncode == 2 and "--dtype: got float16" in done.stderr, done.stderr


def test_declared_divergences_are_not_searched():
    class UniformAverage(NumpyNaive):
        name = "uniform"
        divergences = uniform_fully_masked_divergences("finite mask value") + masked_poison_divergences("0 * NaN")
    coverage = Coverage.of(UniformAverage())
    assert not coverage.compare_empty_rows and coverage.poisons == ("random",)
    assert Coverage.of(UniformAverage()).empty_rows_in("float64") == "uniform_average"
    assert Coverage.of(NumpyNaive()) == Coverage((), ("random", "nan", "inf"), ("float32", "float64"),
                                                 ("float32", "float64"))

    class PerDtype(NumpyNaive):  # Hugging Face's eager rows: NaN in float64, the uniform average else
        name = "per-dtype"
        divergences = (uniform_fully_masked_divergences("finite minimum", dtypes=("float32",))
                       + nan_fully_masked_divergences("-inf in a float32 softmax", dtypes=("float64",)))
    per_dtype = Coverage.of(PerDtype())
    assert (per_dtype.empty_rows_in("float32"), per_dtype.empty_rows_in("float64")) == ("uniform_average", "nan")


def test_a_declared_empty_row_backward_leaves_every_other_gradient_searched():
    """The fully-masked helpers also declare the gradient case's ``empty_row`` variant: that covers rows with no key,
    whose gradients the search never checks, not the gradients of every example (an outside user's muP backward
    with the standard scale in dS passed 200 examples: 'no failure', 0 calls of its backward)."""
    from mha_harness.conformance.search_examples import check_example
    from mha_harness.implementations.mutants.zoo import MUTANTS, MutantBackend

    mutant = next(m for m in MUTANTS if m.name == "mutant-gradient-score-scale-left-out")
    backend = MutantBackend(mutant)
    backend.divergences = tuple(backend.divergences) + uniform_fully_masked_divergences("finite mask value")
    assert Coverage.of(backend).gradient_dtypes == backend.capabilities.dtypes
    example = {"batch": 2, "tq": 5, "tk": 5, "heads": 2, "kv_heads": 2, "d_head": 8, "bias": True, "seed": 4,
               "dtype": "float32", "gradients": True}
    with pytest.raises(AssertionError, match="gradient"):
        check_example(backend, example)


def test_logit_scales_reach_exp_overflow_of_each_dtype():
    assert logit_scales("float64") == (1, 10, 100, 1000) and logit_scales("float32") == (1, 10, 100)


def test_cli_search_on_a_mutant_exits_1_with_a_repro_and_bad_options_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "mha_harness", "search", "--results", str(tmp_path)]
    done = subprocess.run(cmd + ["--backend", "mutant-no-scale", "--max-examples", "50", "--seed", "0"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "repro: python -c '" in done.stdout and "minimal example: B=1" in done.stdout
    assert list((tmp_path / "search" / "mutant-no-scale").glob("*.json"))
    done = subprocess.run(cmd + ["--backend", "numpy-naive", "--max-examples", "0"], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert done.returncode == 2 and "--max-examples" in done.stderr


@pytest.mark.slow
def test_cli_search_numpy_tiled_200_examples_passes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mha_harness", "search", "--backend", "numpy-tiled",
                           "--max-examples", "200", "--seed", "0", "--results", str(tmp_path)],
                          capture_output=True, text=True, env=ENV, timeout=900)
    assert done.returncode == 0 and "no failure" in done.stdout, done.stdout + done.stderr


def test_pytest_mha_search_runs_one_search_test_per_backend(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "mha_harness.cases",
                           "--mha-backend", "numpy-naive", "--mha-backend", MUTANT_SPEC, "--mha-search",
                           "--mha-search-examples", "30", "-k", "search_property_holds and (naive or no-output)", "-q"],
                          cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert "1 failed, 1 passed" in done.stdout, done.stdout[-2000:]
    assert "search_property_holds[mutant-no-output-projection]" in done.stdout and "repro: python -c" in done.stdout
    assert list((tmp_path / "results" / "search" / "mutant-no-output-projection").glob("*.json"))
    quiet = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "mha_harness.cases",
                            "--mha-backend", "numpy-naive", "--collect-only", "-q", "-k", "search_property_holds"],
                           cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert "search_property_holds" not in quiet.stdout  # without --mha-search there is no search test


def test_search_writes_nothing_into_the_current_folder(tmp_path, monkeypatch):
    """hypothesis's own caches (its constants cache) go under <results>/search/.hypothesis, not ./.hypothesis in the
    folder the user runs from (a clone of the repository, say); hypothesis's home is restored afterwards."""
    from hypothesis import configuration

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = vars(configuration).get("__hypothesis_home_directory")
    search_backend(Target(MUTANTS["mutant-no-scale"], MUTANT_SPEC), results=tmp_path / "results", isolate=False,
                   max_examples=20, seed=0, save=False)
    assert list(cwd.iterdir()) == []  # (whether hypothesis writes its caches at all depends on what ran before)
    assert vars(configuration).get("__hypothesis_home_directory") == before


def test_search_rebuilds_a_spec_backend_in_its_worker_instead_of_pickling_it(tmp_path):
    """A factory's class made with type() under a name the module does not hold cannot be pickled; `check` rebuilt
    it from its module:object spec, but `search` pickled it and died with a PicklingError traceback (a stranger's
    broken-copy plugins). Both now rebuild it from the spec."""
    done = subprocess.run([sys.executable, "-m", "mha_harness", "search", "--backend-spec",
                           "tests.plugin_objects:two_backends", "--max-examples", "5", "--seed", "0", "--no-gradients",
                           "--results", str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "search other-naive:" in done.stdout and "Traceback" not in done.stdout + done.stderr


def test_search_of_an_unpicklable_python_object_says_how_to_give_it(tmp_path):
    backend = NumpyNaive()
    backend.hook = lambda: None  # an attribute pickle cannot send
    outcome = search_backend(Target(backend), results=tmp_path, max_examples=5, seed=0)
    assert not outcome.passed and "cannot send the backend to a worker process" in outcome.message
    assert "module:object" in outcome.message and "--no-isolate" in outcome.message


def test_a_backend_that_refuses_every_draw_fails_the_search_with_the_reason(tmp_path):
    """Every example raising Unsupported made hypothesis give up with an Unsatisfiable traceback; it is a failed
    search saying that no example ran, with the backend's reasons and how often each was given."""
    import dataclasses

    from mha_harness.contract.api import Unsupported
    from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

    class RefusesAll(NumpyNaiveLoaded):
        def compute(self, inputs, *, need_weights=False):
            raise Unsupported("only calls from my own model")

    class Picky(NumpyNaive):
        name = "picky"
        capabilities = dataclasses.replace(NumpyNaive.capabilities, gradients=False)

        def load_native(self, params, dtype):
            return RefusesAll(params, dtype)

    outcome = search_backend(Target(Picky()), results=tmp_path, isolate=False, max_examples=5, seed=0,
                             time_budget=30)
    assert not outcome.passed and outcome.example is None
    assert outcome.message.startswith("no example ran: all ") and "only calls from my own model" in outcome.message
    assert f"{outcome.rejected}x only calls from my own model" in outcome.message
    assert outcome.lines()[0].endswith(": FAILED") and len(outcome.lines()) == 2


def test_a_search_counts_every_reason_for_rejecting_a_draw_not_only_the_first():
    """A backend refusing draws for several reasons: the summary names each with its count, commonest first, so
    the reason behind most rejections is not hidden behind the first one given."""
    from mha_harness.conformance.search import SearchOutcome

    outcome = SearchOutcome("picky", passed=True, examples=40, rejected=31,
                            rejections={"no float16": 3, "biases only": 20, "T <= 64 only": 5, "no padding": 2,
                                        "no masks": 1})
    head = outcome.lines()[0]
    assert "(31 of them rejected as unsupported and drawn again: 20x biases only; 5x T <= 64 only; 3x no float16; " \
           "2 other reason(s), 3 draw(s))" in head


#: an outside user's search example: per-(batch, head) bool mask leaving query row 0 no key in head 0 only
ROW_EMPTY_IN_ONE_HEAD = {"dtype": "float32", "form": "self", "batch": 1, "tq": 2, "tk": 2, "heads": 2, "kv_heads": 2,
                         "d_head": 2, "bias": False, "causal": None, "padding": None,
                         "attn_mask": {"kind": "bool", "per": "batch_head", "density": 0.5, "empty_rows": [],
                                       "seed": 0},
                         "logit_scale": 1, "cut": 1, "poison": "random", "gradients": True, "malformed": None,
                         "seed": 0}


def test_a_row_with_no_key_in_one_head_is_held_to_the_declared_uniform_average():
    """Search compared a row that has no key in one head (and keys in another) with the zeros convention although
    the backend declares the uniform average (an outside user's Gemma layer, Hugging Face's finite-minimum masks,
    failed with a misleading diagnosis); it is now compared with the declared output, and a layer that gives zeros
    there while declaring the uniform average, or the uniform average undeclared, fails."""
    from mha_harness.conformance.casekit import CaseFailure
    from mha_harness.conformance.search_examples import check_example
    from mha_harness.contract.reference import allowed_and_bias
    from tests.empty_row_layers import Held, HeldUndeclared

    params, inputs = build(ROW_EMPTY_IN_ONE_HEAD)
    allowed = np.broadcast_to(allowed_and_bias(params, inputs)[0], (1, 2, 2, 2))
    no_key = ~allowed.any(axis=-1)  # (batch, head, query)
    assert no_key.any() and not no_key.all(axis=1).any()  # empty in one head, never in both
    check_example(Held(), ROW_EMPTY_IN_ONE_HEAD)
    # separate arrays: the leakage check too leaves such a row out (its uniform average takes in every key, masked
    # ones too); jax-dpa's search failed on this example before
    separate = {**ROW_EMPTY_IN_ONE_HEAD, "form": "separate", "tq": 3, "d_head": 1, "cut": 0, "gradients": False}
    check_example(Held(), separate)
    with pytest.raises(CaseFailure):
        check_example(HeldUndeclared(), ROW_EMPTY_IN_ONE_HEAD)

    class ZerosDeclaredUniform(NumpyNaive):
        name = "zeros-declared-uniform"
        divergences = uniform_fully_masked_divergences("claimed, not true")
    with pytest.raises(CaseFailure):
        check_example(ZerosDeclaredUniform(), ROW_EMPTY_IN_ONE_HEAD)


def test_a_dtype_left_out_for_a_declared_divergence_is_refused_saying_why():
    """An outside user's Gemma layer declaring float64 computed at float32 was told only "searched in float32"."""
    from mha_harness.toolkit.divergences import precision_divergences

    class Float32Inside(NumpyNaive):
        name = "float32-inside"
        divergences = precision_divergences("float64", "float32", "a float32 softmax",
                                            ("check_output_matches_reference",))
    with pytest.raises(ValueError, match=r"searched in float32 \(float64 not: a divergence from the reference "
                                         r"declared for check_output_matches_reference"):
        SearchSpace.for_backend(Float32Inside(), dtypes=("float64",))


def test_a_plugin_error_found_by_search_says_where_it_was_raised(tmp_path):
    """An outside user's config error raised in native_parameter_shapes was reported by search as its type and
    message alone (check's errors give file:line): the worker's file:line is kept."""
    from tests.plugin_objects import ConfigRefusedWhenCounted

    outcome = search_backend(Target(ConfigRefusedWhenCounted(), "tests.plugin_objects:ConfigRefusedWhenCounted"),
                             results=tmp_path, max_examples=5, seed=0)
    assert not outcome.passed and "RuntimeError: RoPE requires an even rotary dimension" in outcome.message
    assert "plugin_objects.py:" in outcome.message, outcome.message



def test_a_failure_message_is_shown_whole_up_to_1200_characters_and_cut_saying_where_the_rest_is():
    """An outside user's 602-character message ended mid-diagnosis ('...; or masked scores') with no mark."""
    from mha_harness.conformance.search import MESSAGE_SHOWN_CHARS, SearchOutcome
    diagnosis = "; the output matches masked scores set to 0 instead of -inf"
    whole = SearchOutcome("b", passed=False, message="x" * 700 + diagnosis)
    assert whole.lines()[1].strip().endswith(diagnosis)
    long = SearchOutcome("b", passed=False, message="x" * (MESSAGE_SHOWN_CHARS + 10), saved="/r/search/b/1.json")
    assert long.lines()[1].endswith("... (cut; the whole message is in /r/search/b/1.json)")


def test_the_search_runs_from_python_saving_nothing_unless_given_a_results_folder(tmp_path, monkeypatch):
    """An outside user in a notebook had to shell out to `mha-harness search`: mha_harness.search returns one
    outcome per backend, writes nothing by default, and saves the shrunk example (which check replays) under
    results/search/ when given a folder; its bad arguments name the parameter."""
    import mha_harness
    from mha_harness.implementations.mutants import mutant_backends
    monkeypatch.chdir(tmp_path)
    mutant = next(b for b in mutant_backends() if b.name == "mutant-scale-sqrt-d-model")
    clean, found = mha_harness.search(["numpy-naive", mutant], quick=True, seed=0, time_budget=30)
    assert clean.passed and clean.examples > 0 and clean.example is None
    assert not found.passed and found.example is not None and "sqrt(d_model)" in found.message and found.saved is None
    assert list(tmp_path.iterdir()) == []
    saved, = mha_harness.search([mutant], quick=True, seed=0, time_budget=30, results=tmp_path / "r")
    assert saved.saved and Path(saved.saved).is_file() and Path(saved.saved).parent.parent == tmp_path / "r" / "search"
    with pytest.raises(ValueError, match=r"dtypes: got bfloat16; numpy-naive is searched in float32, float64"):
        mha_harness.search("numpy-naive", dtypes=["bfloat16"])
    with pytest.raises(ValueError, match=r"timeout: got 5 with isolate=False"):
        mha_harness.search("numpy-naive", timeout=5)
