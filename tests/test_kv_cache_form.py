"""The KV-cache input form (``Capabilities(inputs="kv_cache")``): a decode step whose new queries' keys and values
are projected from x_new itself, checked against the reference with x_new equal to x_kv's last Tq rows; the bugs
such layers have are caught and named."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mha_harness
from mha_harness.bench.calls import backend_arguments
from mha_harness.bench.metrics import Shape
from tests.conftest import ROOT
from tests.kv_cache_objects import (
    CacheKVSwapped,
    KVCacheAttention,
    NewKeysFirst,
    OffsetForgotten,
    OneTokenSkipsItself,
    TorchGradientOfNewRowsAsQueriesOnly,
    TorchKVCacheAttention,
    TorchOneFutureKey,
)


def _results(report, status=None):
    return [r for r in report.results if status is None or r.status.value == status]


def test_a_kv_cache_layer_passes_with_cached_positions_and_new_ones_checked():
    """A correct KV-cache layer (NumPy) passes, and the cases did run it with something cached (Tq < Tk)."""
    report = mha_harness.check(KVCacheAttention())
    assert report.ok, report.summary_lines()
    ran = [r for r in _results(report, "passed") if r.params.get("tk", r.params.get("seq")) != r.params.get("seq")]
    assert ran, "no variant with Tq != Tk ran"
    names = {r.case for r in _results(report, "passed")}
    assert {"check_causal_mask_blocks_future_keys", "check_causal_output_matches_reference",
            "check_output_matches_reference", "check_padding_mask_output_matches_reference"} <= names
    # a call with more queries than keys skips with the form's reason, not as a capability left undeclared, in one
    # wording whichever part of the harness refused it (an outside user saw it with and without the backend's name)
    more = [r for r in _results(report, "skipped") if "cannot be expressed as a KV-cache step" in r.message]
    assert more and all(r.message.startswith("kv-cache-numpy declares inputs='kv_cache': Tq = ")
                        and r.message.endswith("(the new queries are the last Tq of the Tk positions)")
                        for r in more), [r.message for r in _results(report, "skipped")][:5]
    assert not any("does not declare capability 'more_queries_than_keys'" in r.message for r in _results(report))
    from mha_harness.contract.api import supported
    assert "cannot be expressed as a KV-cache step" in supported(KVCacheAttention(), {"more_queries_than_keys"})


def test_a_kv_cache_layers_gradients_are_d_x_new_and_d_x_cached():
    """With autograd (PyTorch): d/dx_new sums x_new's uses as queries, new keys and new values; d/dx_cached is the
    cached rows'. Both are checked, with Tq < Tk."""
    pytest.importorskip("torch")
    report = mha_harness.check(TorchKVCacheAttention())
    assert report.ok, report.summary_lines()
    grads = [r for r in _results(report, "passed") if r.case == "check_gradients_match_reference"]
    jacobian = [r for r in _results(report, "passed") if r.case == "check_causal_jacobian_zero_for_future_inputs"]
    assert grads and jacobian


@pytest.mark.parametrize("bug, failing, named", [
    (NewKeysFirst, "check_causal_output_matches_reference", "the output matches the new keys and values put before "
                                                            "the cached ones"),
    (OffsetForgotten, "check_causal_output_matches_reference", "the output matches top-left alignment instead of "
                                                               "bottom-right: query i sees keys 0..i, not keys 0..i + "
                                                               "Tk - Tq (tril(ones(Tq, Tk)) where tril(ones(Tq, Tk), "
                                                               "diagonal=Tk - Tq) belongs); in a KV-cache step the new "
                                                               "queries then miss the cached keys"),
    (CacheKVSwapped, "check_causal_output_matches_reference", "the output matches the cache's keys and values "
                                                              "swapped: the cached positions' keys read from the "
                                                              "value cache"),
    (OneTokenSkipsItself, "check_causal_output_matches_reference", "excludes the diagonal (query i cannot see its "
                                                                   "own key, key i + 64) (in a KV-cache step: one that "
                                                                   "attends to the cache before it writes"),
])
def test_kv_cache_bugs_are_caught(bug, failing, named):
    """The new keys put before the cached ones, the step's causal mask applied top-left (its offset forgotten),
    and one new token attending over the cache before its own key is appended (an eleventh stranger's bug, which
    passed every case before the one_new_token variant), each fail the causal output case, and each is named."""
    report = mha_harness.check(bug())
    assert not report.ok
    failed = [r for r in _results(report, "failed") if r.case == failing]
    assert failed, report.summary_lines()
    assert any(named in r.message for r in failed), [r.message for r in failed]


def test_kv_cache_padding_cases_pad_cached_rows_with_nan_too():
    """Batched decoding pads the cache (left padding): the padding cases run a KV-cache step with 3 new tokens
    against 10 keys, NaN/inf in the padded cached rows too (an eleventh stranger: check never put NaN there, so a
    masked_poison declaration was verified on none, and only search found the NaN leak)."""
    report = mha_harness.check(KVCacheAttention(), cases=["check_padding_mask_blocks_padded_keys",
                                                          "check_padding_mask_output_matches_reference"])
    assert report.ok, report.summary_lines()
    ran = {(r.case, r.params.get("poison")) for r in _results(report, "passed")}
    assert ("check_padding_mask_blocks_padded_keys", "nan") in ran and \
        ("check_padding_mask_blocks_padded_keys", "inf") in ran, ran


def test_a_kv_cache_backward_that_detaches_the_new_keys_is_caught_and_named():
    pytest.importorskip("torch")
    report = mha_harness.check(TorchGradientOfNewRowsAsQueriesOnly(), cases=["check_gradients_match_reference"])
    failed = _results(report, "failed")
    assert failed and all("the x_new gradient is through its queries alone" in r.message for r in failed)
    assert any("diagnosed: the x_new gradient is through its queries alone" in line
               for line in report.summary_lines())


def test_a_kv_cache_backend_refuses_an_x_q_that_is_not_x_kvs_last_rows():
    """A call whose x_q is not the last Tq rows of x_kv is not a KV-cache step: a ValueError naming inputs."""
    params = mha_harness.make_params(mha_harness.AttentionConfig(16, 2))
    loaded = KVCacheAttention().load(params, dtype="float64")
    rng = np.random.default_rng(0)
    x_q, x_kv = rng.standard_normal((1, 3, 16)), rng.standard_normal((1, 8, 16))
    with pytest.raises(ValueError, match=r"inputs: got the shared_kv form \(x_q is not the last Tq rows of x_kv\)"):
        loaded.forward(mha_harness.AttentionInputs(x_q, x_kv, x_kv, causal="bottom-right"))
    x_kv[:, -3:] = x_q
    inputs = mha_harness.AttentionInputs(x_q, x_kv, x_kv, causal="bottom-right")
    assert inputs.form == "kv_cache" and inputs.cached.shape == (1, 5, 16)
    loaded.forward(inputs)
    with pytest.raises(ValueError, match="query"):  # a malformed query is named as such, not as the form
        loaded.forward(inputs.replace(query=x_q[0]))
    with pytest.raises(ValueError, match=r"shared_kv form \(x_q has dtype float32, x_kv float64\)"):
        loaded.forward(inputs.replace(query=x_q.astype(np.float32)))
    with pytest.raises(ValueError, match=r"Tq = 9 > Tk = 8"):
        loaded.forward(inputs.replace(query=rng.standard_normal((1, 9, 16)), causal=None))


def test_kv_cache_capabilities_are_bottom_right_and_never_more_queries_than_keys():
    caps = mha_harness.Capabilities(inputs="kv_cache", causal_alignments=("bottom-right",))
    assert caps.more_queries_than_keys is False and caps.cross_attention is True
    with pytest.raises(ValueError, match=r"causal_alignments: got \('top-left', 'bottom-right'\) with "
                                         r"inputs='kv_cache'; accepted: \('bottom-right',\) or \(\)"):
        mha_harness.Capabilities(inputs="kv_cache")
    with pytest.raises(ValueError, match="KV-cache"):
        mha_harness.function_backend(lambda x_q, x_kv, W_q, W_k, W_v, W_o, num_heads: x_q, name="f",
                                     inputs="kv_cache")


def test_bench_calls_a_kv_cache_backend_with_x_new_as_x_kvs_last_rows():
    """bench's decode call for a KV-cache backend is a KV-cache step; the other backends get the same query."""
    shape = Shape(batch=1, tq=4, tk=32, d_model=16, num_heads=2, causal=True)
    _, inputs = backend_arguments(KVCacheAttention(), shape)
    assert inputs.form == "kv_cache" and inputs.causal == "bottom-right"
    from mha_harness.implementations.numpy_naive import NumpyNaive
    _, other = backend_arguments(NumpyNaive(), shape)
    assert np.array_equal(other.query, inputs.query) and other.form == "separate"


@pytest.mark.parametrize("spec, found", [("KVCacheAttention", False), ("OffsetForgotten", True)])
def test_search_draws_kv_cache_steps(tmp_path, spec, found):
    """The search draws KV-cache steps (Tq <= Tk, x_new the last rows) for such a backend: a correct one passes
    (NaN/inf poison only in cached rows), the offset bug is found."""
    out = subprocess.run([sys.executable, "-m", "mha_harness", "search", "--backend-spec",
                          f"tests.kv_cache_objects:{spec}", "--quick", "--seed", "0", "--time-budget", "30",
                          "--no-isolate", "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    line = next(x for x in out.stdout.splitlines() if x.startswith("search "))
    assert line.endswith(": FAILED") == found, out.stdout + out.stderr
    if found:
        assert "top-left alignment instead" in out.stdout


def test_a_kv_cache_layers_gradient_leak_names_the_input_it_flows_into_readably():
    """The causal Jacobian case names the input whose gradient is not zero; a KV-cache step's is a phrase, which an
    outside user read as "d(output row 0, ...)/dthe sequence's input (...)": it is now in parentheses."""
    torch = pytest.importorskip("torch")  # noqa: F841
    report = mha_harness.check([TorchOneFutureKey()], cases=["check_causal_jacobian_zero_for_future_inputs"],
                               isolate=False)
    failed = report.failures()
    assert failed, report.summary_lines()
    assert all("/d(the sequence's input (x_kv's cached rows, then x_new)) at position" in f.message
               for f in failed), failed[0].message[:500]


def test_an_always_causal_layers_own_causal_mask_is_checked_in_process_as_in_its_worker():
    """A layer that masks causally itself and asks the mask helpers for the call's other masks
    (``masks.additive_mask(inputs, causal=False)``) got, in-process only (isolate=False, the pytest route), the
    case's implicit causal mask back: its own mask one key too wide passed there and failed isolated. The plugin's
    code now runs outside the case's implicitly_causal on every route, and the verdicts agree."""
    pytest.importorskip("torch")
    case = ["check_causal_output_matches_reference"]
    in_process = mha_harness.check([TorchOneFutureKey()], cases=case, isolate=False)
    isolated = mha_harness.check([TorchOneFutureKey()], cases=case, isolate=True)
    statuses = [(r.variant, r.status.value) for r in in_process.results]
    assert statuses == [(r.variant, r.status.value) for r in isolated.results]
    failed = in_process.failures()
    assert len(failed) >= 2 and all("a causal mask one key too wide" in f.message for f in failed), statuses


def test_replacing_causal_by_none_gives_a_call_without_a_causal_mask_even_where_inputs_are_implicitly_causal():
    """implicitly_causal fills in the causal of inputs made without one; an explicit ``replace(causal=None)`` (the
    call without its causal mask, as a diagnosis or a layer's own mask helper asks for it) stays without one."""
    x = np.zeros((1, 3, 4))
    with mha_harness.implicitly_causal("top-left"):
        inputs = mha_harness.AttentionInputs(x, x, x)
        assert inputs.causal == "top-left"
        assert inputs.replace(causal=None).causal is None
        assert inputs.replace(key_padding_mask=None).causal == "top-left"
        from mha_harness import masks
        assert masks.additive_mask(inputs, causal=False) is None
