"""asv: offline recording in the current environment, two machines merged into one published dashboard."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("asv")


def asv_config(tmp_path):
    """The project's asv.conf.json, with results and html redirected into ``tmp_path``."""
    text = (ROOT / "asv.conf.json").read_text()
    text = text.replace('"results/asv"', json.dumps(str(tmp_path / "asv"))).replace(
        '"results/html"', json.dumps(str(tmp_path / "html")))
    text = text.replace('"benchmark_dir": "benchmarks"', f'"benchmark_dir": {json.dumps(str(ROOT / "benchmarks"))}')
    text = text.replace('"repo": "."', f'"repo": {json.dumps(str(ROOT))}')
    path = tmp_path / "asv.conf.json"
    path.write_text(text)
    return path


def run_asv(config, *args, env=None):
    """Run asv with HOME pointing next to the config, so the user's ~/.asv-machine.json is never touched."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    extra = ["--set-commit-hash", commit] if args and args[0] == "run" else []
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(config.parent), **(env or {})}
    for machine in re.findall(r"--machine (\S+)", " ".join(args)):
        subprocess.run([sys.executable, "-m", "asv", "machine", "--yes", "--machine", machine,
                        "--config", str(config)], cwd=ROOT, capture_output=True, text=True, env=full_env)
    return subprocess.run([sys.executable, "-m", "asv", args[0], "--config", str(config), *extra, *args[1:]],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=full_env)


def test_two_machines_merge_into_one_dashboard(tmp_path):
    config = asv_config(tmp_path)
    env = {"MHA_ASV_BACKENDS": "numpy-naive", "MHA_ASV_SEQ_LENS": "64", "MHA_ASV_DECODE_KV_LENS": "64",
           "MHA_ASV_CROSS_KV_LENS": "64"}
    # every benchmark on the first machine; the second needs only one to prove the dashboard merges machines
    for machine, only in (("cpu-box", []), ("gpu-box", ["--bench", "bench_environment"])):
        out = run_asv(config, "run", "--python=same", "--quick", "--machine", machine, *only, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert (tmp_path / "asv" / machine / "machine.json").exists()
    out = run_asv(config, "publish", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    index = json.loads((tmp_path / "html" / "index.json").read_text())
    assert {"cpu-box", "gpu-box"} <= set(index["params"]["machine"])
    names = set(index["benchmarks"])
    for name in ("bench_time.TimeForward.time_forward", "bench_time.TimeForwardBackward.time_forward_backward",
                 "bench_memory.PeakMemory.track_peak_extra_memory", "bench_throughput.Throughput.track_gflops",
                 "bench_throughput.Throughput.track_fraction_of_gemm_peak", "bench_decode.Decode.time_decode",
                 "bench_decode.DecodeBandwidth.track_gbytes_per_s",
                 "bench_decode.DecodeBandwidth.track_fraction_of_memory_bandwidth",
                 "bench_cross.Cross.time_cross", "bench_cross.CrossPeakMemory.track_cross_peak_extra_memory",
                 "bench_environment.ThreadSettings.track_threads"):
        assert name in names
    assert index["benchmarks"]["bench_memory.PeakMemory.track_peak_extra_memory"]["unit"] == "bytes"
    threads = index["benchmarks"]["bench_environment.ThreadSettings.track_threads"]
    assert "openblas" in threads["params"][0][0]  # the BLAS library and kernel are recorded with the results
    # the dashboard must work offline: every CDN asset is served from results/html/vendor
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "asv_offline.py"), str(tmp_path / "html")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "html" / "index.html").read_text()
    assert "https://cdn" not in page and "integrity=" not in page
    assert (tmp_path / "html" / "vendor" / "jquery.min.js").exists()


def test_benchmark_files_import_without_any_backend_available(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MHA_ASV_BACKENDS": "does-not-exist"}
    code = "import benchmarks.bench_time, benchmarks.bench_memory, benchmarks.bench_throughput\n" \
           "import benchmarks.bench_decode, benchmarks.bench_environment, benchmarks.bench_layer_features\n" \
           "import benchmarks.bench_cross\n" \
           "from benchmarks._common import prepared\n" \
           "try:\n    prepared('does-not-exist', 64, False)\nexcept NotImplementedError as e:\n    print('skip:', e)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "skip: backend: got 'does-not-exist'" in out.stdout, out.stderr


def test_the_feature_benchmarks_time_the_layer_with_its_features_and_skip_a_backend_without_them():
    """bench_layer_features.py's setups build the windowed and the Llama layer as `bench` does (checked against the
    reference with the features), and skip a backend that does not declare the feature, naming the capability. In
    a process of its own, as asv runs it (the benchmarks' import sets the thread count and CPU affinity)."""
    code = """if True:
        from benchmarks import bench_layer_features as features
        window = features.SlidingWindow()
        window.setup("numpy-tiled", 64)
        assert window.shape.sliding_window == features.WINDOW and window.shape.causal
        decode = features.SlidingWindowDecode()
        decode.setup("numpy-tiled", 64)
        assert decode.shape.cached and decode.shape.tq == 1 and decode.shape.sliding_window == features.DECODE_WINDOW
        llama = features.LlamaLayer()
        llama.setup("numpy-naive", 64)
        assert (llama.shape.rotary, llama.shape.kv_heads) == ("half_split", 2)
        try:
            llama.setup("numpy-tiled", 64)
        except NotImplementedError as exc:
            print("skip:", exc)
        bloom = features.BloomLayer()
        bloom.setup("numpy-naive", 64)
        assert bloom.shape.alibi == "linear" and bloom.shape.causal and not bloom.shape.cached
        bloom_decode = features.BloomDecode()
        bloom_decode.setup("numpy-naive", 64)
        assert bloom_decode.shape.cached and bloom_decode.shape.tq == 1 and bloom_decode.shape.alibi == "linear"
        bloom_decode.time_bloom_decode("numpy-naive", 64)
        try:
            bloom.setup("numpy-tiled", 64)
        except NotImplementedError as exc:
            print("skip:", exc)
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MHA_ASV_BACKENDS": "numpy-naive,numpy-tiled"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "skip: no half_split rotary embeddings (capabilities.rotary declares: none)" in out.stdout, out.stdout
    assert "skip: no linear ALiBi" in out.stdout, out.stdout


def test_only_the_memory_benchmark_pins_the_mmap_threshold_its_timings_run_with_glibcs_default(tmp_path):
    """A pinned mmap threshold makes every large buffer fresh pages: a stranger's decode step that grows its KV cache
    with a concat timed 3.2-3.8x slower in asv than in `mha-harness bench`, whose timing workers keep glibc's
    default. asv runs each benchmark in its own process; only the peak-memory one pins."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MHA_ASV_BACKENDS": "numpy-naive"}
    code = ("import mha_harness.bench.memory as memory\n"
            "pinned = []\n"
            "memory.pin_mmap_threshold = lambda *a: pinned.append(1) or True\n"
            "from benchmarks import bench_time, bench_decode, bench_throughput, bench_memory, bench_cross\n"
            "for name, bench, args in [('time', bench_time.TimeForward(), ('numpy-naive', 64, False)),\n"
            "                          ('decode', bench_decode.Decode(), ('numpy-naive', 1, 64)),\n"
            "                          ('cross', bench_cross.Cross(), ('numpy-naive', 128, 64)),\n"
            "                          ('cross memory', bench_cross.CrossPeakMemory(), ('numpy-naive', 128, 64)),\n"
            "                          ('throughput', bench_throughput.Throughput(), ('numpy-naive', 64, False)),\n"
            "                          ('memory', bench_memory.PeakMemory(), ('numpy-naive', 64, False))]:\n"
            "    pinned.clear(); bench.setup(*args); print(name, bool(pinned))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:6] == ["time False", "decode False", "cross False", "cross memory True",
                                          "throughput False", "memory True"], out.stdout


PLUGIN = '''
from mha_harness.implementations.numpy_naive import NumpyNaive


class MyAttention(NumpyNaive):
    name = "my-asv-attention"
'''


def test_a_plugin_given_as_a_spec_is_benchmarked_without_installing_it(tmp_path):
    """A plugin that is only a module in a folder of the user's (no entry point) reaches asv through
    MHA_ASV_BACKEND_SPECS and ASV_PYTHONPATH (asv drops PYTHONPATH from its benchmark processes); a spec that does
    not import is a row whose setup skips with the import error, not a failed run."""
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    (plugin_dir / "my_asv_attn.py").write_text(PLUGIN)
    config = asv_config(tmp_path)
    env = {"MHA_ASV_BACKEND_SPECS": "my_asv_attn:MyAttention,no_such_module:thing", "ASV_PYTHONPATH":
           str(plugin_dir), "MHA_ASV_SEQ_LENS": "64"}
    out = run_asv(config, "run", "--python=same", "--quick", "--show-stderr", "--machine", "cpu-box",
                  "--bench", "bench_time.TimeForward.time_forward", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "No module named 'no_such_module'" in out.stdout + out.stderr
    [result_file] = [p for p in (tmp_path / "asv" / "cpu-box").glob("*.json") if p.name != "machine.json"]
    doc = json.loads(result_file.read_text())
    entry = doc["results"]["bench_time.TimeForward.time_forward"]
    columns = doc["result_columns"]
    values, params = entry[columns.index("result")], entry[columns.index("params")]
    assert params[0] == ["'my-asv-attention'", "'no_such_module:thing'"]
    grid = dict(zip([(b, s, c) for b in params[0] for s in params[1] for c in params[2]], values))
    assert grid[("'my-asv-attention'", "64", "False")] > 0
    skipped = grid[("'no_such_module:thing'", "64", "False")]
    assert skipped is None or skipped != skipped  # asv's n/a: null, or NaN for a skip in setup


def _regenerate_asv(results, env, *extra):
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "regenerate_results.sh"), "--steps", "asv", "--results",
                           str(results), *extra], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env})


def test_the_regenerate_scripts_asv_step_keeps_the_lengths_the_user_set(tmp_path):
    """``regenerate_results.sh --steps asv`` set MHA_ASV_SEQ_LENS=256,1024 and MHA_ASV_DECODE_KV_LENS=1024,16384 over
    the user's own values; they are now only the defaults."""
    unset = {k: v for k, v in os.environ.items() if k not in ("MHA_ASV_SEQ_LENS", "MHA_ASV_DECODE_KV_LENS")}
    default = subprocess.run(["bash", str(ROOT / "benchmarks" / "regenerate_results.sh"), "--steps", "asv",
                              "--results", str(tmp_path), "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                             env=unset)
    assert "MHA_ASV_SEQ_LENS='256,1024' MHA_ASV_DECODE_KV_LENS='1024,16384'" in default.stdout, default.stdout
    mine = _regenerate_asv(tmp_path, {"MHA_ASV_SEQ_LENS": "64,128", "MHA_ASV_DECODE_KV_LENS": "512",
                                      "ASV_BENCH": "TimeForward.time_forward"}, "--dry-run")
    assert "MHA_ASV_SEQ_LENS='64,128' MHA_ASV_DECODE_KV_LENS='512'" in mine.stdout, mine.stdout
    assert "ASV_ARGS='--quick -b TimeForward.time_forward'" in mine.stdout, mine.stdout


def test_the_regenerate_scripts_asv_step_passes_extra_asv_arguments_such_as_show_stderr(tmp_path):
    """A stranger's plugin rows read n/a with no reason; asv's --show-stderr says why, and the script's asv step had
    no way to pass it."""
    out = _regenerate_asv(tmp_path, {"ASV_BENCH": "TimeForward.time_forward", "ASV_EXTRA_ARGS": "--show-stderr"},
                          "--dry-run")
    assert "ASV_ARGS='--quick -b TimeForward.time_forward --show-stderr'" in out.stdout, out.stdout


def test_the_regenerate_scripts_asv_step_records_asvs_own_samples_with_asv_sampling_repeats(tmp_path):
    """``--quick`` is one call per point; ``ASV_SAMPLING=repeats`` (what recorded this host's committed asv results)
    drops it for asv's own calibrated samples in one round, and a value it does not know is refused, naming the
    accepted ones, before anything runs."""
    out = _regenerate_asv(tmp_path, {"ASV_BENCH": "Decode.time_decode", "ASV_SAMPLING": "repeats"}, "--dry-run")
    assert "ASV_ARGS='-a rounds=1 -b Decode.time_decode'" in out.stdout, out.stdout
    bad = _regenerate_asv(tmp_path, {"ASV_SAMPLING": "many"}, "--dry-run")
    assert bad.returncode == 2
    assert "ASV_SAMPLING: got 'many'; accepted: quick, repeats" in bad.stderr, bad.stderr
    assert "== asv" not in bad.stdout


def test_the_readmes_plugin_route_into_asv_leaves_the_committed_results_alone(tmp_path):
    """The README's route for a plugin that is not installed (MHA_ASV_BACKEND_SPECS, ASV_PYTHONPATH) run with asv
    directly rewrote the committed results/asv/benchmarks.json with the plugin's backend alone; the documented route,
    ``regenerate_results.sh --steps asv --results DIR``, writes its own asv config, results and dashboard under DIR.
    Under the default machine name, this host's, with no ~/.asv-machine.json yet (an outside user's fresh machine:
    asv 0.6.6's `asv machine` dropped a name equal to its default and failed with KeyError: 'machine'), and with a
    ~/.asv-machine.json holding one other machine (another session's, on a shared account: asv's lookup gave the
    host's name that entry, and the results went under it, its RAM overwritten, while the script named this host)."""
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    (plugin_dir / "my_asv_attn.py").write_text(PLUGIN)
    committed = {p: p.read_bytes() for p in (ROOT / "results" / "asv").rglob("*") if p.is_file()}
    home = tmp_path / "home"  # asv machine writes ~/.asv-machine.json: not the user's
    home.mkdir()
    other = {"other-box": {"machine": "other-box", "ram": "1 kB", "arch": "x", "cpu": "x", "num_cpu": "1",
                           "os": "x"}, "version": 1}
    (home / ".asv-machine.json").write_text(json.dumps(other))
    out = _regenerate_asv(tmp_path / "out", {"HOME": str(home), "ASV_PYTHONPATH": str(plugin_dir),
                                             "MHA_ASV_BACKEND_SPECS": "my_asv_attn:MyAttention",
                                             "MHA_ASV_SEQ_LENS": "64", "ASV_BENCH": "TimeForward.time_forward"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert {p: p.read_bytes() for p in (ROOT / "results" / "asv").rglob("*") if p.is_file()} == committed
    benchmarks = json.loads((tmp_path / "out" / "asv" / "benchmarks.json").read_text())
    assert benchmarks["bench_time.TimeForward.time_forward"]["params"][:2] == [["'my-asv-attention'"], ["64"]]
    machine_dir = tmp_path / "out" / "asv" / socket.gethostname()
    [result_file] = [p for p in machine_dir.glob("*.json") if p.name != "machine.json"]
    doc = json.loads(result_file.read_text())
    entry = doc["results"]["bench_time.TimeForward.time_forward"]
    assert any(isinstance(v, float) and v > 0 for v in entry[doc["result_columns"].index("result")])
    assert (tmp_path / "out" / "html" / "index.html").exists()
    assert not (tmp_path / "out" / "asv" / "other-box").exists()
    assert json.loads((home / ".asv-machine.json").read_text())["other-box"] == other["other-box"]
    # asv keeps no load with its figures: the run prints it before and after (an outside user's asv figures beside
    # another session's runs were up to 35x bench's, with nothing to say so)
    assert "load average" in out.stdout and "before asv run" in out.stdout and "after asv run" in out.stdout


def _script(name, *args, env=None, cwd=ROOT, timeout=60):
    return subprocess.run(["bash", str(ROOT / "benchmarks" / name), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_asv_record_prints_its_usage_for_help_and_refuses_any_other_option_before_touching_the_machine_file(
        tmp_path):
    """`asv_record.sh --help` took '--help' for a machine name and wrote {"machine": "--help"} into
    ~/.asv-machine.json."""
    home = tmp_path / "home"
    home.mkdir()
    for flag in ("--help", "-h"):
        out = _script("asv_record.sh", flag, env={"HOME": str(home)})
        assert out.returncode == 0, out.stderr
        assert "benchmarks/asv_record.sh [MACHINE_NAME]" in out.stdout and "ASV_REPO=FOLDER" in out.stdout
    for bad in ("--machine", "-x", "--dry-run"):
        out = _script("asv_record.sh", bad, env={"HOME": str(home)})
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"unknown option '{bad}'; accepted: benchmarks/asv_record.sh [MACHINE_NAME]" in out.stderr, out.stderr
    out = _script("asv_record.sh", "box", "other", env={"HOME": str(home)})
    assert out.returncode == 2 and "got 2 arguments" in out.stderr, out.stderr
    assert not (home / ".asv-machine.json").exists()


def test_a_dry_run_of_the_regenerate_script_creates_nothing(tmp_path):
    """`regenerate_results.sh --dry-run --results DIR` created DIR (and, with no --results, a temporary folder)."""
    target = tmp_path / "new" / "results"
    out = _script("regenerate_results.sh", "--dry-run", "--results", str(target))
    assert out.returncode == 0, out.stderr
    assert f"writing under {target}" in out.stdout and "== asv:" in out.stdout
    assert not (tmp_path / "new").exists()
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = _script("regenerate_results.sh", "--dry-run", "--steps", "asv", env={"TMPDIR": str(temp)})
    assert out.returncode == 0 and f"writing under {temp}/mha-results." in out.stdout, out.stdout + out.stderr
    assert list(temp.iterdir()) == []
    # a relative --results is the caller's folder's, not the harness's
    out = _script("regenerate_results.sh", "--dry-run", "--steps", "asv", "--results", "out", cwd=tmp_path)
    assert f"writing under {tmp_path}/out " in out.stdout, out.stdout
    assert not (tmp_path / "out").exists()


PLUGIN_VERSION = '''
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

REPEATS = {repeats}


class MyLoaded(NumpyNaiveLoaded):
    def compute(self, inputs, *, need_weights=False):
        for _ in range(REPEATS):
            out = super().compute(inputs, need_weights=need_weights)
        return out


class MyAttention(NumpyNaive):
    name = "my-asv-attention"
    loaded_class = MyLoaded
'''

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": "/dev/null"}


def _git(repo, *args):
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                         env={**os.environ, **GIT_ENV})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _plugin_repo(path, repeats=1):
    path.mkdir()
    _git(path, "init", "-q", "-b", "main")
    (path / "my_asv_attn.py").write_text(PLUGIN_VERSION.format(repeats=repeats))
    _git(path, "add", "my_asv_attn.py")
    _git(path, "commit", "-q", "-m", "v1")
    return path


def test_asv_repo_refuses_a_folder_that_is_not_a_clean_git_repository_naming_the_variable(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    results = tmp_path / "results"
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(results), "--dry-run",
                  env={"ASV_REPO": str(plain)})
    assert out.returncode == 2 and "== asv" not in out.stdout
    assert f"ASV_REPO: got '{plain}', which is not a git repository; accepted: the folder of a git" in out.stderr
    repo = _plugin_repo(tmp_path / "plugin")
    (repo / "my_asv_attn.py").write_text(PLUGIN_VERSION.format(repeats=2))
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(results), "--dry-run",
                  env={"ASV_REPO": "plugin"}, cwd=tmp_path)  # relative: the caller's folder's
    assert out.returncode == 2 and "has uncommitted changes" in out.stderr and "M my_asv_attn.py" in out.stderr
    _git(repo, "checkout", "-q", "my_asv_attn.py")
    (repo / "helper.py").write_text("")
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(results), "--dry-run",
                  env={"ASV_REPO": str(repo)})
    assert out.returncode == 2 and "?? helper.py" in out.stderr, out.stderr
    (repo / "helper.py").unlink()
    # __pycache__ (importing the plugin writes it) and the results folder inside the repository do not count
    (repo / "__pycache__").mkdir()
    (repo / "__pycache__" / "my_asv_attn.cpython-312.pyc").write_bytes(b"")
    (repo / "asv-results").mkdir()
    (repo / "asv-results" / "regenerate.log").write_text("")
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", "asv-results", "--dry-run",
                  env={"ASV_REPO": "."}, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert f"ASV_REPO='{repo}' ASV_CONFIG='{repo}/asv-results/asv.conf.json'" in out.stdout, out.stdout
    shutil.rmtree(repo / "asv-results")  # for another results folder, it is an untracked file like any other
    _git(repo, "checkout", "-q", "--detach")
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(results), "--dry-run",
                  env={"ASV_REPO": str(repo)})
    assert out.returncode == 2 and "detached HEAD" in out.stderr and "set ASV_BRANCH" in out.stderr
    assert "containing it: main)" in out.stderr, out.stderr
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(results), "--dry-run",
                  env={"ASV_REPO": str(repo), "ASV_BRANCH": "main"})
    assert out.returncode == 0 and "ASV_BRANCH='main'" in out.stdout, out.stderr
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(ROOT / "results"), "--dry-run",
                  env={"ASV_REPO": str(repo), "ASV_BRANCH": "main"})
    assert out.returncode == 2 and "not the harness's results/" in out.stderr, out.stderr
    # asv_record.sh alone: ASV_REPO needs a config of its own, whose repo is that repository
    out = _script("asv_record.sh", "box", env={"ASV_REPO": str(repo), "ASV_BRANCH": "main",
                                                "HOME": str(tmp_path)})
    assert out.returncode == 2 and "ASV_REPO needs ASV_CONFIG" in out.stderr, out.stderr
    out = _script("asv_record.sh", "box", env={"ASV_REPO": str(repo), "ASV_BRANCH": "main", "HOME": str(tmp_path),
                                                "ASV_CONFIG": str(ROOT / "asv.conf.json")})
    assert out.returncode == 2 and f"accepted: \"repo\" '{repo}'" in out.stderr, out.stderr
    assert not results.exists() and not (tmp_path / ".asv-machine.json").exists()


def test_asv_repo_files_each_plugin_commit_under_its_own_hash_so_asv_compares_them(tmp_path):
    """An outside user's two versions of their plugin, recorded at one harness commit, went into one results file
    (the harness's hash): the second overwrote the first, and `asv compare` had no second revision. With ASV_REPO,
    each plugin commit is a results file of its own, drawn on the plugin's branch, and compared by its revisions;
    the harness's commit goes to harness-commits.tsv."""
    repo = _plugin_repo(tmp_path / "plugin")
    home = tmp_path / "home"
    home.mkdir()
    results = tmp_path / "results"
    env = {"HOME": str(home), "ASV_REPO": str(repo), "ASV_PYTHONPATH": str(repo),
           "MHA_ASV_BACKEND_SPECS": "my_asv_attn:MyAttention", "MHA_ASV_SEQ_LENS": "64", "MHA_ASV_THREADS": "1",
           "ASV_BENCH": r"^bench_time\.TimeForward\.time_forward\("}
    commits = []
    for repeats in (1, 2):
        if repeats == 2:
            (repo / "my_asv_attn.py").write_text(PLUGIN_VERSION.format(repeats=2))
            _git(repo, "commit", "-q", "-am", "v2")
        commits.append(_git(repo, "rev-parse", "HEAD"))
        out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(results), "--machine", "plugin-box",
                      env=env, cwd=repo, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"filing results under {repo}'s commit {commits[-1]} (branch main)" in out.stdout, out.stdout
    from asv.util import load_json
    config = load_json(str(results / "asv.conf.json"), js_comments=True)  # the project's, with its comments
    assert config["repo"] == str(repo) and config["branches"] == ["main"]
    files = sorted(p.name[:8] for p in (results / "asv" / "plugin-box").glob("*.json") if p.name != "machine.json")
    assert files == sorted(c[:8] for c in commits)
    harness = _git(ROOT, "rev-parse", "HEAD")
    rows = (results / "asv" / "harness-commits.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["date_utc", "machine", "plugin_repo", "branch", "plugin_commit", "harness_commit"]
    assert [r.split("\t")[4] for r in rows[1:]] == commits
    assert all(r.split("\t")[5].startswith(harness) for r in rows[1:])
    graphs = list((results / "html" / "graphs" / "branch-main").rglob("bench_time.TimeForward.time_forward.json"))
    assert len(graphs) == 1 and [point[0] for point in json.loads(graphs[0].read_text())] == [0, 1]  # revisions
    out = subprocess.run([sys.executable, "-m", "asv", "compare", "--config", str(results / "asv.conf.json"),
                          "--machine", "plugin-box", "HEAD~1", "HEAD"], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "HOME": str(home)})
    assert out.returncode == 0, out.stderr
    assert f"Before [{commits[0][:8]}]" in out.stdout and f"After [{commits[1][:8]}]" in out.stdout, out.stdout
    assert "time_forward('my-asv-attention', 64, False)" in out.stdout
    # one repository's commits per results folder: the same folder without ASV_REPO is refused, creating nothing
    out = _script("regenerate_results.sh", "--steps", "asv", "--results", str(results), "--dry-run",
                  env={"ASV_REPO": ""})
    assert out.returncode == 2 and f"filed under the commits of {repo}, not of {ROOT}" in out.stderr, out.stderr
