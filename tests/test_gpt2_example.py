"""examples/gpt2_plugin: the worked torch example of docs/plugins.md is the file, it passes the suite, and the
one-word bug a stranger made in it (triu for tril) fails with the diagnosis the docs quote."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mha_harness
from tests.example_modules import module_from_file, shown_in_plugins_docs

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt2_plugin" / "gpt2_attention" / "__init__.py"


def test_the_docs_show_the_example_file_verbatim():
    assert shown_in_plugins_docs("gpt2-example") == EXAMPLE.read_text()


def test_the_gpt2_module_passes_every_case_it_declares():
    backend = module_from_file(EXAMPLE, "gpt2_attention").GPT2Attention()
    report = mha_harness.check(backend, include_slow=False, isolate=False)
    assert report.ok, "\n".join(report.summary_lines())
    statuses = [r.status.value for r in report.results]
    assert statuses.count("passed") >= 29 and "error" not in statuses
    assert {r.case for r in report.results if r.status.value == "passed"} >= {
        "check_gradients_match_reference", "check_parameter_count_is_4_d_model_squared",
        "check_causal_mask_blocks_future_keys", "check_output_matches_reference"}


def test_the_gpt2_module_with_triu_for_tril_fails_naming_the_reversed_mask(tmp_path):
    broken = tmp_path / "gpt2_triu.py"
    broken.write_text(EXAMPLE.read_text().replace("torch.tril(", "torch.triu("))
    report = mha_harness.check(module_from_file(broken, "gpt2_triu").GPT2Attention(), include_slow=False, isolate=False)
    failed = {r.case: r.message for r in report.results if r.status.value == "failed"}
    assert "a reversed causal mask: query i sees key i and every later key" in \
        failed["check_causal_output_matches_reference"]
    assert "top-left causal leak" in failed["check_causal_mask_blocks_future_keys"]


def test_the_gpt2_module_is_benchmarked_at_causal_on(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mha_harness", "bench", "--backend-spec",
                           "gpt2_attention:GPT2Attention", "--causal", "on", "--seq-lens", "32", "--budget", "0.2",
                           "--results", str(tmp_path)], cwd=EXAMPLE.parents[1], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpt2-attention" in done.stdout


def test_the_gpt2_training_step_is_checked_by_its_gradients_at_every_call():
    """The example's forward + backward call zeroes the gradients before each backward and returns x, whose .grad
    and the parameters' native_gradients reads: bench's check compares them with the reference's, and a second
    call's are the same (not accumulated)."""
    from mha_harness.bench.calls import prepare_point
    from mha_harness.bench.metrics import Shape
    from mha_harness.bench.verify import check_point
    backend = module_from_file(EXAMPLE, "gpt2_attention").GPT2Attention()
    shape = Shape(1, 32, 32, 64, 4, "float32", True, True)
    point = prepare_point(backend, shape)
    first = check_point(backend, shape, point.checked_values(point.fn()))
    again = check_point(backend, shape, point.checked_values(point.fn()))
    assert first["rows"] == 16 and set(first["gradients"]) == {"query", "W_q", "W_k", "W_v", "W_o"}
    assert again["max_error"] == first["max_error"] <= first["bound"]
