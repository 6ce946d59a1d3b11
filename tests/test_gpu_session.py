"""benchmarks/gpu_session.sh on CPU (--dry-run): every GPU backend name resolves and is refused cleanly, the GPU steps
run on CPU stand-ins, each step's exit code and duration land in summary.tsv, the deadline skips what cannot
fit, and the results come back as one tarball plus the summary, the shape the device tool returns.

The default tests run a few steps (the suite stays fast); MHA_GPU_SESSION_FULL=1 also runs the whole dry run.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
ALL_STEPS = ("env", "install-wheels", "install-self", "list", "gpu-names-refused", "check", "prefill-torch",
             "prefill-jax", "prefill-causal", "decode", "asv")


def session(tmp_path, *args, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    out = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=timeout)
    return out


def summary(path) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    with open(path) as handle:
        for row in csv.DictReader(handle, delimiter="\t"):
            rows.setdefault(row["step"], []).append(row)
    return rows


def status(rows, step) -> str:
    return [r["status"] for r in rows[step] if r["status"] != "note"][0]


@pytest.mark.parametrize("args, message", [(["--bogus"], "unknown argument --bogus"),
                                           (["--budget", "soon"], "--budget: got 'soon'")])
def test_bad_arguments_exit_2_naming_the_accepted_values(tmp_path, args, message):
    out = session(tmp_path, *args, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "accepted" in out.stderr


def test_dry_run_refuses_gpu_names_runs_decode_and_asv_and_packs_one_tarball(tmp_path):
    res = tmp_path / "res"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = session(tmp_path, "--dry-run", "--out", str(res), "--budget", "400", "--commit", commit,
                  "--steps", "gpu-names-refused,decode,asv")
    rows = summary(res / "summary.tsv")
    assert out.returncode == 0, out.stdout + out.stderr + (res / "session.log").read_text()
    for step in ALL_STEPS:
        assert step in rows, step  # every step is accounted for, run or not
    for step in ("gpu-names-refused", "decode", "asv"):
        assert status(rows, step) == "ok", (step, rows[step])
    assert status(rows, "check") == "skipped" and rows["total"][0]["status"] == "ok"
    # every registered GPU backend was named and refused with the CLI's own reason
    refused = next(res.glob("logs/*-gpu-names-refused.log")).read_text()
    for name in ("torch-sdpa-flash-cuda", "jax-dpa-cudnn-gpu", "flax-mha-gpu"):
        assert name in (res / "gpu_backends.tsv").read_text()
    assert "UNEXPECTED" not in refused and refused.count("ok (exit 2)") >= 10
    decode = json.loads((res / "decode" / "bench-decode" / "bench.json").read_text())
    assert decode["complete"]
    timed = [p for p in decode["points"] if p.get("median_s")]
    assert {p["tq"] for p in timed} == {1, 4} and {p["tk"] for p in timed} == {64}
    assert {"torch-sdpa-math-cpu", "jax-explicit"} <= {p["backend"] for p in timed}
    machine = res / "asv" / "h200-gpu"
    assert (machine / "machine.json").exists()
    # recorded against a throwaway repository (the device has no .git), then renamed to --commit
    [result] = [p for p in machine.glob("*.json") if p.name != "machine.json"]
    assert result.name.startswith(commit[:8]) and json.loads(result.read_text())["commit_hash"] == commit
    # what comes back from the device: a tarball of everything and the summary beside it
    assert (tmp_path / "out" / "gpu_summary.tsv").read_text() == (res / "summary.tsv").read_text()
    with tarfile.open(tmp_path / "out" / "gpu_results.tar.gz") as tar:
        names = tar.getnames()
    assert "res/summary.tsv" in names and "res/decode/bench-decode/bench.json" in names
    assert any(n.startswith("res/asv/h200-gpu/") for n in names)
    assert not (ROOT / "results" / "asv" / "h200-gpu").exists()  # a dry run never writes into results/


def test_deadline_skips_steps_that_cannot_fit(tmp_path):
    res = tmp_path / "res"
    out = session(tmp_path, "--dry-run", "--out", str(res), "--budget", "10", "--steps", "env,list", timeout=120)
    rows = summary(res / "summary.tsv")
    assert rows["env"][0]["status"] == "skipped" and "no time left" in rows["env"][0]["note"], out.stdout
    assert rows["list"][0]["status"] == "skipped"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MHA_GPU_SESSION_FULL"), reason="the whole dry run takes minutes on 2 cores; "
                    "set MHA_GPU_SESSION_FULL=1")
def test_whole_dry_run_every_step_ok(tmp_path):
    res = tmp_path / "res"
    out = session(tmp_path, "--dry-run", "--out", str(res), "--budget", "900", timeout=1000)
    rows = summary(res / "summary.tsv")
    assert out.returncode == 0, (res / "session.log").read_text()
    for step in ALL_STEPS:
        assert status(rows, step) == "ok", (step, rows[step])
    assert (res / "conformance" / "conformance.json").exists()
    for folder in ("prefill-torch", "prefill-jax", "prefill-causal"):
        assert json.loads((res / folder / "bench" / "bench.json").read_text())["complete"]


def test_jax_layers_on_gpu_run_float32_at_highest_matmul_precision():
    """XLA may compute float32 GPU products in TF32; the harness's float32 means float32 (half precision untouched)."""
    jax = pytest.importorskip("jax")
    from types import SimpleNamespace as NS

    from mha_harness.implementations._jax_common import JaxLoaded
    for device, dtype, expected in (("gpu", "float32", "highest"), ("gpu", "bfloat16", None),
                                    ("cpu", "float32", None)):
        with JaxLoaded.precision(NS(backend=NS(device=device), dtype_name=dtype, jax=jax)):
            assert jax.config.jax_default_matmul_precision == expected, (device, dtype)
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
