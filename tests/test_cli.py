"""The command line: list, check, usage errors (one line, exit status 2)."""
from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_cli


def test_help_lists_every_subcommand():
    out = run_cli("--help")
    assert out.returncode == 0
    for word in ("list", "check", "bench", "fidelity", "run"):
        assert word in out.stdout
    for sub in ("list", "check", "bench", "fidelity", "run"):
        assert run_cli(sub, "--help").returncode == 0


def test_list_shows_numpy_backends_available_and_reasons_for_the_rest():
    out = run_cli("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("numpy-naive") and "available" in line for line in lines)
    assert any(line.startswith("numpy-tiled") and "available" in line for line in lines)
    assert "torch-sdpa-flash-cuda" in out.stdout and "cuda" in out.stdout.lower()
    # what the layer can be built with, ALiBi too (an outside user's BLOOM wrapper found it missing)
    declared = lines[lines.index(next(line for line in lines if line.startswith("numpy-naive "))) + 1]
    assert "sliding window; ALiBi symmetric,linear" in declared, declared


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly_with_141():
    """`mha-harness list | head` printed a BrokenPipeError traceback: the command now ends quietly with 128 +
    SIGPIPE, as a Unix tool killed by the broken pipe would."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes its first line
    try:
        out = subprocess.run([sys.executable, "-m", "mha_harness", "list"], cwd=ROOT, stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(write)
    assert out.returncode == 141, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr


def test_list_of_a_backend_spec_that_fails_to_load_exits_1_naming_it():
    """A stranger's `mha-harness list --backend-spec` of a module with a typo printed the import error and exited 0,
    so a script could not tell; a spec that loads still exits 0."""
    out = run_cli("list", "--backend-spec", "no_such_module_here:Backend")
    assert out.returncode == 1 and "No module named 'no_such_module_here'" in out.stdout
    assert "1 --backend-spec backend(s) failed to load: no_such_module_here:Backend" in out.stderr
    assert run_cli("list", "--backend-spec", "mha_harness.implementations.numpy_naive:NumpyNaive").returncode == 0


def test_list_shows_each_backends_input_form_and_with_verbose_its_declared_divergences():
    """A capability line names the input form (what a plugin's compute receives) and never ends in a dangling
    separator; -v lists every declared divergence with its case, behaviour, condition and reason."""
    out = run_cli("list", "-v")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    block = lines[next(i for i, line in enumerate(lines) if line.startswith("jax-dpa ")):][:12]
    assert block[1].strip().startswith("inputs separate; dtypes float32,float64")
    assert any("check_output_matches_reference: precision:float32 when {" in line for line in block)
    assert not any(line.rstrip().endswith(";") for line in lines)


def test_check_one_backend_writes_json_and_markdown(tmp_path):
    out = run_cli("check", "--backend", "numpy-tiled", "--quick", "--results", tmp_path, "--jobs", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert doc["schema"] == "mha-harness/conformance" and doc["ok"] and doc["complete"]
    assert doc["summary"]["numpy-tiled"]["passed"] > 50
    md = (tmp_path / "conformance" / "conformance.md").read_text()
    assert "| case | numpy-tiled |" in md and "Policies that backends legitimately differ on" in md


@pytest.mark.parametrize("args, words", [
    (["check", "--backend", "no-such-backend"], ["backend: got 'no-such-backend'", "accepted"]),
    (["check", "--backend", "jax_dpa"], ["backend: got 'jax_dpa'; did you mean 'jax-dpa'", "accepted: one of"]),
    (["check", "--case", "check_nothing"], ["case: got 'check_nothing'", "accepted"]),
    (["bench", "--seq-lens", "12,abc"], ["--seq-lens", "accepted: comma-separated positive integers"]),
    (["bench", "--seq-lens", "0"], ["--seq-lens", "accepted"]),
    (["bench", "--workload", "decode", "--query-lens", "x"], ["argument --query-lens: got 'x'", "accepted"]),
    (["fidelity", "--timing-seq-lens", "0,5"], ["argument --timing-seq-lens: got '0,5'", "accepted"]),
    (["fidelity", "--timing-rounds", "0"], ["--timing-rounds", "got '0'", "accepted: an integer >= 1"]),
    (["check", "--backend-spec", "not a spec"], ["backend spec: got 'not a spec'", "accepted"]),
    (["check", "--no-such-flag"], ["unrecognized arguments"]),
    (["check", "--backend-spec", "my_pkg.attn:A,numpy-naive"],  # a ninth stranger: no hint how to name two
     ["argument --backend-spec: got 'my_pkg.attn:A,numpy-naive'", "repeat --backend-spec for several"]),
    (["bench", "--backend", "numpy-naive,jax-dpa"], ["argument --backend: got", "repeat --backend for several"]),
    (["list", "--backend-spec", "a.b:C,d.e:F"], ["repeat --backend-spec"]),
    (["check", "--timeout", "0"], ["--timeout", "got '0'", "accepted: a finite number > 0"]),
    (["check", "--timeout", "nan"], ["--timeout", "got 'nan'", "accepted"]),
    (["check", "--timeout", "-1"], ["--timeout", "got '-1'", "accepted"]),
    (["run", "--timeout", "inf"], ["--timeout", "got 'inf'", "accepted"]),
    (["check", "--jobs", "0"], ["--jobs", "got '0'", "accepted: an integer >= 1"]),
    (["check", "--jobs", "-3"], ["--jobs", "got '-3'", "accepted"]),
    (["run", "--jobs", "two"], ["--jobs", "got 'two'", "accepted"]),
    (["bench", "--threads", "0"], ["--threads", "got '0'", "accepted: an integer >= 1"]),
    (["bench", "--batch", "-1"], ["--batch", "accepted: an integer >= 1"]),
    (["bench", "--budget", "nan"], ["--budget", "got 'nan'", "accepted: a finite number > 0"]),
    (["run", "--ci", "inf"], ["--ci", "got 'inf'", "accepted: a finite number > 0"]),
    (["fidelity", "--threads", "0"], ["--threads", "accepted: an integer >= 1"]),
    (["fidelity", "--results", ""], ["--results", "accepted: a directory path"]),
    (["fidelity", "--section", "speed"], ["--section", "got 'speed'",
                                          "accepted: memory, overhead, tiled-vs-naive, timing"]),
    (["check", "--results", ""], ["--results", "accepted: a directory path"]),
    (["bench", "--results", " "], ["--results", "accepted: a directory path"]),
    (["bench", "--backend", "numpy-naive", "--seq-lens", "1000000000"], ["--seq-lens", "T=1000000000", "GiB",
                                                                          "available"]),
    (["run", "--seq-lens", "1000000000"], ["--seq-lens", "GiB"]),
])
def test_usage_errors_print_one_line_and_exit_2(args, words):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mha-harness: error:"), out.stderr
    for word in words:
        assert word in lines[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; the read-only case is covered below")
def test_unwritable_results_directory_is_a_usage_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    out = run_cli("check", "--backend", "numpy-naive", "--results", locked / "sub")
    assert out.returncode == 2 and "--results" in out.stderr and "not writable" in out.stderr


def test_results_path_that_is_a_file_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = run_cli("check", "--backend", "numpy-naive", "--results", blocker)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "--results" in out.stderr and "not writable" in out.stderr


def test_missing_optional_dependency_is_one_line_and_exit_2(monkeypatch, capsys):
    import importlib.util

    from mha_harness import cli
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["bench", "--backend", "numpy-naive", "--seq-lens", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib is not installed" in err[0] and "-e '.[bench]'" in err[0]


def test_requesting_a_backend_whose_framework_is_missing_is_one_line_and_exit_2(monkeypatch, capsys):
    from mha_harness import cli
    from mha_harness.implementations import _torch_common
    monkeypatch.setattr(_torch_common, "torch_reason", lambda device="cpu": "torch is not installed (pip install ...)")
    assert cli.main(["check", "--backend", "torch-eager"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch-eager" in err[0] and "torch is not installed" in err[0]


def test_bench_exits_1_when_a_requested_backend_failed_to_load_or_a_point_was_lost(capsys):
    from mha_harness import cli
    measured = {"backend": "a", "status": "measured", "tq": 64, "tk": 64, "mode": "forward"}
    unsupported = {**measured, "status": "skipped", "skipped": "no causal"}
    assert cli._bench_verdict([], {"points": [measured, unsupported]}) == 0
    crashed = {**measured, "backend": "b", "status": "crashed", "skipped": "worker process exited with exit code 3"}
    memory = {**measured, "backend": "c", "memory_error": "timeout: no answer within 8 s"}
    assert cli._bench_verdict(["x: failed to load: SystemExit"], {"points": [measured, crashed, memory]}) == 1
    err = capsys.readouterr().err
    assert "x: failed to load: SystemExit" in err and "b: 1 point(s) not measured" in err and "exit code 3" in err
    # a stranger's timed point whose memory pass timed out read as "not measured": it is timed, memory n/a
    assert "c: 1 point(s) timed but without a memory reading" in err and "memory pass timeout: no answer within 8 s" \
        in err and "c: 1 point(s) not measured" not in err
    assert cli._bench_verdict([], {}) == 1  # nothing benchmarked
    assert "nothing was benchmarked" in capsys.readouterr().err


def test_bench_with_a_plugin_that_exits_at_load_is_exit_1_and_still_measures_the_others(tmp_path):
    out = run_cli("bench", "--backend-spec", "sys:exit", "--backend", "numpy-naive", "--seq-lens", "16",
                  "--budget", "0.2", "--results", tmp_path, env={"MHA_HARNESS_PLUGIN_TIMEOUT": "5"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "sys:exit: failed to load" in out.stderr
    doc = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [p["status"] for p in doc["points"]] == ["measured"]


#: a plugin whose worker holds a multiprocessing semaphore (torch.compile's compile workers do)
POOLED_PLUGIN = ("import multiprocessing\n"
                 "from mha_harness.implementations.numpy_naive import NumpyNaive\n"
                 "class Pooled(NumpyNaive):\n"
                 "    name = 'numpy-pooled'\n"
                 "    def load(self, *args, **kwargs):\n"
                 "        type(self).lock = multiprocessing.get_context('spawn').Lock()\n"
                 "        return super().load(*args, **kwargs)\n")


def test_bench_lets_a_plugins_own_pools_exit_cleanly_before_the_memory_pass(tmp_path):
    """A backend whose worker holds a multiprocessing semaphore (torch.compile's compile workers do) must not make
    the sweep end with "resource_tracker: ... leaked semaphore objects": its worker is told to quit, not killed."""
    (tmp_path / "pooled.py").write_text(POOLED_PLUGIN)
    out = run_cli("bench", "--backend-spec", "pooled:Pooled", "--seq-lens", "16", "--budget", "0.2",
                  "--results", tmp_path / "results", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "leaked semaphore" not in out.stderr, out.stderr


@pytest.mark.parametrize("command", [["check", "--case", "check_output_matches_reference"],
                                     ["search", "--quick", "--seed", "0"]])
def test_check_and_search_leak_no_semaphore_of_a_plugins_worker(tmp_path, command):
    """A worker that is done is told to quit, not killed: a multiprocessing lock its plugin made (torch.compile's
    compile workers make them) is released at its exit, and no "resource_tracker: ... leaked semaphore objects"
    is printed after the command's own output (an outside user's FlexAttention plugin got it after every run)."""
    (tmp_path / "pooled.py").write_text(POOLED_PLUGIN)
    out = run_cli(command[0], "--backend-spec", "pooled:Pooled", *command[1:], "--results", tmp_path / "results",
                  cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "leaked semaphore" not in out.stderr, out.stderr


#: a plugin whose class a factory makes with type(): not importable by its name, so not picklable
FACTORY_PLUGIN = ("from mha_harness.implementations.numpy_naive import NumpyNaive\n"
                  "def backends():\n"
                  "    return [type('Made', (NumpyNaive,), {'name': 'numpy-made'})()]\n")


def test_bench_runs_a_plugins_factory_made_classes_that_do_not_pickle(tmp_path):
    """bench's workers rebuild a backend from its module:object spec, as check's do: a class a factory makes with
    type() (not importable by its name, so not picklable) is benchmarked (an outside user's plugin got a raw
    PicklingError on every point)."""
    (tmp_path / "factory.py").write_text(FACTORY_PLUGIN)
    out = run_cli("bench", "--backend-spec", "factory:backends", "--seq-lens", "16", "--budget", "0.2",
                  "--results", tmp_path / "results", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PicklingError" not in out.stdout + out.stderr
    points = json.loads((tmp_path / "results" / "bench" / "bench.json").read_text())["points"]
    assert points and all(p["status"] == "measured" for p in points), points


def test_fidelity_times_a_plugins_factory_made_classes_that_do_not_pickle(tmp_path):
    """fidelity's workers rebuild a backend from its module:object spec, as bench's do: its timing section compares
    a factory-made plugin class (it had reported "prepare: cannot run the backend in a worker: PicklingError")."""
    (tmp_path / "factory.py").write_text(FACTORY_PLUGIN)
    out = run_cli("fidelity", "--backend-spec", "factory:backends", "--section", "timing", "--timing-seq-lens", "16",
                  "--timing-rounds", "1", "--results", tmp_path / "results", cwd=tmp_path, timeout=300)
    assert "PicklingError" not in out.stdout + out.stderr, out.stdout + out.stderr
    rows = json.loads((tmp_path / "results" / "bench" / "fidelity.json").read_text())["timing"]
    assert [r["backend"] for r in rows] == ["numpy-made"] and rows[0]["sweep_median_s"] is not None, rows


def _check_mutant_as_a_plugin(tmp_path, mutant: str, case: str):
    """``mha-harness check`` of one case on a mutant loaded as a plugin spec from a module in ``tmp_path``."""
    (tmp_path / "broken_plugin.py").write_text(
        "from mha_harness.implementations.mutants.zoo import MUTANTS, MutantBackend\n"
        f"Broken = MutantBackend(next(m for m in MUTANTS if m.name == {mutant!r}))\n")
    return run_cli("check", "--backend-spec", "broken_plugin:Broken", "--case", case,
                   "--results", tmp_path / "results", cwd=tmp_path, timeout=300)


def test_check_console_shows_the_whole_failure_message_with_its_diagnosis(tmp_path):
    """The diagnosis at the end of a long failure message ("the output matches scores scaled by ...") is printed,
    wrapped, not cut off after the tolerance."""
    out = _check_mutant_as_a_plugin(tmp_path, "mutant-scale-sqrt-d-model", "check_scores_scaled_by_sqrt_d_head")
    assert out.returncode == 1, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "the output matches scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)" in text, out.stdout
    assert max(len(line) for line in out.stdout.splitlines() if "FAILED" in line) <= 120
    assert out.stdout.count("repro: python -c 'import mha_harness;") == 1


def test_check_console_gives_each_failing_case_one_repro_line(tmp_path):
    """The first failing variant of each case and backend gets its one-line repro on the console (every variant's
    is in conformance.md and the JSON), not one per variant."""
    out = _check_mutant_as_a_plugin(tmp_path, "mutant-causal-one-future-token", "check_causal_mask_blocks_future_keys")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("FAILED") > 1, out.stdout
    assert out.stdout.count("repro: python -c 'import mha_harness; mha_harness.repro(") == 1, out.stdout


def test_console_message_wraps_and_caps_a_long_message():
    from mha_harness.cli import CONSOLE_MESSAGE_CHARS, console_message
    text = console_message("  FAILED   check_x[b]: ", "word " * 400)
    lines = text.splitlines()
    assert len(lines) > 5 and all(len(line) <= 110 for line in lines)
    assert all(line.startswith(" " * 11) for line in lines[1:])
    assert text.endswith("(cut; the whole message is in conformance.md)")
    assert len(" ".join(text.split())) < CONSOLE_MESSAGE_CHARS + 120


def test_help_documents_backend_spec_and_the_timeout_default(capsys):
    from mha_harness.cli import main
    check_words = ["(default 120)", "only those backends run", "not the other registered ones"]
    for argv, words in ((["check", "--help"], check_words),
                        (["list", "--help"], ["list only the backends of 'package.module:object'",
                                               "the registered ones are not listed"])):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert all(" ".join(w.split()) in text for w in words), text


def test_fidelity_takes_a_plugin_spec_and_checks_only_the_named_backends_overhead(tmp_path, monkeypatch):
    """A stranger could not validate their own backend's timing (fidelity refused --backend-spec), and --backend
    did not narrow the overhead section (it still ran jax-dpa)."""
    from mha_harness.bench import fidelity
    from mha_harness.cli import main
    seen = {}

    def fake_run_fidelity(registry, names, results_dir, threads=2, *, log=print, overhead_names=None, sections=None,
                          **_timing_shape):
        seen.update(names=names, overhead=overhead_names, registry=registry, sections=sections)
        # every named backend compared (a section asked for that compares nothing for one exits 1)
        return {"timing": [{"backend": n, "within_10pct": True, "within_5pct": True} for n in names],
                "overhead": [{"backend": n, "within_target": True} for n in names]}
    monkeypatch.setattr(fidelity, "run_fidelity", fake_run_fidelity)
    assert main(["fidelity", "--backend-spec", "tests.plugin_objects:RenamedNaive", "--results", str(tmp_path)]) == 0
    assert seen["names"] == seen["overhead"] and len(seen["names"]) >= 1 and seen["sections"] is None
    assert main(["fidelity", "--backend-spec", "tests.plugin_objects:RenamedNaive", "--section", "timing",
                 "--section", "overhead", "--results", str(tmp_path)]) == 0
    assert seen["sections"] == ["timing", "overhead"]
    assert all(seen["registry"].get(n).spec == "tests.plugin_objects:RenamedNaive" for n in seen["names"])
    rows = fidelity.harness_overhead(seen["registry"], fidelity.BenchConfig(), names=seen["names"],
                                     log=lambda *a, **k: None)
    assert rows and all("no direct_callable" in r["not_runnable"] for r in rows)


def test_check_progress_prints_a_repeated_message_once_and_the_diagnosed_variants_repro():
    """A stranger's wrong-shape plugin printed 41 near-identical failures, and the repro shown for a case was of its
    first failing variant, not of the one whose message named the bug: a message the case already printed for the
    backend is one short line, and the first diagnosed variant's repro follows when the one shown had none; a second
    mistake in the same case gets its own repro (an outside user's Qwen 3 layer: its second diagnosis had none)."""
    import io

    from mha_harness.cli import ProgressLines
    from mha_harness.conformance.results import CaseResult, Status

    out = io.StringIO()
    progress = ProgressLines(out)

    def failed(variant, message, diagnosis=""):
        progress(CaseResult("b", "check_x", variant, {}, Status.FAILED, message=message, repro=f"repro-{variant}",
                            extra={"diagnosis": diagnosis} if diagnosis else {}))

    failed("v1", "output shape: expected (1, 8), got (1, 7)")
    failed("v2", "output shape: expected (1, 8), got (1, 7)")
    failed("v3", "off by 1; the output matches top-left alignment instead", diagnosis="top-left alignment instead")
    failed("v4", "off by 2; the output matches top-left alignment instead", diagnosis="top-left alignment instead")
    failed("v5", "off by 3; the output matches base 10000", diagnosis="base 10000")  # another mistake: its repro too
    lines = out.getvalue().splitlines()
    assert "  FAILED   check_x[v2]: the same message as [v1]" in lines
    assert [line.strip() for line in lines if "repro:" in line] == ["repro: repro-v1", "repro: repro-v3",
                                                                    "repro: repro-v5"]
    # a diagnosis printed in full once per backend (an undeclared T5 scale printed 110 failures in 773 lines)
    assert any(line.endswith("check_x[v3]: off by 1; the output matches top-left alignment instead") for line in lines)
    assert ("  FAILED   check_x[v4]: the same diagnosis as check_x[v3] (the full message is in the report)"
            in lines), lines
    # another case's variant of the same diagnosis is named with its case (variant ids repeat across cases); one that
    # fails even under its declaration says so (an outside user's float64 variants read as plain repeats)
    progress(CaseResult("b", "check_y", "v3", {}, Status.FAILED, repro="repro-y", max_error=1.5,
                        message="fails even under its declared divergence (compared against the bound of dtype "
                                "float32): off by 3; the output matches top-left alignment instead",
                        extra={"diagnosis": "top-left alignment instead"}))
    assert out.getvalue().splitlines()[-2] == (
        "  FAILED   check_y[v3]: fails even under its declared divergence (compared against the bound of dtype "
        "float32): max error 1.5; the same diagnosis as check_x[v3] (the full message is in the report)")


def test_a_message_repeated_across_cases_is_printed_whole_once_then_a_few_short_lines():
    """An outside user's plugin that raised in load printed the same error with a repro line 28 times, once per case:
    it is printed whole once, then a short line for each of the next variants up to REPEATS_SHOWN, then one line
    saying the rest are in the report."""
    import io

    from mha_harness.cli import REPEATS_SHOWN, ProgressLines
    from mha_harness.conformance.results import CaseResult, Status
    out = io.StringIO()
    progress = ProgressLines(out)
    for i in range(10):
        progress(CaseResult("b", f"check_{i}", "v", {}, Status.ERROR, message="RuntimeError: cannot build it",
                            repro=f"repro-{i}"))
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("check_0[v]: RuntimeError: cannot build it") and lines[1].strip() == "repro: repro-0"
    assert lines[2:2 + REPEATS_SHOWN] == [f"  ERROR    check_{i}[v]: the same message as check_0[v]"
                                          for i in range(1, 1 + REPEATS_SHOWN)]
    assert lines[2 + REPEATS_SHOWN:] == ["  ERROR    b: more variants with the same message as check_0[v] (not "
                                         "printed; each is in the report)"]


def test_list_shows_the_longest_sequence_a_backend_declares_and_missing_native_parameter_shapes(
        capsys, tmp_path, monkeypatch):
    """An outside user's GPT-2 layer declared max_seq_len=4096, which decides what check and bench skip, and
    `list -v` did not show it."""
    from mha_harness.cli import main
    (tmp_path / "limited_layer.py").write_text(
        "import dataclasses\n"
        "from mha_harness.implementations.numpy_naive import NumpyNaive\n\n\n"
        "class Limited(NumpyNaive):\n"
        "    name = 'limited'\n"
        "    capabilities = dataclasses.replace(NumpyNaive.capabilities, max_seq_len=4096, native_parameters=False)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["list", "-v", "--backend-spec", "limited_layer:Limited"]) == 0
    line = capsys.readouterr().out.split("\n")[1]
    assert "sequences up to 4096 positions (max_seq_len)" in line, line
    assert "no native parameter shapes (the parameter count case skips)" in line, line
