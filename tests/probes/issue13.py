"""Issue 13's probe set, from outside: hostile plugins and malformed input given to ``python -m mha_harness`` and to
the public Python API as a user would, counting tracebacks, silent accepts, exit codes, lost backends and orphans.

    python -m tests.probes.issue13 [--jobs N] [NAME_SUBSTRING ...]    # the table (markdown) on stdout
    python -m pytest tests/probes                                     # the same probes as tests

A probe's *expected* exit codes are what the issue asks for; a *silent accept* is an exit 0 where the issue wants a
refusal, or a refusal whose output does not say what was wrong (the probe's words missing); a *traceback* is
"Traceback (most recent call last)" anywhere in stdout or stderr (or, for API probes, an exception that is not a
ValueError/TypeError naming the parameter); *orphans* are processes still alive after the run whose command line
carries the probe's marker, or a stdout that stayed open after the harness exited.
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.probes.plugins import ENTRY_POINTS, PLUGINS

ROOT = Path(__file__).resolve().parents[2]
FAST_CASE = "check_scores_scaled_by_sqrt_d_head"
TRACEBACK = "Traceback (most recent call last)"
PLUGIN_TIMEOUT_S = "4"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


@dataclass
class Observation:
    exit_code: int | None
    traceback: bool = False
    silent: bool = False
    lost: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0
    skipped: str | None = None


@dataclass
class Probe:
    name: str
    bullet: str
    expected: tuple[int, ...]  # acceptable exit codes (API probes: 0 = accepted, 2 = refused naming the parameter)
    run: Callable[[Path], Observation]

    def verdict(self, obs: Observation) -> list[str]:
        """What is wrong with ``obs`` (empty: the probe holds)."""
        if obs.skipped:
            return []
        problems = []
        if obs.exit_code not in self.expected:
            problems.append(f"exit {obs.exit_code}, expected {'/'.join(map(str, self.expected))}")
        if obs.traceback:
            problems.append("traceback")
        if obs.silent:
            problems.append("silent accept")
        if obs.lost:
            problems.append(f"lost backends {obs.lost}")
        if obs.orphans:
            problems.append(f"orphans {obs.orphans}")
        return problems


# --- running the command line from outside -----------------------------------------------------------------------

def write_plugins(folder: Path, entry_points: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in PLUGINS.items():
        (folder / name).write_text(text)
    if entry_points:
        for name, text in ENTRY_POINTS.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
    return folder


def marked_processes(mark: str) -> list[int]:
    """Pids (not this process) whose command line holds ``mark``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass
class Ran:
    code: int | None
    out: str
    err: str
    orphans: list[str]
    seconds: float

    @property
    def text(self) -> str:
        return self.out + self.err

    def observe(self, words=(), *, refuse: bool = True, extra: str = "", note: str = "") -> Observation:
        """An Observation: silent when a refusal was expected and the exit was 0, or a word is missing."""
        haystack = self.text + extra
        missing = [w for w in words if w not in haystack]
        silent = (refuse and self.code == 0) or bool(missing)
        tail = (self.err.strip().splitlines() or self.out.strip().splitlines() or [""])[-1][:160]
        parts = [note] if note else []
        if missing:
            parts.append(f"missing {missing}")
        parts.append(tail)
        return Observation(self.code, TRACEBACK in self.text, silent, orphans=self.orphans,
                           note="; ".join(p for p in parts if p), seconds=self.seconds)


def run_cli(tmp: Path, *args, env=None, timeout=300, entry_points=False, cgroup: Path | None = None,
            wait_after=1.0) -> Ran:
    """``python -m mha_harness ARGS`` in ``tmp`` (its own session), the plugins on PYTHONPATH; orphans counted."""
    plugins = write_plugins(tmp / ("plugins-ep" if entry_points else "plugins"), entry_points)
    mark = f"h13-mark-{uuid.uuid4().hex}"
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT)]), "H13_MARK": mark,
                "MHA_HARNESS_PLUGIN_TIMEOUT": PLUGIN_TIMEOUT_S, **(env or {})}
    command = [sys.executable, "-m", "mha_harness", *map(str, args)]
    if cgroup is not None:
        command = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *command]
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=tmp, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    orphans = []
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            orphans.append(f"the run did not end within {timeout} s")
        else:
            orphans.append("stdout held open after the harness exited")
        _kill(marked_processes(mark))
        out, err = proc.communicate(timeout=30)
    seconds = time.monotonic() - start
    time.sleep(wait_after)
    left = marked_processes(mark)
    if left:
        orphans.append(f"{len(left)} plugin process(es) alive after the run")
        _kill(left)
    return Ran(proc.returncode, out, err, orphans, seconds)


def report_of(tmp: Path) -> tuple[dict | None, str]:
    folder = tmp / "results" / "conformance"
    try:
        doc = json.loads((folder / "conformance.json").read_text())
    except (OSError, ValueError):
        doc = None
    try:
        md = (folder / "conformance.md").read_text()
    except OSError:
        md = ""
    return doc, md


def check_probe(spec: str, words, *, case=FAST_CASE, expected=(1,), extra_args=(), env=None, entry_points=False,
                bullet="", name=None, timeout=300) -> Probe:
    """``check --backend-spec SPEC --case CASE``: the plugin's failure must be in the output or the report."""
    def run(tmp: Path) -> Observation:
        args = ["check", "--backend-spec", spec, "--case", case, "--results", "results", "--timeout", "20",
                *extra_args]
        ran = run_cli(tmp, *args, env=env, entry_points=entry_points, timeout=timeout)
        doc, md = report_of(tmp)
        return ran.observe(words, refuse=0 not in expected, extra=json.dumps(doc) + md)
    return Probe(name or f"check {spec}", bullet, expected, run)


def usage_probe(*args, words=()) -> Probe:
    def run(tmp: Path) -> Observation:
        ran = run_cli(tmp, *args)
        lines = ran.err.strip().splitlines()
        obs = ran.observe([*words])
        if ran.code == 2 and (len(lines) != 1 or not lines[0].startswith("mha-harness: error:")):
            obs.silent, obs.note = True, f"not one error line: {ran.err[-300:]!r}"
        return obs
    return Probe(" ".join(args), "command line", (2,), run)


# --- the probes --------------------------------------------------------------------------------------------------

def _slow_import(tmp: Path) -> Observation:
    """A correct plugin whose import takes 6 s, run with --timeout 5: the import is not charged to a case."""
    ran = run_cli(tmp, "check", "--backend-spec", "h13slow_import:Backend", "--case", FAST_CASE, "--results",
                  "results", "--timeout", "5", env={"H13_IMPORT_SECONDS": "6", "MHA_HARNESS_PLUGIN_TIMEOUT": "20"})
    obs = ran.observe(refuse=False)
    obs.silent = False
    return obs


def _concurrent_writers(tmp: Path) -> Observation:
    """Two check runs into one --results at once (one of them failing); both runs' backends must be in the report."""
    runs = []
    with ThreadPoolExecutor(2) as pool:
        for spec in ("h13plug:Correct", "h13plug:ExitInWorker"):
            sub = tmp / spec.split(":")[1]
            sub.mkdir()
            runs.append(pool.submit(run_cli, sub, "check", "--backend-spec", spec, "--backend", "numpy-naive"
                                    if spec.endswith("Correct") else "numpy-tiled", "--case", FAST_CASE, "--case",
                                    "check_heads_are_separated", "--results", tmp / "shared", "--jobs", "1"))
    outcomes = [r.result() for r in runs]
    doc = json.loads((tmp / "shared" / "conformance" / "conformance.json").read_text())
    wanted = {"h13-correct", "numpy-naive", "h13-exit0-in-worker", "numpy-tiled"}
    lost = sorted(wanted - set(doc["backends"]) | wanted - {r["backend"] for r in doc["results"]})
    codes = [o.code for o in outcomes]
    obs = Observation(1 if codes == [0, 1] else max(c or 0 for c in codes) + 100,
                      any(TRACEBACK in o.text for o in outcomes), lost=lost,
                      orphans=[x for o in outcomes for x in o.orphans], note=f"exit codes {codes}; report ok "
                      f"{doc['ok']}", seconds=max(o.seconds for o in outcomes))
    obs.silent = doc["ok"]  # one run failed: the merged report must not say ok
    return obs


def _oom_in_worker(tmp: Path) -> Observation:
    """A worker that allocates until the kernel kills it, in a memory cgroup limited to 1 GiB."""
    group = CGROUP_ROOT / f"mha-h13-probe-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(1024 * 2**20))
    except OSError as exc:
        return Observation(None, skipped=f"cannot make a memory cgroup ({exc.strerror}): needs root and cgroup v1 "
                                         "memory at /sys/fs/cgroup/memory")
    try:
        ran = run_cli(tmp, "check", "--backend-spec", "h13plug:HogInWorker", "--case", FAST_CASE, "--results",
                      "results", "--timeout", "120", cgroup=group)
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    doc, md = report_of(tmp)
    return ran.observe(["killed: out of memory (signal 9)"], extra=json.dumps(doc))


def _determinism(tmp: Path) -> Observation:
    return check_probe("h13plug:DriftsFromThirdCall", ["determinism: call"],
                       case="check_repeated_calls_are_bitwise_identical").run(tmp)


def _forged_markdown(tmp: Path) -> Observation:
    ran = run_cli(tmp, "check", "--backend-spec", "h13plug:ForgedMarkdown", "--case", FAST_CASE, "--results",
                  "results")
    doc, md = report_of(tmp)
    obs = ran.observe(["RuntimeError"], extra=md)
    headings = [line for line in md.splitlines() if line.startswith("#")]
    outside_code = re.sub(r"(`+).*?\1", "", md)  # inside a code span, <img> is shown, not rendered
    forged = [h for h in headings if "Mutation score" in h] + [t for t in ("<img", "<script") if t in outside_code]
    if forged or not md:
        obs.silent, obs.note = True, f"forged in conformance.md: {forged or 'no report'}"
    return obs


def _file_modes(tmp: Path) -> Observation:
    ran = run_cli(tmp, "check", "--backend", "numpy-naive", "--case", FAST_CASE, "--results", "results")
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp / "results" / "conformance").iterdir()
             if p.is_file() and not p.name.startswith(".")}
    obs = ran.observe(refuse=False, note=f"modes {modes} (umask 022)")
    obs.silent = any(m != "0o644" for m in modes.values()) or not modes
    return obs


def _jax_cache_modes(tmp: Path) -> Observation:
    """configure_jax(): a fresh cache folder is 0700; a group/world-writable one is refused with a warning."""
    script = ("import os, stat, warnings, sys; warnings.simplefilter('always');"
              "import mha_harness; mha_harness.configure_jax(); import jax;"
              "print(oct(stat.S_IMODE(os.stat(sys.argv[1]).st_mode)), jax.config.jax_compilation_cache_dir)")
    fresh, shared = tmp / "fresh" / "jax", tmp / "shared-jax"
    shared.mkdir()
    shared.chmod(0o777)
    outs = []
    for folder in (fresh, shared):
        proc = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True,
                              env={**os.environ, "MHA_HARNESS_JAX_CACHE": str(folder)}, timeout=300)
        outs.append(proc)
    text = "".join(p.stdout + p.stderr for p in outs)
    ok = (outs[0].stdout.startswith("0o700") and str(fresh) in outs[0].stdout and "can be written by other users"
          in outs[1].stderr and str(shared) not in outs[1].stdout.split(" ", 1)[-1])
    return Observation(max(p.returncode for p in outs), TRACEBACK in text, silent=not ok,
                       note=" | ".join(p.stdout.strip() for p in outs))


def _child_probe(spec: str) -> Callable[[Path], Observation]:
    """A plugin that starts a child holding stdout (10 minutes): the run must end and leave no process."""
    def run(tmp: Path) -> Observation:
        ran = run_cli(tmp, "check", "--backend-spec", spec, "--case", FAST_CASE, "--results", "results",
                      timeout=240)
        return ran.observe(refuse=False)
    return run


def _list_entry_points(tmp: Path) -> Observation:
    ran = run_cli(tmp, "list", entry_points=True, timeout=240)
    return ran.observe(["import raised SystemExit: 0", "import raised KeyboardInterrupt", "import timed out after 4 s",
                        "numpy-naive"], refuse=False)


def _bench(spec: str, words, *, extra=()) -> Callable[[Path], Observation]:
    def run(tmp: Path) -> Observation:
        ran = run_cli(tmp, "bench", "--backend-spec", spec, "--backend", "numpy-naive", "--seq-lens", "32,64",
                      "--budget", "0.2", "--bench-timeout", "8", "--results", "results", *extra, timeout=300)
        return ran.observe(words)
    return run


def _run_command(tmp: Path) -> Observation:
    ran = run_cli(tmp, "run", "--backend-spec", "h13plug:CrashesInWorker", "--seq-lens", "32", "--budget", "0.2",
                  "--timeout", "20", "--results", "results", timeout=600)
    return ran.observe(["crashed", "conformance FAILED"])


def _api(call: Callable[[], object], words, *, accept: bool = False) -> Callable[[Path], Observation]:
    """A public API call: refused with ValueError/TypeError naming ``words`` (2), or accepted (0) when ``accept``."""
    def run(tmp: Path) -> Observation:
        try:
            value = call()
        except (ValueError, TypeError) as exc:
            text = f"{type(exc).__name__}: {exc}"
            missing = [w for w in words if w not in text]
            return Observation(2, silent=bool(missing), note=text[:200] + (f"; missing {missing}" if missing else ""))
        except Exception as exc:  # noqa: BLE001 - an internal error is what the probe looks for
            return Observation(1, traceback=True, note=f"{type(exc).__name__}: {exc}"[:200])
        return Observation(0, silent=not accept, note=f"accepted: {str(value)[:120]}")
    return run


def _layer(name="numpy-naive"):
    import mha_harness
    config = mha_harness.AttentionConfig(32, 4)
    params = mha_harness.make_params(config)
    backend = mha_harness.load_registry(entry_points=False).get(name).backend
    return config, backend.load(params, dtype="float64")


def _nonfinite_visible():
    import numpy as np

    import mha_harness
    config, loaded = _layer()
    inputs = mha_harness.make_inputs(config, 1, 8, 8, self_attention=False, causal="top-left")
    inputs.key[0, 0, 0] = np.nan  # key 0: every query sees it
    return loaded.forward(inputs).output


def _nonfinite_visible_mask():
    import numpy as np

    import mha_harness
    config, loaded = _layer()
    inputs = mha_harness.make_inputs(config, 1, 8, 8, self_attention=False)
    inputs.attn_mask = np.ones((8, 8), dtype=bool)
    inputs.value[0, 3, 1] = np.inf
    return loaded.forward(inputs).output


def _nonfinite_hidden():
    import numpy as np

    import mha_harness
    config, loaded = _layer()
    inputs = mha_harness.make_inputs(config, 1, 8, 8, self_attention=False)
    inputs.key_padding_mask = np.zeros((1, 8), dtype=bool)
    inputs.key_padding_mask[0, 5] = True  # key 5 hidden from every query
    inputs.key[0, 5], inputs.value[0, 5] = np.nan, np.inf
    out = loaded.forward(inputs).output
    if not np.isfinite(out).all():
        raise RuntimeError("hidden poison reached the output")
    return "finite output"


def _vjp(cotangent_of):
    def call():
        import mha_harness
        config, loaded = _layer("torch-eager")
        inputs = mha_harness.make_inputs(config, 1, 8, 8, self_attention=False)
        return loaded.vjp(inputs, cotangent_of(inputs))
    return call


def _cotangent_nan(inputs):
    import numpy as np
    c = np.ones_like(inputs.query)
    c[0, 1, 2] = np.nan
    return c


def _params_dict():
    import numpy as np

    import mha_harness
    w = np.eye(4)
    return mha_harness.AttentionParams({"d_model": 4, "num_heads": 2}, w, w, w, w)


def _repro_misspelt():
    import mha_harness
    return mha_harness.repro("numpy-naive", "check_scores_scaled_by_sqrt_dhead")


def _check_42():
    import mha_harness
    return mha_harness.check(42)


def probes() -> list[Probe]:
    exit_bullet = "sys.exit(0) / KeyboardInterrupt"
    out = [
        check_probe("h13plug:ExitInWorker", ["SystemExit"], bullet=exit_bullet),
        check_probe("h13import_exit:Backend", ["import raised SystemExit: 0"], bullet=exit_bullet),
        check_probe("sys:exit", ["SystemExit"], bullet=exit_bullet),
        check_probe("h13plug:InterruptInWorker", ["KeyboardInterrupt"], bullet=exit_bullet),
        check_probe("h13import_interrupt:Backend", ["KeyboardInterrupt"], bullet=exit_bullet),
        Probe("check --backend <entry point whose import calls sys.exit(0)>", exit_bullet, (1,),
              lambda tmp: run_cli(tmp, "check", "--backend", "h13import_exit:Backend", "--case", FAST_CASE,
                                  "--results", "results", entry_points=True, timeout=240).observe(["SystemExit"])),
        Probe("check --backend <entry point sys:exit>", exit_bullet, (1,),
              lambda tmp: run_cli(tmp, "check", "--backend", "sys:exit", "--case", FAST_CASE,
                                  "--results", "results", entry_points=True, timeout=240).observe(["SystemExit"])),
        Probe("list with hostile entry points (exit, interrupt, hang at import)", "plugin timeout", (0,),
              _list_entry_points),
        check_probe("h13import_hang:Backend", ["import timed out after 4 s"], bullet="plugin timeout"),
        Probe("list --backend-spec <hanging import>", "plugin timeout", (0,),
              lambda tmp: run_cli(tmp, "list", "--backend-spec", "h13import_hang:Backend")
              .observe(["import timed out after 4 s"], refuse=False)),
        check_probe("tests.hostile_loading:HangsInAvailability", ["availability() timed out after 4 s"],
                    bullet="plugin timeout"),
        Probe("check <correct plugin, 6 s import> --timeout 5", "import not charged to a case", (0,), _slow_import),
        check_probe("h13plug:HangsInWorker", ["timeout"], bullet="hang in the worker"),
        check_probe("h13plug:CrashesInWorker", ["exit code 3"], bullet="crash in the worker"),
        Probe("check <plugin child holding stdout, started in the worker>", "orphans", (0,),
              _child_probe("h13plug:ChildInWorker")),
        Probe("check <plugin child holding stdout, started at import in the harness>", "orphans", (0,),
              _child_probe("h13import_child:Backend")),
        Probe("check <plugin child holding stdout, started by availability()>", "orphans", (0,),
              _child_probe("h13plug:ChildInAvailability")),
        Probe("check <memory hog in the worker, 1 GiB memory cgroup>", "out of memory", (1,), _oom_in_worker),
        Probe("two concurrent check runs into one --results", "concurrent writers", (1,), _concurrent_writers),
        Probe("check <backend drifting from its 3rd call>", "determinism", (1,), _determinism),
        Probe("check <markdown and HTML forged in name and message>", "reports", (1,), _forged_markdown),
        Probe("check: results file modes", "reports", (0,), _file_modes),
        Probe("configure_jax(): cache folder modes", "JAX cache", (0,), _jax_cache_modes),
        Probe("bench <plugin hanging in its worker>", "bench", (1,), _bench("h13plug:HangsInWorker", ["timeout"])),
        Probe("bench <plugin crashing in its worker>", "bench", (1,),
              _bench("h13plug:CrashesInWorker", ["code 3"])),
        Probe("bench <plugin calling sys.exit(0) in its worker>", "bench", (1,),
              _bench("h13plug:ExitInWorker", ["SystemExit"])),
        Probe("bench <plugin hogging memory, --max-memory 300>", "bench", (1,),
              _bench("h13plug:HogInWorker", ["memory"], extra=("--max-memory", "300"))),
        Probe("bench --backend-spec sys:exit", "bench", (1,), _bench("sys:exit", ["SystemExit"])),
        Probe("bench <hanging import>", "bench", (1,), _bench("h13import_hang:Backend", ["timed out"])),
        Probe("run <plugin crashing in its worker>", "run", (1,), _run_command),
        Probe("API: NaN key visible to every query (causal)", "validation", (2,), _api(_nonfinite_visible, ["key"])),
        Probe("API: inf value visible (attn_mask all true)", "validation", (2,),
              _api(_nonfinite_visible_mask, ["value"])),
        Probe("API: NaN/inf only at a key every query's mask hides", "validation", (0,),
              _api(_nonfinite_hidden, [], accept=True)),
        Probe("API: vjp cotangent of the wrong shape", "validation", (2,),
              _api(_vjp(lambda i: i.query[:, :-1]), ["cotangent"])),
        Probe("API: vjp cotangent with NaN", "validation", (2,), _api(_vjp(_cotangent_nan), ["cotangent"])),
        Probe("API: AttentionParams(config=dict)", "validation", (2,), _api(_params_dict, ["config"])),
        Probe("API: repro with a misspelt case", "validation", (2,), _api(_repro_misspelt, ["case", "did you mean"])),
        Probe("API: check(42)", "validation", (2,), _api(_check_42, ["backends", "42"])),
    ]
    for args, words in [
        (("bench", "--backend", "numpy-naive", "--seq-lens", "1000000000"), ["--seq-lens"]),
        (("run", "--seq-lens", "1000000000"), ["--seq-lens"]),
        (("fidelity", "--repeats", "0"), ["--repeats"]),
        (("bench", "--repeats", "0"), ["--repeats"]),
        (("bench", "--repeats", "-1"), ["--repeats"]),
        (("check", "--timeout", "0"), ["--timeout"]),
        (("check", "--timeout", "nan"), ["--timeout"]),
        (("check", "--timeout", "-1"), ["--timeout"]),
        (("run", "--timeout", "nan"), ["--timeout"]),
        (("search", "--timeout", "-1"), ["--timeout"]),
        (("check", "--jobs", "0"), ["--jobs"]),
        (("check", "--jobs", "-3"), ["--jobs"]),
        (("run", "--jobs", "0"), ["--jobs"]),
        (("check", "--results", ""), ["--results"]),
        (("bench", "--results", ""), ["--results"]),
        (("run", "--results", ""), ["--results"]),
        (("search", "--results", ""), ["--results"]),
        (("fidelity", "--results", ""), ["--results"]),
        (("bench", "--budget", "0"), ["--budget"]),
        (("bench", "--bench-timeout", "nan"), ["--bench-timeout"]),
        (("bench", "--max-memory", "0"), ["--max-memory"]),
        (("bench", "--d-model", "0"), ["--d-model"]),
        (("bench", "--d-model", "30", "--heads", "4"), ["--d-model"]),
        (("search", "--max-examples", "0"), ["--max-examples"]),
        (("search", "--time-budget", "nan"), ["--time-budget"]),
        (("check", "--backend-spec", "not a spec"), ["backend spec"]),
        (("check", "--case", "check_nothing"), ["case"]),
    ]:
        out.append(usage_probe(*args, words=words))
    return out


def run_probes(selected: list[Probe], jobs: int = 3, base: Path | None = None) -> dict[str, Observation]:
    base = Path(tempfile.mkdtemp(prefix="mha-h13-probes-", dir=base))
    old = os.umask(0o022)

    def one(index_probe):
        index, probe = index_probe
        tmp = base / f"p{index:02d}"
        tmp.mkdir()
        start = time.monotonic()
        try:
            obs = probe.run(tmp)
        except Exception as exc:  # noqa: BLE001 - the probe itself broke: shown in the table
            obs = Observation(None, note=f"PROBE ERROR {type(exc).__name__}: {exc}"[:300])
            obs.silent = True
        obs.seconds = obs.seconds or time.monotonic() - start
        return probe.name, obs
    try:
        with ThreadPoolExecutor(jobs) as pool:
            return dict(pool.map(one, enumerate(selected)))
    finally:
        os.umask(old)


def table(selected: list[Probe], observed: dict[str, Observation]) -> str:
    lines = ["| probe | expected exit | exit | traceback | silent accept | lost | orphans | verdict | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for probe in selected:
        o = observed[probe.name]
        problems = probe.verdict(o)
        verdict = f"skipped: {o.skipped}" if o.skipped else ("OK" if not problems else "FAIL: " + ", ".join(problems))
        cells = [probe.name, "/".join(map(str, probe.expected)), str(o.exit_code), "yes" if o.traceback else "no",
                 "yes" if o.silent else "no", ",".join(o.lost) or "-", "; ".join(o.orphans) or "-", verdict,
                 o.note.replace("\n", " ")[:180]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("only", nargs="*", help="run the probes whose name contains one of these")
    args = parser.parse_args(argv)
    selected = [p for p in probes() if not args.only or any(s in p.name for s in args.only)]
    observed = run_probes(selected, args.jobs)
    print(table(selected, observed))
    failing = [p.name for p in selected if p.verdict(observed[p.name])]
    print(f"\n{len(selected) - len(failing)}/{len(selected)} probes hold")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
