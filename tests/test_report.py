"""Reports and verified divergences: statuses, declarations checked against what the backend does, the truthful
policy table, JSON schema and markdown, repro lines that run."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import mha_harness
from mha_harness.conformance.report import SCHEMA_VERSION
from mha_harness.conformance.results import Status, repro_command
from mha_harness.contract.api import Divergence
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from mha_harness.toolkit.divergences import (
    masked_poison_divergences,
    nan_fully_masked_divergences,
    precision_divergences,
    uniform_fully_masked_divergences,
)
from tests.conftest import ROOT
from tests.hostile_plugins import WrongShape as WrongShapeBase

FULLY = "check_fully_masked_rows_output_zeros"


class ClaimsNaN(NumpyNaive):
    """Declares a divergence that does not happen: the run must flag it."""
    name = "claims-nan"
    divergences = (Divergence(FULLY, "fully_masked_rows:nan", reason="stale declaration"),)


class _NaNRowsLoaded(NumpyNaiveLoaded):
    def softmax(self, scores):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


class NaNRows(NumpyNaive):
    name = "nan-rows"
    loaded_class = _NaNRowsLoaded
    divergences = nan_fully_masked_divergences("this backend divides 0 by 0", with_empty_causal_rows=False)


class _UniformRowsLoaded(NumpyNaiveLoaded):
    def masks(self, inputs):
        allowed, additive = super().masks(inputs)
        if allowed is None:
            return allowed, additive
        # the most negative float32 (jax's and flax's masked value): a score added to it is absorbed in float64 too,
        # where -1e9 would keep the scores' differences and the row would not be uniform
        bias = np.where(allowed, 0.0, -np.finfo(np.float32).max) + (0.0 if additive is None else additive)
        return None, bias


class UniformRows(NumpyNaive):
    """Masks with a large finite negative value, as jax.nn.dot_product_attention does."""
    name = "uniform-rows"
    loaded_class = _UniformRowsLoaded
    divergences = uniform_fully_masked_divergences("finite mask value")


class LiesUniformButNaN(NaNRows):
    name = "lies-uniform"
    divergences = uniform_fully_masked_divergences("claims uniform, gives NaN", with_empty_causal_rows=False)


def test_a_declared_divergence_that_does_not_happen_is_an_unexpected_pass_and_fails_the_run():
    report = mha_harness.check(ClaimsNaN(), cases=[FULLY])  # one variant per mask kind and dtype numpy-naive declares
    assert [r.status for r in report.results] == [Status.UNEXPECTED_PASS] * 6 and not report.ok
    assert "remove or narrow the declaration" in report.results[0].message
    # a stranger's correct declaration passed only because a mask-after-softmax bug zeroed the rows: the advice
    # to remove it says to fix the backend's other failures first
    assert "unless other cases of this backend fail" in report.results[0].message


def test_a_declared_divergence_that_happens_is_verified_and_the_run_passes():
    report = mha_harness.check(NaNRows(), cases=[FULLY])
    result = report.results[0]
    assert result.status == "expected-divergence" and report.ok, result.message
    assert "verified" in result.message and "this backend divides 0 by 0" in result.message
    assert report.policies()["nan-rows"]["fully_masked_rows"] == "NaN (declared, verified)"


def test_uniform_average_declaration_is_verified_in_the_fully_masked_and_the_empty_causal_rows():
    report = mha_harness.check(UniformRows(), cases=[FULLY, "check_causal_output_matches_reference"])
    statuses = {(r.case, r.variant): r.status for r in report.results}
    assert report.ok, [r.message for r in report.failures()]
    assert {v: s for (c, v), s in statuses.items() if c == FULLY} == {
        f"uniform-rows-{dtype}-route{route}": Status.EXPECTED_DIVERGENCE for dtype in ("float32", "float64")
        for route in ("key_padding_mask", "bool_attn_mask", "additive_attn_mask")}
    diverging = [v for (c, v), s in statuses.items() if s == Status.EXPECTED_DIVERGENCE and c != FULLY]
    assert diverging == ["uniform-rows-float32-alignmentbottom-right-rows-without-visible-keys-t11-tk6"]


def test_undeclared_nan_rows_fail_naming_the_declaration_that_would_record_them():
    class UndeclaredNaN(NaNRows):
        name = "undeclared-nan"
        divergences = ()
    report = mha_harness.check(UndeclaredNaN(), cases=[FULLY])
    message = report.results[0].message
    assert report.results[0].status == Status.FAILED, message
    assert "observed NaN" in message and "nan_fully_masked_divergences(" in message, message


def test_a_declaration_that_does_not_match_the_output_fails_and_says_what_came_out():
    report = mha_harness.check(LiesUniformButNaN(), cases=[FULLY])
    result = report.results[0]
    assert result.status == Status.FAILED and not report.ok
    assert ("fails even under its declared divergence (fully masked rows output the uniform average of V): "
            in result.message)
    assert "observed NaN" in result.message


class _Float32Inside(NumpyNaiveLoaded):
    """float64 in name only: computes in float32 (as jax.nn.dot_product_attention does)."""

    def __init__(self, params, dtype):
        super().__init__(params, "float32" if dtype == "float64" else dtype)


class _Float16Inside(NumpyNaiveLoaded):
    def __init__(self, params, dtype):
        super().__init__(params, "float16" if dtype == "float64" else dtype)


GRID = "check_output_matches_reference"


class Float32Inside(NumpyNaive):
    name = "f32-inside"
    loaded_class = _Float32Inside
    divergences = precision_divergences("float64", "float32", "computes in float32", [GRID])


class Float16Inside(Float32Inside):
    """Declares float32 precision but is worse: the float32 bound must still hold, so this fails."""
    name = "f16-inside"
    loaded_class = _Float16Inside


def _grid_float64(backend):
    from mha_harness.conformance.casekit import all_cases
    from mha_harness.conformance.runner import run_case
    case = all_cases()[GRID]
    params = next(v for v in case.variants_for(backend) if v["dtype"] == "float64" and v["variant"] == "eight_heads")
    return run_case(backend, case, params)


def test_a_precision_declaration_is_held_to_the_bound_of_the_declared_dtype():
    ok = _grid_float64(Float32Inside())
    assert ok.status == Status.EXPECTED_DIVERGENCE, ok.message
    assert "float64 error" in ok.message  # the strict run failed against the float64 bound
    # both bounds are recorded: the strict one it failed, the declared dtype's it was verified under
    assert ok.extra["error_to_bound"] > 1 >= ok.extra["declared_error_to_bound"]
    assert ok.extra["declared_bound"] > 1e3 * ok.extra["bound"]
    bad = _grid_float64(Float16Inside())
    assert bad.status == Status.FAILED
    assert "fails even under its declared divergence (compared against the bound of dtype float32): " in bad.message
    assert "float32 error" in bad.message


class _PoisonEverywhere(NumpyNaiveLoaded):
    """NaN poison leaks (0 * NaN), and finite poison leaks too: masking is broken."""

    def masks(self, inputs):
        return None, None


class LeaksAndBlamesPoison(NumpyNaive):
    name = "leaks-blames-poison"
    loaded_class = _PoisonEverywhere
    divergences = masked_poison_divergences("claims only 0 * NaN")


class PoisonOnly(NumpyNaive):
    name = "poison-only"
    divergences = masked_poison_divergences("P @ V computes 0 * NaN")

    def load_native(self, params, dtype):
        from mha_harness.implementations.mutants.zoo import NaNPoisonLeaks
        return NaNPoisonLeaks(params, dtype)


def test_masked_poison_is_verified_and_a_real_leak_is_not_excused():
    good = mha_harness.check(PoisonOnly(), cases=["check_padding_mask_blocks_padded_keys"])
    assert good.ok, [r.message for r in good.failures()]
    assert {r.params["poison"]: r.status for r in good.results} == {
        "random": Status.PASSED, "nan": Status.EXPECTED_DIVERGENCE, "inf": Status.EXPECTED_DIVERGENCE}
    bad = mha_harness.check(LeaksAndBlamesPoison(), cases=["check_padding_mask_blocks_padded_keys"])
    by_poison = {r.params["poison"]: r for r in bad.results}
    assert all(r.status == Status.FAILED for r in by_poison.values())
    assert "fails even under its declared divergence (NaN/inf held by a masked key/value" in by_poison["nan"].message


@pytest.mark.parametrize("divergence, words", [
    (Divergence("check_no_such_case", "masked_poison", "r"), "unknown case 'check_no_such_case'"),
    (Divergence(FULLY, "fully_masked_rows:nan", "r", when={"seqlen": 3}), "unknown 'when' key(s) 'seqlen'"),
    (Divergence(FULLY, "masked_poison", "r"), "masked_poison needs a case with a 'poison' parameter"),
])
def test_declarations_are_checked_at_load(divergence, words):
    backend = type("Declares", (NumpyNaive,), {"name": "declares", "divergences": (divergence,)})()
    report = mha_harness.check(backend, cases=[FULLY])
    assert not report.ok and not report.results
    info = report.backends["declares"]
    assert info.load_error and words in info.reason


def test_an_unknown_behaviour_is_refused_naming_the_vocabulary():
    with pytest.raises(ValueError, match="accepted: fully_masked_rows:uniform_average"):
        Divergence(FULLY, "uniform average of V", "free text is not checkable")


def test_builtin_declarations_name_known_cases_and_keys():
    from mha_harness.conformance.runner import divergence_problems
    registry = mha_harness.load_registry()
    for entry in registry.entries.values():
        if entry.backend is not None:
            assert divergence_problems(entry.backend) == [], entry.name


def test_zero_cases_ran_is_never_ok():
    report = mha_harness.check(NumpyNaive(), cases=["check_gradients_match_reference"])  # numpy has no gradients
    assert {r.status for r in report.results} == {Status.SKIPPED}
    assert not report.ok and report.nothing_ran() == ["numpy-naive"]
    assert "no case ran" in "\n".join(report.summary_lines())


def test_json_and_markdown_carry_the_matrix_policies_divergences_and_repro(tmp_path):
    report = mha_harness.check([NumpyNaive(), NaNRows()], cases=[FULLY, "check_causal_output_matches_reference"])
    report.mutation = {"caught": 1, "total": 1, "mutants": [{"name": "m", "bug": "b", "caught_by": ["check_x"]}]}
    paths = report.write(tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["complete"]
    policy = doc["policies"]["numpy-naive"]
    assert policy["fully_masked_rows"] == "zeros (verified)"
    assert policy["causal_alignment"] == "top-left verified (Tq != Tk too); bottom-right verified (Tq != Tk too)"
    assert doc["results"][0]["repro"].startswith("python -c 'import mha_harness; mha_harness.repro(")
    assert doc["results"][0]["status"] == "passed"
    md = paths["markdown"].read_text()
    assert f"| {FULLY} | pass | diverges |" in md
    assert "## Declared divergences" in md and "this backend divides 0 by 0" in md and "`fully_masked_rows:nan`" in md
    assert "## Mutation score" in md and "1 of 1 mutants caught" in md


def test_policy_table_shows_the_reason_of_a_skip():
    from mha_harness.contract.api import Capabilities
    plain = type("NoMasks", (NumpyNaive,), {"name": "no-masks", "capabilities": Capabilities(
        causal_alignments=(), key_padding_mask=False, bool_attn_mask=False, additive_attn_mask=False)})()
    row = mha_harness.check(plain, cases=[FULLY, "check_output_projection_mixes_heads"]).policies()["no-masks"]
    assert row["fully_masked_rows"] == ("not run: no-masks declares none of key_padding_mask, bool_attn_mask, "
                                        "additive_attn_mask: no row can be masked")
    assert row["causal_alignment"] == "no causal mask declared"


def test_failure_messages_say_expected_got_where_and_by_how_much():
    from mha_harness.implementations.mutants import mutant_backends
    backend = next(b for b in mutant_backends() if b.name == "mutant-value-bias-dropped")
    report = mha_harness.check(backend, cases=["check_output_projection_mixes_heads"])
    message = report.failures()[0].message
    for words in ("expected", "got", "batch", "position", "feature", "max error", "tolerance"):
        assert words in message


def test_repro_reruns_one_variant(capsys):
    mha_harness.repro("numpy-naive", "check_scores_scaled_by_sqrt_d_head", dtype="float32")
    assert capsys.readouterr().out == "passed\n"  # a stranger read "passed: " as a message cut off
    with pytest.raises(AssertionError):
        mha_harness.repro("tests.plugin_objects:LessonFunction", "check_causal_mask_blocks_future_keys",
                          dtype="float32", alignment="top-left", seq=9, tk=9, poison="nan")


def test_repro_lines_are_python_literals_and_one_shell_word():
    line = repro_command("a'b$(touch x)", "check_c", {"bias": False, "x": None, "dtype": "float32"})
    assert "False" in line and "None" in line and "false" not in line
    import shlex
    words = shlex.split(line)
    assert words[:2] == ["python", "-c"] and len(words) == 3
    assert '"a\'b$(touch x)"' in words[2]


def test_a_hostile_backend_name_in_a_repro_line_runs_nothing(tmp_path):
    line = repro_command("a'b$(touch pwned)`touch pwned2`", "check_scores_scaled_by_sqrt_d_head", {"dtype": "float32"})
    out = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=_env())
    assert out.returncode != 0 and "a'b$(touch pwned)`touch pwned2`" in out.stderr
    assert not list(tmp_path.iterdir())


def _env():
    import os
    import sys
    from pathlib import Path
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT)}


def test_the_repro_line_of_a_failing_spec_backend_fails_the_same_way_in_bash():
    report = mha_harness.check("tests.hostile_plugins:WrongShape", cases=["check_output_projection_mixes_heads"])
    result = report.failures()[0]
    assert result.repro == ("python -c 'import mha_harness; mha_harness.repro(\"tests.hostile_plugins:WrongShape\", "
                            "\"check_output_projection_mixes_heads\", backend_name=\"hostile-wrong-shape\", "
                            "dtype=\"float32\", form=\"separate\")'")
    out = subprocess.run(["bash", "-c", result.repro], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=_env())
    assert out.returncode == 1
    assert f"failed: {result.message}" in out.stdout
    assert "Traceback" not in out.stderr  # the printed line is the whole story


@pytest.mark.parametrize("isolate", [False, True])
def test_the_repro_line_of_a_failing_backend_given_as_an_object_names_its_class_and_runs(isolate):
    """A stranger's mha_harness.check(TheirBackend()) printed repro(\"their-name\", ...), which no registry knows
    (RegistryError when pasted): an object's line names its importable class and the backend's name."""
    from tests.plugin_objects import OffsetOutput
    for given in (OffsetOutput(), OffsetOutput):
        report = mha_harness.check(given, cases=["check_output_projection_mixes_heads"], isolate=isolate)
        result = report.failures()[0]
        assert "mha_harness.repro(\"tests.plugin_objects:OffsetOutput\", " in result.repro
        assert "backend_name=\"offset-output\"" in result.repro
    out = subprocess.run(["bash", "-c", result.repro], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=_env())
    assert out.returncode == 1 and f"failed: {result.message}" in out.stdout, (out.stdout, out.stderr[-500:])


def test_an_object_without_an_importable_class_keeps_its_name_in_the_repro_line():
    from mha_harness.checking import importable_name

    class Local(WrongShapeBase):
        name = "local-wrong-shape"
    assert importable_name(Local()) is None and importable_name(Local) is None
    assert importable_name(lambda: []) is None
    # a class made by type() under another name: the name its module holds it by
    assert importable_name(WrongShapeBase()) == "tests.hostile_plugins:WrongShape"


def test_markdown_groups_skip_reasons_per_backend_with_counts_escaped():
    from mha_harness.conformance.report import BackendInfo, Report
    from mha_harness.conformance.results import CaseResult
    forged = "evil|name\n## Mutation score"
    rows = [CaseResult(forged, "check_a", f"v{i}", {}, Status.SKIPPED, "does not declare capability 'gradients'")
            for i in range(3)]
    rows += [CaseResult(forged, "check_b", "v", {}, Status.SKIPPED, "does not declare capability 'gradients'"),
             CaseResult(forged, "check_c", "v", {}, Status.SKIPPED, "<b>only</b> for one x | forged"),
             CaseResult(forged, "check_d", "v", {}, Status.PASSED)]
    md = Report(results=rows, backends={forged: BackendInfo(forged)}).to_markdown()
    section = md.split("## Skipped", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("| evil")]
    assert lines[0] == ("| evil\\|name ## Mutation score | 4 | does not declare capability 'gradients' "
                        "| `check_a`, `check_b` |")
    assert lines[1].startswith("| evil\\|name ## Mutation score | 1 | &lt;b>only&lt;/b> for one x \\| forged |")
    assert md.count("## Mutation score") == 0 or "\n## Mutation score" not in md


def test_a_load_error_says_failed_to_load_once_in_the_markdown():
    from mha_harness.conformance.report import BackendInfo, Report
    info = BackendInfo("my:Spec", available=False, load_error=True,
                       reason="failed to load: import raised RuntimeError: boom (at /x/plugin.py:3)")
    md = Report(backends={"my:Spec": info}).to_markdown()
    assert "- **my:Spec**: **failed to load**: import raised RuntimeError: boom (at /x/plugin.py:3)" in md
    assert md.count("failed to load") == 1


class PoisonUndeclared(NumpyNaive):
    """A dense P @ V (0 * NaN = NaN from masked keys), nothing declared: as nn.MultiheadAttention wrapped as is."""
    name = "poison-undeclared"

    def load_native(self, params, dtype):
        from mha_harness.implementations.mutants.zoo import NaNPoisonLeaks
        return NaNPoisonLeaks(params, dtype)


class LeaksUndeclared(NumpyNaive):
    name = "leaks-undeclared"
    loaded_class = _PoisonEverywhere


@pytest.mark.parametrize("case", ["check_padding_mask_blocks_padded_keys", "check_causal_mask_blocks_future_keys"])
def test_nan_poison_that_only_propagates_is_called_so_and_points_to_the_declaration(case):
    report = mha_harness.check(PoisonUndeclared(), cases=[case])
    failed = [r for r in report.results if r.status == Status.FAILED]
    assert failed and {r.params["poison"] for r in failed} <= {"nan", "inf"}
    for r in failed:
        assert r.message.startswith("not a leak: NaN" if r.params["poison"] == "nan" else "not a leak: inf"), r.message
        assert "random finite values leave the output unchanged" in r.message
        assert "masked_poison_divergences" in r.message and "mha_harness.toolkit.divergences" in r.message
        # the helper covers both poison cases: an outside user whose padding case passed got an unexpected pass
        assert 'masked_poison_divergences("why", cases=[...])' in r.message and "unexpected pass" in r.message
    real = mha_harness.check(LeaksUndeclared(), cases=[case])
    for r in real.failures():
        assert "not a leak" not in r.message
        if r.params["poison"] != "random":
            assert "random finite values change the output too: a real leak" in r.message, r.message


def test_policy_columns_say_not_declared_instead_of_guessing():
    """A plugin that does not describe its own causal flag or mask polarity is shown as "not declared" (or "no ...
    declared" when its capabilities rule them out), never the harness's convention by default."""
    from mha_harness.contract.api import Capabilities
    from mha_harness.contract.conventions import MASK_POLARITY
    top_left = type("TopLeftOnly", (NumpyNaive,), {
        "name": "top-left-only", "native_causal": None, "native_mask_polarity": None,
        "capabilities": Capabilities(causal_alignments=("top-left",))})()
    bare = type("Bare", (NumpyNaive,), {
        "name": "bare", "native_causal": None, "native_mask_polarity": None, "capabilities": Capabilities(
            causal_alignments=(), key_padding_mask=False, bool_attn_mask=False, additive_attn_mask=False)})()
    inverted = type("Inverted", (NumpyNaive,), {"name": "inverted", "native_mask_polarity": "attn_mask True = NOT "
                                                "allowed"})()
    table = mha_harness.check([top_left, bare, inverted, NumpyNaive()],
                              cases=["check_output_projection_mixes_heads"]).policies()
    assert (table["top-left-only"]["native_causal"], table["top-left-only"]["mask_polarity"]) == (
        "not declared", "not declared")
    assert (table["bare"]["native_causal"], table["bare"]["mask_polarity"]) == (
        "no causal mask declared", "no masks declared")
    assert table["inverted"]["mask_polarity"] == "attn_mask True = NOT allowed"
    assert table["numpy-naive"]["mask_polarity"] == MASK_POLARITY  # the built-ins that take harness masks say so


def test_a_loaded_attention_made_without_load_says_how_to_make_one():
    from mha_harness.contract.params import make_inputs, make_params

    class Mine(mha_harness.LoadedAttention):  # no __init__ needed, no config set: load() sets it
        def compute(self, inputs, *, need_weights=False):
            return mha_harness.AttentionOutput(inputs.query)

    params = make_params(mha_harness.AttentionConfig(16, 2))
    with pytest.raises(TypeError, match=r"not made by AttentionBackend.load\(\).*backend.load\(params, dtype=...\)"):
        Mine().forward(make_inputs(params.config, 1, 4))
    backend = type("MineBackend", (mha_harness.AttentionBackend,), {"name": "mine",
                                                                     "load_native": lambda self, p, d: Mine()})()
    loaded = backend.load(params)
    assert loaded.config == params.config and loaded.input_form == "separate"
    assert loaded.forward(make_inputs(params.config, 1, 4)).output.shape == (1, 4, 16)
    assert NumpyNaive().load(params).forward(make_inputs(params.config, 1, 4)).output.shape == (1, 4, 16)
    assert "implement ``load_native``" in mha_harness.AttentionBackend.__doc__


def test_a_causal_case_on_a_backend_without_causal_names_the_missing_capability():
    """The skip reason names what the backend did not declare, not "no parameters this case can run with"."""
    import dataclasses

    from mha_harness.implementations.numpy_naive import NumpyNaive

    class NoCausal(NumpyNaive):
        name = "numpy-no-causal"

        @property
        def capabilities(self):
            return dataclasses.replace(super().capabilities, causal_alignments=())

    report = mha_harness.check(NoCausal(), cases=["check_causal_mask_blocks_future_keys"])
    assert report.results and all(r.status == "skipped" for r in report.results)
    assert all("does not declare capability 'causal': it declares no causal mask (Capabilities.causal_alignments=())"
               in r.message for r in report.results), report.results[0].message


def test_a_float64_run_computed_in_float32_fails_saying_so_and_naming_the_declaration():
    class Undeclared(Float32Inside):
        name = "f32-inside-undeclared"
        divergences = ()

    class Float16Undeclared(Float16Inside):
        name = "f16-inside-undeclared"
        divergences = ()
    result = _grid_float64(Undeclared())
    assert result.status == Status.FAILED
    assert "within the float32 bound" in result.message and "precision_divergences(" in result.message, result.message
    worse = _grid_float64(Float16Undeclared())  # beyond the float32 bound too: no such hint
    assert worse.status == Status.FAILED and "within the float32 bound" not in worse.message, worse.message


def test_policy_table_tells_a_poison_only_failure_from_a_failing_mask():
    """An alignment whose only failures hold NaN/inf in masked keys says so (the mask itself holds on finite keys,
    a dense P @ V's 0 * NaN); any other failure is a plain FAILS, with the count of failing variants."""
    from mha_harness.conformance.report import Report
    from mha_harness.conformance.results import CaseResult

    def row(case, poison, status):
        params = {"alignment": "top-left", "seq": 9, "tk": 9, "poison": poison}
        return CaseResult("b", case, f"b-{case}-{poison}", params, status)

    mask_case, output_case = "check_causal_mask_blocks_future_keys", "check_causal_output_matches_reference"
    poison_only = [row(mask_case, "random", Status.PASSED), row(mask_case, "nan", Status.FAILED),
                   row(mask_case, "inf", Status.FAILED), row(output_case, None, Status.PASSED)]
    text = Report._alignments(poison_only, ["top-left"])
    assert text.startswith("top-left FAILS only with NaN/inf stored in masked keys (2 of 4 variants")
    assert "masked_poison_divergences" in text
    leaking = poison_only[:3] + [row(output_case, None, Status.FAILED)]
    assert Report._alignments(leaking, ["top-left"]) == "top-left FAILS (3 of 4 variants)"


class _SoftmaxInFloat32(NumpyNaiveLoaded):
    """float64 projections, but the softmax in float32: exact wherever the weights are exactly 1 (one key)."""

    def softmax(self, scores):
        return super().softmax(scores.astype(np.float32)).astype(scores.dtype)


class SoftmaxInFloat32(NumpyNaive):
    name = "softmax-f32"
    loaded_class = _SoftmaxInFloat32
    divergences = precision_divergences("float64", "float32", "the softmax runs in float32", [GRID])


class StalePrecision(NumpyNaive):
    """Computes float64 in float64, yet declares float32 precision: a stale declaration."""
    name = "stale-precision"
    divergences = precision_divergences("float64", "float32", "stale: fixed upstream", [GRID])


def test_a_precision_declaration_over_a_whole_case_lets_exact_variants_pass():
    """Declared over the whole grid, float32-level precision is needed by most float64 rows; the rows with one key
    are exact (softmax weight 1) and pass at the strict tolerance instead of being unexpected passes."""
    report = mha_harness.check(SoftmaxInFloat32(), cases=[GRID])
    rows = {r.params["variant"]: r for r in report.results if r.params["dtype"] == "float64"}
    assert report.ok, [r.message for r in report.failures()]
    for exact in ("single_token", "single_key"):
        assert rows[exact].status == Status.PASSED and "was not needed by this variant" in rows[exact].message
    assert rows["eight_heads"].status == Status.EXPECTED_DIVERGENCE


@pytest.mark.parametrize("isolate", [False, True])
def test_a_precision_declaration_no_variant_needs_is_an_unexpected_pass(isolate):
    """A precision declaration must be needed by at least one variant it matches, or every strict pass it matches
    is an unexpected pass (the declaration is stale), in-process and in isolated workers."""
    report = mha_harness.check(StalePrecision(), cases=[GRID], isolate=isolate)
    matched = [r for r in report.results if r.params["dtype"] == "float64"]
    assert not report.ok and matched
    assert all(r.status == Status.UNEXPECTED_PASS and "no variant it matches needed it" in r.message for r in matched)
    assert all(r.status == Status.PASSED for r in report.results if r.params["dtype"] != "float64")
    seen = []
    mha_harness.check(StalePrecision(), cases=[GRID], isolate=isolate,
                      progress=lambda r: seen.append((r.status, r.message)))
    # the terminal learns of them too: a stranger saw only "1 unexpected-pass" in the summary and had to open
    # conformance.md to find which declaration it was
    told = [message for status, message in seen if status == Status.UNEXPECTED_PASS]
    assert len(told) == len(matched) and all("no variant it matches needed it" in m for m in told)


class _StrayOutputBias(NumpyNaiveLoaded):
    """Adds an output bias although the config has none (a framework layer built with its default biases)."""

    def output_projection(self, concat):
        return super().output_projection(concat) + np.linspace(0.05, 0.2, concat.shape[-1], dtype=concat.dtype)


class StrayOutputBias(NumpyNaive):
    name = "stray-output-bias"
    loaded_class = _StrayOutputBias


class _StrayBiasesEverywhere(NumpyNaiveLoaded):
    """Every projection adds a bias although the config has none (torch.nn.Linear left at its default bias=True):
    the query and key biases change the scores, so the output is not off by a constant."""

    def project(self, x, which):
        return super().project(x, which) + np.linspace(0.1, 0.5, self.weights[f"W_{which}"].shape[1], dtype=x.dtype)


class StrayBiasesEverywhere(NumpyNaive):
    name = "stray-biases"
    loaded_class = _StrayBiasesEverywhere


def _reference_failure(backend, bias: bool, form: str = "separate") -> str:
    from mha_harness.cases._fixtures import form_inputs
    from mha_harness.conformance.casekit import CaseFailure, check_against_reference
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_params

    params = make_params(AttentionConfig(d_model=16, num_heads=2, bias=bias))
    with pytest.raises(CaseFailure) as failure:
        check_against_reference(backend, params, form_inputs(form, params.config, 2, 5, 5, seed=1), "float64")
    return str(failure.value)


@pytest.mark.parametrize("form", ["separate", "self", "shared_kv"])
def test_a_bias_free_layer_that_adds_biases_is_diagnosed_by_its_output_for_zero_inputs(form):
    """With bias=False, a failure of a layer that adds biases anyway (every projection, so the output is not off by
    a constant) says so: with every input zero, attention without biases outputs exactly 0."""
    message = _reference_failure(StrayBiasesEverywhere(), bias=False, form=form)
    assert "with every input zero the layer outputs values up to" in message
    assert "load zeros into the module's biases" in message


def test_an_output_off_by_one_constant_vector_is_diagnosed_as_a_stray_bias():
    """With bias=True, a failure whose output differs from the reference by the same vector at every position says
    so (a value or output bias loaded wrong); a failure of another kind gets neither diagnosis."""
    message = _reference_failure(StrayOutputBias(), bias=True)
    assert "the same at every position" in message and "check that b_v and b_o are loaded" in message
    for bias in (False, True):
        other = _reference_failure(Float16Inside(), bias=bias)
        assert "the same at every position" not in other and "every input zero" not in other


def test_no_constant_offset_diagnosis_where_every_position_has_the_same_right_output():
    """Two positions that see the same single key have the same right output, so a wrong weight on it makes the
    same error at both: that is no sign of a bias (the search's shrunk padded-keys example was misdiagnosed so)."""
    from mha_harness.conformance.casekit import constant_offset_hint
    expected = np.tile(np.array([0.3, -0.2, 0.1]), (1, 2, 1))
    assert constant_offset_hint(expected * 0.5, expected, bias=False) == ""
    varied = expected + np.array([[[0.0], [1.0]]])
    assert "the same at every position" in constant_offset_hint(varied + 0.25, varied, bias=False)


def test_a_tolerance_failure_says_how_many_times_the_bound_the_error_is():
    """A reference mismatch states error / bound, so a marginal miss (1.1 x) is told from a wrong formula (1000 x)."""
    from mha_harness.conformance.casekit import CaseFailure, assert_close
    from mha_harness.contract.tolerance import Tolerance

    tol = Tolerance(bound=1e-3, naive_error=1e-4, dtype="float32")
    expected = np.zeros((1, 2, 3))
    actual = expected.copy()
    actual[0, 1, 2] = 2.5e-3
    with pytest.raises(CaseFailure) as failure:
        assert_close(actual, expected, tol, "output")
    assert "max error 0.0025 (2.5 x the bound) exceeds tolerance 0.001" in str(failure.value), str(failure.value)
    assert failure.value.max_error == pytest.approx(2.5e-3)
    assert assert_close(actual / 5, expected, tol, "output") == pytest.approx(5e-4)  # within the bound: passes


def test_a_float64_miss_at_float64_rounding_size_is_not_called_float32():
    """A float64 error of a few float64 ulps over the bound (a different summation order) gets no "computes in
    float32" diagnosis; one of float32 size does."""
    from mha_harness.conformance.casekit import CaseFailure, assert_close
    from mha_harness.contract.tolerance import Tolerance

    tol = Tolerance(bound=3.8e-16, naive_error=1e-16, dtype="float64")
    expected = np.zeros((1, 1, 2))
    for err, float32_sized in ((7.9e-16, False), (3e-8, True)):
        actual = expected.copy()
        actual[0, 0, 1] = err
        with pytest.raises(CaseFailure) as failure:
            assert_close(actual, expected, tol, "gradient of key")
        assert ("within the float32 bound" in str(failure.value)) == float32_sized, str(failure.value)


def test_every_reference_failure_of_a_wrong_scale_names_the_scale():
    """The wrong-scale diagnosis is on every failing comparison with the reference (the grid's variants too), not only
    on the scale case's own, so the first failure a user reads names the bug."""
    from mha_harness.implementations.mutants import mutant_backends

    mutant = next(b for b in mutant_backends() if b.name == "mutant-scale-inverse-d-head")
    report = mha_harness.check(mutant, cases=["check_output_matches_reference"])
    failed = [r for r in report.results if r.status == Status.FAILED]
    named = [r for r in failed if "the output matches scores scaled by" in r.message
             and "1/d_head instead of 1/sqrt(d_head)" in r.message]
    assert failed and named == failed, [r.message for r in failed if r not in named][:1]


def test_a_declared_divergence_whose_case_did_not_run_is_shown_as_not_verified():
    """masked_poison_divergences() also declares the padding leak case; a backend without key padding never runs it,
    yet the report listed it under "Each is verified" (a stranger's decode kernel). It now counts the variants."""
    import dataclasses

    import mha_harness
    from mha_harness.implementations.numpy_naive import NumpyNaive
    from mha_harness.toolkit.divergences import masked_poison_divergences

    class NoPadding(NumpyNaive):
        name = "no-padding"
        capabilities = dataclasses.replace(NumpyNaive.capabilities, key_padding_mask=False)
        divergences = masked_poison_divergences("declared for the test")

    md = mha_harness.check(NoPadding(), cases=["check_padding_mask_blocks_padded_keys"]).to_markdown()
    row = next(line for line in md.splitlines() if "| no-padding | check_padding_mask_blocks_padded_keys |" in line)
    assert row.endswith("| none: every variant of the case was skipped (no-padding does not declare capability "
                        "'key_padding_mask') |"), row


def test_a_masked_poison_declaration_on_a_self_form_layer_says_why_nothing_verified_it():
    """With one x there is no NaN/inf variant of the causal leak case (the poisoned future position is also a
    query); a stranger's self-form layer declaring masked_poison read "verified on: none" and could not tell why."""
    import dataclasses

    import mha_harness
    from mha_harness.implementations.numpy_naive import NumpyNaive
    from mha_harness.toolkit.divergences import masked_poison_divergences

    class OneX(NumpyNaive):
        name = "one-x"
        capabilities = dataclasses.replace(NumpyNaive.capabilities, inputs="self", cross_attention=False,
                                           more_queries_than_keys=False)
        divergences = masked_poison_divergences("declared for the test")

    report = mha_harness.check(OneX(), cases=["check_causal_mask_blocks_future_keys"])
    assert report.ok, report.summary_lines()
    row = next(line for line in report.to_markdown().splitlines()
               if "| one-x | check_causal_mask_blocks_future_keys |" in line)
    assert row.replace("\\", "").endswith("| none: no variant of the case here has poison in ['nan', 'inf'] (its "
                                          "variants in the self form have poison: 'random') |"), row


def test_a_declaration_that_fails_where_it_applies_is_not_reported_as_undiverged():
    """A stranger's layer failed "even under its declared divergence" while the divergence table said "the case did
    not diverge here": the table now says the declaration does not hold."""
    import mha_harness
    from tests.empty_row_layers import NaNRows

    class DeclaresUniform(NaNRows):  # its rows without a key are NaN, not the declared uniform average
        divergences = uniform_fully_masked_divergences("declared for the test")

    report = mha_harness.check(DeclaresUniform(), cases=["check_fully_masked_rows_output_zeros"])
    failed = [r for r in report.results if r.status == "failed"]
    assert failed and "fails even under its declared divergence" in failed[0].message
    row = next(line for line in report.to_markdown().splitlines()
               if "| check_fully_masked_rows_output_zeros |" in line and "uniform" in line)
    assert f"none: it does not hold: {len(failed)} variant(s) it covers fail even under it (the first: " in row, row
    assert len(failed) == 3 * len(DeclaresUniform.capabilities.dtypes)  # every mask kind, in every dtype


def test_two_declarations_on_one_case_each_count_and_name_only_the_variants_they_cover():
    """'verified on' counts the variants a declaration's ``when`` covers (two per-dtype declarations of one case had
    each counted both's), and names them when there are at most three (an outside user's scale declaration read
    "verified on: 1 variant(s)", a one-token row, with nothing to tell which)."""
    import mha_harness
    from mha_harness.conformance.report import NAMED_VERIFIED
    from mha_harness.toolkit.divergences import nan_fully_masked_divergences
    from tests.empty_row_layers import NaNRows

    others = ("float64", "bfloat16", "float16")

    class PerDtype(NaNRows):
        divergences = (nan_fully_masked_divergences("float32 rows", dtypes=["float32"])
                       + nan_fully_masked_divergences("other rows", dtypes=others))

    report = mha_harness.check(PerDtype(), cases=["check_fully_masked_rows_output_zeros"])
    assert report.ok, report.summary_lines()
    table = report.to_markdown().replace("\\", "").splitlines()
    for reason, dtypes in (("float32 rows", ("float32",)), ("other rows", others)):
        diverged = [r.variant for r in report.results if r.status == "expected-divergence"
                    and r.params["dtype"] in dtypes]
        [row] = [line for line in table if "check_fully_masked_rows_output_zeros" in line and reason in line]
        named = (f": {', '.join(diverged)}" if len(diverged) <= NAMED_VERIFIED else f" (the first: {diverged[0]})")
        assert row.endswith(f"| {len(diverged)} variant(s){named} |"), row
    assert len(diverged) > NAMED_VERIFIED  # both cells: the one naming every variant and the one naming the first


def test_a_quick_run_lists_the_slow_cases_it_left_out():
    """A stranger found the T = 8192 case missing from a --quick report, not listed as left out."""
    report = mha_harness.check("numpy-naive", cases=["check_scores_scaled_by_sqrt_d_head",
                                                     "check_long_sequence_sampled_rows_match_reference"],
                               include_slow=False)
    why = "slow, T = 8192: left out by --quick (include_slow=False)"
    assert report.left_out == {"check_long_sequence_sampled_rows_match_reference": why}
    assert report.to_json()["left_out"] == report.left_out and report.ok
    assert f"  not run: check_long_sequence_sampled_rows_match_reference ({why})" in report.summary_lines()
    assert "Not run in this run: `check_long_sequence_sampled_rows_match_reference`" in report.to_markdown()
    assert not mha_harness.check("numpy-naive", cases=["check_scores_scaled_by_sqrt_d_head"],
                                 include_slow=False).left_out


def test_the_summary_names_a_failing_backends_cases_under_its_fail_line():
    """Failures print in case order, so a mask bug's first printed failure can be the gradient case's numbers (a
    stranger's finding); the summary lists the failing cases by name, with their variant counts."""
    from mha_harness.implementations.mutants import mutant_backends

    mutant = next(b for b in mutant_backends() if b.name == "mutant-causal-one-future-token")
    report = mha_harness.check(mutant, cases=["check_output_matches_reference", "check_causal_output_matches_reference",
                                              "check_causal_mask_blocks_future_keys"])
    lines = report.summary_lines()
    fail = next(i for i, line in enumerate(lines) if "mutant-causal-one-future-token" in line)
    assert " FAIL " in lines[fail]
    listed = lines[fail + 1].strip()
    assert listed.startswith("failing cases: check_causal_output_matches_reference (")
    assert "check_causal_mask_blocks_future_keys (" in listed and "failed)" in listed
    assert "check_output_matches_reference" not in listed.replace("check_causal_output_matches_reference", "")


def test_the_summary_names_the_mistake_the_failed_outputs_match():
    """A ninth stranger: the summary named the failing cases, but the diagnosis ("the output matches a causal mask
    one key too wide") was only in one failure's message among many with numbers only. The line after the failing
    cases names each known mistake matched, with the cases it was found in; a failure with no diagnosis adds none."""
    from mha_harness.implementations.mutants import mutant_backends

    mutant = next(b for b in mutant_backends() if b.name == "mutant-causal-one-future-token")
    report = mha_harness.check(mutant, cases=["check_causal_output_matches_reference",
                                              "check_causal_mask_blocks_future_keys"])
    lines = report.summary_lines()
    fail = next(i for i, line in enumerate(lines) if "mutant-causal-one-future-token" in line)
    assert lines[fail + 2].strip().startswith("diagnosed: the output matches a causal mask one key too wide"), lines
    assert lines[fail + 2].rstrip().endswith(" variant(s) of check_causal_output_matches_reference]"), lines
    [row] = [r for r in report.to_json()["results"] if r["status"] == "failed" and r["extra"].get("diagnosis")][:1]
    assert row["case"] == "check_causal_output_matches_reference"
    leak_only = mha_harness.check(mutant, cases=["check_causal_mask_blocks_future_keys"])
    assert not leak_only.ok and not any("diagnosed:" in line for line in leak_only.summary_lines())



def test_the_summary_shows_each_diagnosis_whole_on_a_line_of_its_own():
    """An outside user's YaRN wrapper: the summary cut "... without its attention factor (q and k not multiplied
    by 1.139, 0.1 * ln(factor) + 1: transformers ..." before its fix. Each matched mistake is a line of its own,
    whole, aligned under the first; past the few shown, a count of the rest."""
    from mha_harness.conformance.report import DIAGNOSED, DIAGNOSES_SHOWN, diagnoses_line

    fix = "; apply it with the rotation"
    long = "the output matches a mistake " + "with a long explanation " * 10 + fix
    failures = [("check_a", long), ("check_b", long), ("check_b", "the output matches B"), ("check_c", None)] + [
        ("check_d", f"the output matches mistake {i}") for i in range(DIAGNOSES_SHOWN)]
    first, *rest = diagnoses_line(failures).splitlines()
    assert first == f"{DIAGNOSED}{long} [in 2 variant(s) of check_a, check_b]"
    assert len(rest) == DIAGNOSES_SHOWN and all(line.startswith(" " * len(DIAGNOSED) + "the output ") or
                                                line.strip().endswith("more in the failures above") for line in rest)
    assert rest[-1].strip() == "2 more in the failures above"
    assert diagnoses_line([("check_c", None)]) == ""

def test_the_summary_warns_when_no_output_was_compared_with_the_reference():
    """A tenth stranger's KV-cache wrapper refused every call that was not its own kind: 'OK 3 passed, 66 skipped',
    the passes being bad input, head split and parameter count. When every variant of the grid skipped, the summary
    says the output was never compared with the reference, with the first reason."""
    import dataclasses

    from mha_harness.contract.api import Unsupported
    from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

    class RefusesAll(NumpyNaiveLoaded):
        def compute(self, inputs, *, need_weights=False):
            raise Unsupported("only my own calls")

    class Picky(NumpyNaive):
        name = "picky"
        capabilities = dataclasses.replace(NumpyNaive.capabilities)

        def load_native(self, params, dtype):
            return RefusesAll(params, dtype)

    report = mha_harness.check(Picky(), cases=["check_output_matches_reference", "check_bad_input_raises_clear_error"])
    lines = report.summary_lines()
    assert any("warning: its output was never compared with the reference: every variant of "
               "check_output_matches_reference skipped (first: only my own calls" in line for line in lines), lines
    ok = mha_harness.check("numpy-naive", cases=["check_output_matches_reference"])
    assert not any("never compared" in line for line in ok.summary_lines())


def test_a_backend_where_no_case_ran_has_no_empty_failing_cases_line():
    """An eleventh stranger's run where every variant skipped printed 'FAIL 1 skipped; no case ran' and under it an
    empty 'failing cases:' line; the line is left out when there is no failing case to name."""
    report = mha_harness.check("numpy-naive", cases=["check_search_regressions_still_pass"])
    lines = report.summary_lines()
    assert any("no case ran" in line for line in lines), lines
    assert not any(line.strip() == "failing cases:" for line in lines), lines


def test_policy_table_does_not_count_errors_timeouts_or_crashes_as_mask_failures():
    """A backend that hangs or returns garbage on the causal variants has not failed its mask: the policy table said
    "top-left FAILS (12 of 12 variants)" for a stranger's hanging plugin of which nothing ran. It says NOT VERIFIED
    with the counts, and a real failure beside unanswered variants counts only the failures as such."""
    from mha_harness.conformance.report import Report
    from mha_harness.conformance.results import CaseResult

    def row(i, status):
        return CaseResult("b", "check_causal_mask_blocks_future_keys", f"b-{i}", {"alignment": "top-left"}, status)

    hung = [row(0, Status.TIMEOUT), row(1, Status.ERROR), row(2, Status.ERROR), row(3, Status.SKIPPED)]
    assert Report._alignments(hung, ["top-left"]) == (
        "top-left NOT VERIFIED (0 of 4 variants ran and held; 3 without an answer to judge (2 errored, 1 timed out): "
        "not a mask verdict)")
    mixed = [row(0, Status.FAILED), row(1, Status.CRASHED), row(2, Status.PASSED)]
    assert Report._alignments(mixed, ["top-left"]) == (
        "top-left FAILS (1 of 3 variants; 1 without an answer to judge (1 crashed): not a mask verdict)")


def test_the_check_summary_says_prepared_calls_are_checked_by_bench_not_here():
    """check never runs prepare(); its summary says so and names the command that checks those calls."""
    from mha_harness.conformance.report import PREPARE_NOT_RUN
    report = mha_harness.check(NumpyNaive(), cases=["check_output_matches_reference"])
    assert f"  not run by check: {PREPARE_NOT_RUN}" in report.summary_lines()
    assert "`mha-harness bench` checks each one's output or gradients" in PREPARE_NOT_RUN


def test_a_variant_failing_under_its_declaration_points_to_the_same_case_s_undeclared_failures():
    """A backward bug breaks the declared empty_row variant too; its message said "fails even under its declared
    divergence (...)" alone, which sent an outside user to the declaration instead of the bug."""
    from mha_harness.implementations.mutants.zoo import MUTANTS, MutantBackend

    backend = MutantBackend(next(m for m in MUTANTS if m.name == "mutant-gradient-score-scale-left-out"))
    backend.divergences = tuple(backend.divergences) + uniform_fully_masked_divergences("finite mask value")
    failures = mha_harness.check(backend, cases=["check_gradients_match_reference"], isolate=False).failures()
    declared = [f for f in failures if f.params.get("empty_row")]
    assert declared and len(failures) > len(declared)
    assert all("that no declaration covers too, e.g. " in f.message and "fix those first" in f.message
               for f in declared), [f.message[-300:] for f in declared]
    assert not any("no declaration covers" in f.message for f in failures if not f.params.get("empty_row"))


def test_each_compared_variant_records_its_bound_and_how_near_it_came():
    """An outside user building a summary from Python had to parse the tolerance out of the message: each variant
    that compared outputs records the comparison closest to its bound, a pass below 1 and a failure above."""
    import mha_harness
    report = mha_harness.check(["numpy-naive"], cases=["check_output_matches_reference"], include_slow=False)
    passed = [r for r in report.results if r.status.value == "passed"]
    assert passed and all(0 <= r.extra["error_to_bound"] < 1 and r.extra["bound"] > 0 for r in passed)
    assert all(r.extra["error_to_bound"] == round(r.max_error / r.extra["bound"], 4) for r in passed)
    from mha_harness.implementations.mutants import mutant_backends
    scaled = next(m for m in mutant_backends() if m.name == "mutant-scale-sqrt-d-model")
    failed = mha_harness.check([scaled], cases=["check_output_matches_reference"], include_slow=False).failures()
    assert failed and all(r.extra["error_to_bound"] > 1 for r in failed)


def test_the_padding_leak_case_records_its_bound_as_the_comparisons_through_assert_close_do():
    """The padding leak case compares the backend's outputs before and after poisoning padded keys without
    assert_close; its finite comparisons are recorded too (a NaN reaching an output has no distance to record)."""
    import mha_harness
    from mha_harness.implementations.mutants import mutant_backends
    case = ["check_padding_mask_blocks_padded_keys"]
    report = mha_harness.check(["numpy-naive"], cases=case, isolate=False)
    passed = [r for r in report.results if r.status.value == "passed"]
    assert passed and all(0 <= r.extra["error_to_bound"] < 1 and r.extra["bound"] > 0 for r in passed), \
        [r.extra for r in passed]
    ignored = next(m for m in mutant_backends() if m.name == "mutant-padding-ignored")
    failed = mha_harness.check([ignored], cases=case, isolate=False).failures()
    random = [r for r in failed if r.params.get("poison") == "random"]
    assert random and all(r.extra["error_to_bound"] > 1 for r in random), [r.extra for r in random]
