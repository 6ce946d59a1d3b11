"""Fault injection: hostile plugins never take the run down or lose other backends' results."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mha_harness
from tests.conftest import ROOT, run_cli

#: fail at once; checked next to a healthy backend under the default timeout, so a loaded machine (pytest -n auto)
#: cannot time the healthy one out
HOSTILE = ["RaisesInForward", "WrongShape", "ReturnsNaN", "KillsProcess", "Segfaults"]
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


def _case_args():
    return [arg for case in CASES for arg in ("--case", case)]


@pytest.fixture(scope="module")
def hostile_check(tmp_path_factory):
    results = tmp_path_factory.mktemp("hostile")
    args = ["check", *_hostile_args(), "--backend", "numpy-tiled", "--results", results, *_case_args()]
    return run_cli(*args, timeout=300), results


@pytest.fixture(scope="module")
def hanging_check(tmp_path_factory):
    """The plugin that hangs, in a run of its own with a 4 s timeout (the healthy backend keeps the default)."""
    results = tmp_path_factory.mktemp("hangs")
    args = ["check", "--backend-spec", "tests.hostile_plugins:Hangs", "--timeout", "4", "--results", results,
            *_case_args()]
    return run_cli(*args, timeout=300), results


def test_check_completes_and_fails_only_because_of_the_hostile_plugins(hostile_check):
    out, results = hostile_check
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads((results / "conformance" / "conformance.json").read_text())
    assert doc["complete"] and not doc["ok"]
    healthy = [r for r in doc["results"] if r["backend"] == "numpy-tiled"]
    assert len(healthy) == len(CASES) and all(r["status"] == "passed" for r in healthy)


@pytest.mark.parametrize("backend, statuses", sorted(EXPECTED.items()))
def test_each_hostile_plugin_is_reported_with_its_reason(hostile_check, hanging_check, backend, statuses):
    out, results = hanging_check if backend == "hostile-hangs" else hostile_check
    doc = json.loads((results / "conformance" / "conformance.json").read_text())
    mine = [r for r in doc["results"] if r["backend"] == backend]
    assert len(mine) == len(CASES)
    # the first case shows the plugin's own fault; "error" only where that is the fault (later cases of a lost
    # worker are errors: "not run")
    first_status = (statuses - {"error"}) or statuses
    assert {r["status"] for r in mine} <= statuses and mine[0]["status"] in first_status
    assert all(r["message"] for r in mine)
    first = mine[0]["message"]
    reason = {"hostile-raises": "forward exploded", "hostile-wrong-shape": "output shape",
              "hostile-nan": "expected finite values", "hostile-hangs": "no result within 4 s",
              "hostile-exits": "exit code 17", "hostile-segfault": "SIGSEGV (exit code -11)"}[backend]
    assert reason in first


def test_a_plugin_that_fails_to_import_is_a_reported_load_error(hostile_check):
    out, results = hostile_check
    doc = json.loads((results / "conformance" / "conformance.json").read_text())
    info = doc["backends"]["tests.hostile_import:Backend"]
    assert info["load_error"] and "ImportError: hostile plugin" in info["reason"]
    assert "failed to load" in (results / "conformance" / "conformance.md").read_text()


def test_run_survives_hostile_plugins_and_still_benchmarks_the_rest(tmp_path):
    """Plugins that kill their worker or hang are reported and left out of the benchmarks; the 30 s per-case
    timeout leaves the healthy backend room on a loaded machine."""
    out = run_cli("run", "--backend", "numpy-naive", "--backend-spec", "tests.hostile_plugins:KillsProcess",
                  "--backend-spec", "tests.hostile_plugins:Hangs", "--timeout", "30", "--seq-lens", "32,64,128",
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
    # the case the interrupt cut short is not run, not an internal error of the harness blamed on the plugin (an
    # outside user's report said "AttributeError: 'NoneType' object has no attribute 'exitcode'")
    hung = [r for r in doc["results"] if r["backend"] == "hostile-hangs"]
    assert all("NoneType" not in (r["message"] or "") and "AttributeError" not in (r["message"] or "")
               for r in hung), hung
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


# --- the verdict lives where the plugin cannot reach; plugin exits are that backend's errors ------------------

VERDICT = {"PatchesTheVerdict": ("hostile-patches-verdict", "failed", "expected"),
           "ReturnsComplex": ("hostile-complex", "failed",
                              "output dtype: got complex64; accepted: a real floating dtype"),
           "ReturnsObjects": ("hostile-object", "failed", "output dtype: got object"),
           "ReturnsNoneOutput": ("hostile-none-output", "failed",
                                 "output: got None; accepted: a real floating array of shape"),
           "ForgetsToReturn": ("hostile-forgets-return", "error",
                               "returned NoneType (a compute without a return statement gives None)"),
           "ReturnsPythonList": ("hostile-python-list", "error",
                                 "forward: AttentionOutput.output: got list; accepted: a NumPy array"),
           "RaisesSystemExit": ("hostile-systemexit", "error", "SystemExit"),
           "RaisesKeyboardInterrupt": ("hostile-keyboardinterrupt", "error", "KeyboardInterrupt"),
           "RaisesGeneratorExit": ("hostile-generatorexit", "error", "GeneratorExit"),
           "ExitsZeroAtLoad": ("hostile-exit0-at-load", "error", "SystemExit: 0"),
           "KilledBySignal9": ("hostile-sigkill", "crashed", "killed by SIGKILL (exit code -9)"),
           "SpawnsChild": ("hostile-spawns-child", "passed", ""),
           "WritesJunkToItsPipes": ("hostile-writes-junk-to-its-pipes", "error",
                                    "the worker's answer could not be read")}
ONE_CASE = "check_output_projection_mixes_heads"


@pytest.fixture(scope="module")
def verdict_check(tmp_path_factory):
    results = tmp_path_factory.mktemp("verdict")
    pid_file = results / "children.txt"
    args = ["check", "--backend", "numpy-tiled", "--case", ONE_CASE, "--timeout", "60", "--results", results]
    for obj in VERDICT:
        args += ["--backend-spec", f"tests.hostile_plugins:{obj}"]
    # capture_output waits for EOF on stdout: a plugin's child still holding it would make this time out
    out = run_cli(*args, timeout=600, env={"MHA_HOSTILE_PID_FILE": str(pid_file)})
    return out, json.loads((results / "conformance" / "conformance.json").read_text()), pid_file


@pytest.mark.parametrize("obj", sorted(VERDICT))
def test_hostile_plugins_get_their_own_verdict(verdict_check, obj):
    out, doc, _ = verdict_check
    name, status, words = VERDICT[obj]
    mine = [r for r in doc["results"] if r["backend"] == name]
    assert [r["status"] for r in mine] == [status], (mine, out.stderr[-2000:])
    assert words in mine[0]["message"]


def test_the_run_fails_and_healthy_backends_keep_their_results(verdict_check):
    out, doc, _ = verdict_check
    assert out.returncode == 1, out.stderr[-2000:]
    assert [r["status"] for r in doc["results"] if r["backend"] == "numpy-tiled"] == ["passed"]


def test_a_patching_plugin_fails_on_the_clean_verdict_with_the_true_error(verdict_check):
    _, doc, _ = verdict_check
    result = next(r for r in doc["results"] if r["backend"] == "hostile-patches-verdict")
    assert result["max_error"] > 0.1 and "exceeds tolerance" in result["message"]


def test_a_plugins_child_process_does_not_outlive_the_run(verdict_check):
    _, _, pid_file = verdict_check
    pids = [int(p) for p in pid_file.read_text().split()]
    assert pids
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        alive = stat.exists() and stat.read_text().split(") ")[-1][:1] not in ("Z", "X")
        assert not alive, f"the plugin's child {pid} outlived the run"


@pytest.mark.parametrize("obj", ["RaisesSystemExit", "ExitsZeroAtLoad", "RaisesKeyboardInterrupt"])
def test_a_plugin_alone_cannot_make_the_run_exit_0_or_130(tmp_path, obj):
    out = run_cli("check", "--backend-spec", f"tests.hostile_plugins:{obj}", "--case", ONE_CASE,
                  "--results", tmp_path, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert doc["complete"] and not doc["ok"]


def test_without_isolation_a_patching_plugin_reaches_the_verdict_but_trips_the_wire(tmp_path):
    """--no-isolate runs plugin code in the harness's process: the plugin does fool its case (as the README says),
    but the integrity tripwire sees what it replaced and fails the run."""
    out = run_cli("check", "--no-isolate", "--backend-spec", "tests.hostile_plugins:PatchesTheVerdict",
                  "--case", ONE_CASE, "--results", tmp_path, timeout=300)
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert [r["status"] for r in doc["results"]] == ["passed"], out.stderr
    assert out.returncode == 1 and not doc["ok"]
    assert {"numpy.exp", "mha_harness.conformance.runner._execute",
            "mha_harness.conformance.casekit.assert_close"} <= set(doc["tampered"])
    assert "TAMPERED" in out.stdout
    assert "tampered with" in (tmp_path / "conformance" / "conformance.md").read_text()


def test_a_plugin_patching_numpy_at_import_trips_the_wire(tmp_path):
    """Import happens in the harness's process (the registry reads names and declarations there)."""
    out = run_cli("check", "--backend-spec", "tests.hostile_patch_at_import:Backend", "--case", ONE_CASE,
                  "--results", tmp_path, timeout=300)
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    assert out.returncode == 1 and "numpy.exp" in doc["tampered"], out.stdout + out.stderr


def test_out_of_memory_is_named_when_the_kernel_counter_rose():
    from mha_harness.conformance.isolation import death_message, oom_kills
    assert death_message(-9, 3, 4) == "killed: out of memory (signal 9)"
    assert death_message(-9, 3, 3) == "worker process killed by SIGKILL (exit code -9)"
    assert death_message(-9, None, None) == "worker process killed by SIGKILL (exit code -9)"
    assert death_message(17, 0, 1) == "worker process exited with exit code 17 before answering"
    assert isinstance(oom_kills(), int)  # this machine exposes a counter (cgroup memory.oom_control / vmstat)


def test_oom_counter_is_read_from_the_cgroup_files(tmp_path, monkeypatch):
    from mha_harness.conformance import isolation
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 5\n")
    monkeypatch.setattr(isolation, "OOM_COUNTER_FILES", [tmp_path / "missing", events])
    assert isolation.oom_kills() == 5


def test_worker_answers_cross_as_data_never_as_pickles():
    import numpy as np

    from mha_harness.util.wire import UnsendableArray, decode, encode
    message = {"ok": {"output": np.arange(6.0).reshape(2, 3), "weights": None, "o": np.array([1, None], object)}}
    back = decode(encode(message))
    assert np.array_equal(back["ok"]["output"], message["ok"]["output"]) and back["ok"]["weights"] is None
    assert back["ok"]["o"] == UnsendableArray("object", (2,))
    import pickle
    import struct
    with pytest.raises((ValueError, UnicodeDecodeError, struct.error)):
        decode(pickle.dumps(message))


def test_a_lost_worker_abandons_the_rest_in_one_line_but_declared_skips_stay_skips(tmp_path):
    """After two crashes in a row the remaining variants are errors marked ABANDONED (one console line for them
    all, each in the JSON), while cases the backend never declared capabilities for are skipped with their reason:
    that decision needs no worker (hostile-exits is numpy-naive, which declares no gradients)."""
    cases = ["check_output_projection_mixes_heads", "check_scores_scaled_by_sqrt_d_head",
             "check_gradients_match_reference", "check_causal_jacobian_zero_for_future_inputs",
             "check_batch_items_are_independent", "check_repeated_calls_are_bitwise_identical"]
    out = run_cli("check", "--backend-spec", "tests.hostile_plugins:KillsProcess", "--results", tmp_path,
                  *[arg for case in cases for arg in ("--case", case)], timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads((tmp_path / "conformance" / "conformance.json").read_text())
    mine = {r["case"]: r for r in doc["results"] if r["backend"] == "hostile-exits"}
    assert [mine[c]["status"] for c in cases] == ["crashed", "crashed", "skipped", "skipped", "error", "error"]
    assert all("does not declare capability 'gradients'" in mine[c]["message"] for c in cases[2:4])
    abandoned = [mine[c] for c in cases[4:]]
    assert all(r["observed"] == "not run: worker lost" and "case variant(s) were abandoned" in r["message"]
               for r in abandoned)
    lines = [line for line in out.stdout.splitlines() if "abandoned" in line]
    assert len(lines) == 1 and "hostile-exits" in lines[0], out.stdout
    assert "check_batch_items_are_independent" not in out.stdout
    assert "skip reasons: the 'Skipped' section of" in out.stdout  # the summary says where the skips are explained


def test_backends_start_longest_first_and_every_one_runs_once(monkeypatch):
    """run_isolated hands the backends to its ``jobs`` threads in schedule order: those that compile per shape
    first, then more planned variants first (ties keep the given order); every backend runs exactly once."""
    from mha_harness.conformance import isolation
    from mha_harness.conformance.isolation import Target, run_isolated, schedule
    from mha_harness.conformance.runner import select_cases
    from mha_harness.implementations.numpy_naive import NumpyNaive
    from mha_harness.implementations.numpy_tiled import NumpyTiled

    class Compiled(NumpyTiled):
        compiles_per_shape = True

    class FewCases(NumpyNaive):
        def __init__(self, name):
            self.name = name
    small, big, compiled, other_small = FewCases("few-1"), NumpyNaive(), Compiled(), FewCases("few-2")
    big.name, compiled.name = "many", "compiled"
    cases = select_cases(["check_output_matches_reference", "check_batch_items_are_independent"])
    cases_small = select_cases(["check_batch_items_are_independent"])
    monkeypatch.setattr(FewCases, "capabilities", NumpyNaive.capabilities.__class__(dtypes=("float32",)))
    targets = [Target(t) for t in (small, big, compiled, other_small)]
    assert [t.name for t in schedule(targets, cases)] == ["compiled", "many", "few-1", "few-2"]
    assert [t.name for t in schedule(targets, cases_small)] == ["compiled", "few-1", "many", "few-2"]

    started = []
    monkeypatch.setattr(isolation, "run_target_isolated",
                        lambda target, cases, **kw: started.append(target.name) or [])
    out = run_isolated(targets, cases, jobs=1)
    assert started == ["compiled", "many", "few-1", "few-2"] and sorted(out) == sorted(started)
    started.clear()
    out = run_isolated(targets, cases, jobs=3)
    assert sorted(started) == sorted(out) == ["compiled", "few-1", "few-2", "many"]


_EARLY_SERVER_PROBE = '''
import multiprocessing
import sys


def report(conn):
    conn.send(sorted(m for m in ("torch", "jax", "flax.linen") if m in sys.modules))


if __name__ == "__main__":
    from mha_harness.conformance.isolation import start_worker_server
    start_worker_server()
    assert not {"torch", "jax", "flax"} & set(sys.modules), "the probe's own process imported a framework"
    context = multiprocessing.get_context("forkserver")
    mine, theirs = context.Pipe()
    worker = context.Process(target=report, args=(theirs,))
    worker.start()
    print(mine.recv())
    worker.join()
'''


def test_the_worker_server_starts_before_any_framework_is_imported_and_preloads_the_installed_ones(tmp_path):
    """check, run and search start the fork server before loading the registry: it must preload every installed
    framework by itself (not only those this process had imported by then), so a worker finds them imported."""
    import importlib.util
    probe = tmp_path / "probe.py"
    probe.write_text(_EARLY_SERVER_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "MHA_HARNESS_WORKER_START"}
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    installed = sorted(m for m in ("torch", "jax", "flax.linen") if importlib.util.find_spec(m.split(".")[0]))
    assert out.stdout.strip() == str(installed)


@pytest.mark.parametrize("isolate", [True, False], ids=["worker", "in-process"])
def test_a_plugin_writing_into_its_inputs_fails_alike_in_its_worker_and_in_process(isolate):
    """A layer that reuses its caller's query array as scratch (its outputs are right) fails every case that calls
    it, naming the array, in both modes. Before, in-process, the reference was computed from the overwritten array:
    a plugin zeroing its query (and computing from zeros) passed 94 of 98 variants there and failed 61 isolated."""
    from mha_harness.implementations.mutants.zoo import MUTANTS, MutantBackend
    mutant = next(m for m in MUTANTS if m.name == "mutant-query-reused-as-scratch")
    report = mha_harness.check(MutantBackend(mutant, weights=False), cases=["check_output_matches_reference"],
                               isolate=isolate)
    failed = report.failures()
    assert failed and len(failed) == len(report.results) - sum(r.status.value == "skipped" for r in report.results)
    assert all("forward wrote into its inputs.query" in f.message for f in failed), failed[0].message


def test_in_process_calls_hand_the_plugin_copies_that_keep_the_form():
    """The in-process transport copies what crosses it, as a worker's pipe does, and keeps query is key is value."""
    from mha_harness.conformance.proxy import InProcess
    from mha_harness.contract.params import make_inputs, make_params
    from mha_harness.implementations.numpy_naive import NumpyNaive
    seen = []

    class Spy(NumpyNaive.loaded_class):
        def compute(self, inputs, *, need_weights=False):
            seen.append(inputs)
            return super().compute(inputs, need_weights=need_weights)

    backend = NumpyNaive()
    backend.loaded_class = Spy
    params = make_params(mha_harness.AttentionConfig(8, 2))
    inputs = make_inputs(params.config, 1, 3, seed=0)  # one x: query is key is value
    transport = InProcess(backend)
    handle = transport.call("load", params, "float32")
    out = transport.call("forward", handle, inputs, False, None)
    given = seen[0]
    assert given.query is not inputs.query and given.query is given.key is given.value
    out["output"][...] = 0.0  # what came back is the harness's own
    assert not np.all(transport.call("forward", handle, inputs, False, None)["output"] == 0)


def test_an_answer_is_read_whole_or_refused_within_its_deadline():
    """recv_bytes_within reads what send_bytes sent (small, and across many reads), and a forged frame header, one
    longer than allowed, or a frame that never completes is a GarbledAnswer within the deadline, never a hang."""
    import multiprocessing
    import time

    from mha_harness.util.pipes import GarbledAnswer, recv_bytes_within
    parent, child = multiprocessing.Pipe()
    import threading
    for payload in (b"", b"x", bytes(range(256)) * 40000):  # 10 MB: written by another thread as the pipe drains
        writer = threading.Thread(target=child.send_bytes, args=(payload,))
        writer.start()
        assert recv_bytes_within(parent, 5) == payload
        writer.join()
    child.send_bytes(b"abc")
    with pytest.raises(GarbledAnswer, match="announces 3 bytes"):
        recv_bytes_within(parent, 5, maxlength=2)
    import os
    os.write(child.fileno(), b"\x00\x00\x10\x00" + b"short")  # promises 4096 bytes, sends 5
    start = time.monotonic()
    with pytest.raises(GarbledAnswer, match="did not arrive whole"):
        recv_bytes_within(parent, 0.5)
    assert time.monotonic() - start < 3
    os.write(child.fileno(), b"\x80\x04garbage")  # a negative length
    with pytest.raises(GarbledAnswer):
        recv_bytes_within(parent, 0.5)


# --- the Python API: a script without its main guard, a timeout in-process, sys.exit in-process ----------------

_SCRIPT = '''import mha_harness
from mha_harness.implementations.numpy_naive import NumpyNaive


class Mine(NumpyNaive):
    name = "mine"
{guard}
report = mha_harness.check([Mine()], isolate=True, cases=["check_output_projection_mixes_heads"])
print("statuses", [r.status.value for r in report.results])
'''


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_that_starts_workers_without_its_main_guard_is_told_so_at_once(tmp_path, guarded):
    """An outside user's plain script called check(isolate=True) at its top level: each worker imported the script
    again and ran it, and after 600 s a correct backend failed with "the worker did not import and build the
    backend within 300 s". Now the call is refused before any worker starts, naming the guard."""
    body = _SCRIPT.format(guard='if __name__ == "__main__":' if guarded else "")
    if guarded:
        body = body.replace("\nreport =", "\n    report =").replace("\nprint(", "\n    print(")
    script = tmp_path / "mine.py"
    script.write_text(body)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if guarded:
        assert out.returncode == 0 and "statuses ['passed']" in out.stdout, out.stderr[-2000:]
    else:
        assert out.returncode == 1 and out.stdout.count("statuses") == 0
        assert "has no `if __name__ == \"__main__\":` guard: put the call under" in out.stderr, out.stderr[-2000:]


_BENCH_SCRIPT = '''from mha_harness.bench.sweep import BenchConfig, run_bench
from mha_harness.implementations.numpy_naive import NumpyNaive

config = BenchConfig(d_model=32, num_heads=4, budget_s=0.1, warm_up_s=0.02, min_sample_s=0.002, turn_s=0.01)
doc = run_bench([NumpyNaive()], None, seq_lens=[16], config=config, log=lambda *a, **k: None)
print("points", len(doc["points"]))
'''


def test_a_script_that_benchmarks_without_its_main_guard_is_told_so_before_a_worker_starts(tmp_path):
    """run_bench spawns a worker per backend, which imports the main script again: a script calling it at its top
    level ran its sweep again inside every worker. It is refused before the roofs are measured, naming the guard
    (bench has no in-process alternative to offer)."""
    script = tmp_path / "bench_mine.py"
    script.write_text(_BENCH_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "points" not in out.stdout, out.stdout[-2000:]
    assert ("mha_harness.bench.sweep.run_bench was called from" in out.stderr
            and "has no `if __name__ == \"__main__\":` guard: put the call under" in out.stderr), out.stderr[-2000:]
    assert "isolate=False" not in out.stderr


def test_a_timeout_that_could_not_be_enforced_in_process_is_refused_naming_it(capsys):
    import mha_harness
    from mha_harness.cli import main
    with pytest.raises(ValueError, match=r"timeout: got 3 with isolate=False; accepted: None, or isolate=True"):
        mha_harness.check("numpy-naive", timeout=3)
    assert main(["check", "--backend", "numpy-naive", "--no-isolate", "--timeout", "3"]) == 2
    assert "--timeout: got 3 with --no-isolate; accepted: leave it out" in capsys.readouterr().err


def test_sys_exit_in_a_plugin_run_in_process_is_its_error_and_the_run_goes_on():
    """With isolate=False (the Python default) a plugin's sys.exit ended the user's script; now it is that case's
    error and the next backend runs."""
    import mha_harness
    from tests.hostile_plugins import RaisesSystemExit
    report = mha_harness.check([RaisesSystemExit(), "numpy-naive"], cases=[ONE_CASE])
    statuses = {r.backend: r.status.value for r in report.results}
    assert statuses == {"hostile-systemexit": "error", "numpy-naive": "passed"}, statuses
    exited = next(r for r in report.results if r.backend == "hostile-systemexit")
    assert "SystemExit(0) from the plugin's forward: the plugin called sys.exit" in exited.message


@pytest.mark.parametrize("isolate", [False, True])
def test_an_error_a_plugin_raises_names_the_call_it_raised_on(isolate):
    """A plugin's own exception (a shape error at Tq != Tk) says which call raised it, its shapes and masks, on
    both routes: the traceback alone does not tell the variant's call apart from the others."""
    report = mha_harness.check(["tests.hostile_plugins:RefusesCrossShapes"], isolate=isolate,
                               cases=["check_padding_mask_output_matches_reference",
                                      "check_mask_compositions_match_reference"])
    errors = {(r.case, r.params.get("variant")): r.message for r in report.results if r.status == "error"}
    padding = errors[("check_padding_mask_output_matches_reference", "cross_attention")]
    assert padding.startswith("ValueError: operands could not be broadcast"), padding
    assert padding.endswith("; raised by the plugin's forward of batch 3, Tq = 7 queries against Tk = 300 keys "
                            "(separate query/key/value), with key_padding_mask (3, 300)"), padding
    composed = [m for (case, variant), m in errors.items() if variant == "causal_with_padding"]
    assert composed and all("a causal mask (" in m and " and key_padding_mask (2, 11)" in m for m in composed), composed
    assert not [r for r in report.results if r.status == "error" and r.params.get("seq", 0) == r.params.get("tk")]
