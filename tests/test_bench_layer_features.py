"""``bench --rotary``, ``--qk-norm`` and ``--sliding-window``: the layers people write (Llama's rotary embeddings,
Qwen 3's q/k norm, Mistral's sliding window) are timed as built, checked against the float64 reference with the same
features, counted honestly (a window's visible pairs, a windowed decode step's cache rows), and a backend that cannot
be built with them is skipped naming the capability. numpy-tiled skips the keys behind a query block's window."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from mha_harness.bench.metrics import (
    Shape,
    compulsory_bytes,
    core_flops,
    visible_fraction,
    window_visible_pairs,
)
from mha_harness.bench.sweep import PLAIN_LAYER, BenchConfig, run_bench
from mha_harness.contract.conventions import alibi_slopes, causal_offset, window_allows
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from mha_harness.implementations.numpy_tiled import NumpyTiled, NumpyTiledLoaded
from mha_harness.toolkit.masks import full_mask

SMALL = dict(d_model=64, num_heads=4, budget_s=0.2, warm_up_s=0.05, min_sample_s=0.005, turn_s=0.02)


def _quiet(*args, **kwargs):
    pass


def _brute_force_pairs(s: Shape) -> int:
    """The visible (query, key) pairs from the conventions' own masks: the window's, and the causal mask's (prefill
    top-left, decode bottom-right)."""
    alignment = None if not s.causal else ("top-left" if s.tq == s.tk else "bottom-right")
    allowed = window_allows(s.sliding_window, alignment, s.tq, s.tk)
    if alignment:
        offset = causal_offset(alignment, s.tq, s.tk)
        allowed = allowed & (np.arange(s.tk)[None, :] <= np.arange(s.tq)[:, None] + offset)
    return int(allowed.sum())


@pytest.mark.parametrize("tq, tk, causal, window", [(64, 64, True, 8), (64, 64, False, 8), (64, 64, True, 1),
                                                     (1, 1024, True, 128), (16, 1024, True, 128),
                                                     (48, 48, True, 47), (50, 50, False, 49)])
def test_a_sliding_window_counts_exactly_the_pairs_it_leaves_visible(tq, tk, causal, window):
    """The core FLOPs of a layer with a window narrower than Tk count the (query, key) pairs the conventions' window
    and causal masks leave visible, no more (a kernel that computes the rest did work the layer does not need)."""
    s = Shape(1, tq, tk, 64, 4, causal=causal, sliding_window=window)
    assert window_visible_pairs(s) == _brute_force_pairs(s)
    half_diagonal = tq / 2 if causal and tq == tk else 0  # as the causal convention: T^2 / 2, not T (T + 1) / 2
    assert core_flops(s) == pytest.approx(4 * 4 * 16 * (_brute_force_pairs(s) - half_diagonal))


def test_a_window_as_wide_as_the_keys_counts_as_no_window_and_a_narrower_one_counts_less():
    """A window of at least Tk keys hides no key: the FLOPs and bytes are the plain layer's (the causal convention of
    half the pairs at Tq = Tk included); each key a narrower window hides is one pair fewer, never more (an outside
    user's --sliding-window 255 at T = 256 had counted more than 256)."""
    for tq, tk, causal in ((64, 64, True), (64, 64, False), (1, 1024, True), (16, 1024, True)):
        plain = Shape(1, tq, tk, 64, 4, causal=causal, cached=tq < tk)
        for window in (tk, tk + 1, 10 * tk):
            wide = dataclasses.replace(plain, sliding_window=window)
            assert visible_fraction(wide) == pytest.approx(visible_fraction(plain), rel=1e-12)
            assert compulsory_bytes(wide) == compulsory_bytes(plain)
        counts = [core_flops(dataclasses.replace(plain, sliding_window=w)) for w in range(tk, 0, -1)]
        assert all(later < earlier for earlier, later in zip(counts, counts[1:]))


def test_a_windowed_decode_step_counts_only_the_cache_rows_its_queries_see():
    """A decode step of Tq queries under a window of w keys needs Tq + w - 1 cache rows, not the whole cache: its
    compulsory bytes count those (a kernel that reads all of a 64k cache for a 4k window is memory-bound on reads
    the layer does not need, and its GB/s say so by being low)."""
    plain = Shape(1, 1, 65536, 512, 8, causal=True, cached=True)
    windowed = dataclasses.replace(plain, sliding_window=4096)
    cache_row = 2 * 512 * 4  # a K and a V row, float32
    assert compulsory_bytes(plain) - compulsory_bytes(windowed) == (65536 - 4096) * cache_row
    sixteen = dataclasses.replace(windowed, tq=16)
    assert compulsory_bytes(dataclasses.replace(sixteen, sliding_window=None)) - compulsory_bytes(sixteen) == \
        (65536 - (16 + 4096 - 1)) * cache_row


def test_bench_times_the_layer_with_its_features_and_skips_backends_that_cannot_build_it(tmp_path, capsys):
    """``BenchConfig(rotary=..., qk_norm=..., sliding_window=...)``: numpy-naive (which declares all three) is
    timed after its output matched the reference built with them; numpy-tiled (no rotary) is skipped naming the
    capability; bench.json's config, the header and the plots' titles say what the layer had."""
    config = BenchConfig(rotary="half_split", qk_norm="rms_per_head", sliding_window=16, **SMALL)
    doc = run_bench([NumpyNaive(), NumpyTiled()], tmp_path, seq_lens=[32, 64], causal="on", config=config)
    header = capsys.readouterr().out.splitlines()[0]
    assert "causal (--causal on; Tq = Tk, where top-left and bottom-right are one mask)" in header, header
    assert "the layer with half_split rotary embeddings on q and k (base 10000" in header, header
    assert "a sliding window of 16 keys" in header and PLAIN_LAYER not in header, header
    assert "rotary half_split" not in header, header  # said once, not in the shape's words too
    assert "rotary half_split, q/k norm rms_per_head, sliding window 16" in config.layer_text()  # the plots' titles
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["causal"] == "on"
    naive_info = saved["backends"]["numpy-naive"]  # how each backend does its work, beside its threads
    assert naive_info["declares"]["sliding_window"] and "half_split" in naive_info["declares"]["rotary"]
    assert naive_info["native_causal"] and naive_info["native_mask_polarity"] and naive_info["threads"]
    assert (saved["config"]["rotary"], saved["config"]["qk_norm"], saved["config"]["sliding_window"]) == \
        ("half_split", "rms_per_head", 16)
    naive = [p for p in doc["points"] if p["backend"] == "numpy-naive"]
    assert naive and all(p["status"] == "measured" and p["output_check"]["rows"] == min(16, p["tq"])
                         and p["output_check"]["max_error"] <= p["output_check"]["bound"] for p in naive), naive
    at_64 = next(p for p in naive if p["tq"] == 64)
    shape = Shape(1, 64, 64, 64, 4, causal=True, sliding_window=16)
    assert at_64["gflops"] == pytest.approx(core_flops(shape) / at_64["median_s"] / 1e9, rel=1e-3)
    tiled = [p for p in doc["points"] if p["backend"] == "numpy-tiled"]
    assert tiled and all(p["status"] == "skipped" and "no half_split rotary embeddings (capabilities.rotary "
                         "declares: none)" in p["skipped"] for p in tiled), tiled
    plain = run_bench([NumpyTiled()], None, seq_lens=[32], config=BenchConfig(**SMALL), log=_quiet)
    assert plain["config"]["rotary"] is None and plain["points"][0]["status"] == "measured"


class _RotaryDroppedLoaded(NumpyNaiveLoaded):
    def rotate(self, x, positions, which):
        return x  # config.rotary never reaches the layer


class RotaryDropped(NumpyNaive):
    """A layer that declares rotary embeddings and never turns q or k."""

    name = "rotary-dropped"

    def load_native(self, params, dtype):
        return _RotaryDroppedLoaded(params, dtype)


class _WindowDroppedLoaded(NumpyNaiveLoaded):
    def masks(self, inputs):
        return full_mask(inputs)  # config.sliding_window never reaches the mask


class WindowDropped(NumpyNaive):
    """A layer that declares a sliding window and attends to every key before each query."""

    name = "window-dropped"

    def load_native(self, params, dtype):
        return _WindowDroppedLoaded(params, dtype)


class _NormGainsDroppedLoaded(NumpyNaiveLoaded):
    def norm_gain(self, which):
        return np.ones_like(super().norm_gain(which))  # g_q and g_k never loaded: the norm's initial ones


class NormGainsDropped(NumpyNaive):
    """A layer that declares a q/k norm and never loads its gains."""

    name = "norm-gains-dropped"

    def load_native(self, params, dtype):
        return _NormGainsDroppedLoaded(params, dtype)


class _NormKeptOnLoaded(NumpyNaiveLoaded):
    def project(self, x, which):
        y = super().project(x, which)
        if which not in ("q", "k") or self.config.qk_norm:
            return y
        b, t, width = y.shape  # a wrapped Qwen 3 layer's per-head RMSNorm, kept on whatever the config says
        groups = y.reshape(b, t, width // self.config.d_head, self.config.d_head)
        return (groups / np.sqrt(np.mean(np.square(groups), axis=-1, keepdims=True) + 1e-6)).reshape(b, t, width)


class NormKeptOn(NumpyNaive):
    """A layer that norms q and k per head even when its config has no norm."""

    name = "norm-kept-on"

    def load_native(self, params, dtype):
        return _NormKeptOnLoaded(params, dtype)


def test_a_layer_that_drops_a_feature_it_declares_is_reported_wrong_output_not_timed_naming_the_mistake():
    """A fast layer that leaves out the rotary embeddings or the window it was asked for computes another layer:
    bench checks the first call against the reference built with the features, times none of its calls and names
    the mistake as check does (an outside user's window bug got only "compare it with compute()" from bench)."""
    for backend, config, named, where in (
            (RotaryDropped(), BenchConfig(rotary="interleaved", **SMALL),
             "the output matches no rotary embeddings at all (q and k never turned", "the rotary positions"),
            (WindowDropped(), BenchConfig(sliding_window=8, **SMALL),
             "the output matches attention without its sliding window: config.sliding_window = 8 is not applied",
             "the sliding window"),
            (NormGainsDropped(), BenchConfig(qk_norm="rms_per_head", **SMALL),
             "the output matches the q/k norm without its gains g_q and g_k", "the q/k norm")):
        doc = run_bench([backend], None, seq_lens=[48], causal="on", config=config, log=_quiet)
        point = doc["points"][0]
        assert point["status"] == "wrong-output" and not point["samples_s"], point
        assert named in point["skipped"] and f"(the mask, the scale, W_o, {where})" in point["skipped"], \
            point["skipped"]


def test_a_layer_that_keeps_a_q_k_norm_on_in_a_plain_bench_is_named_as_check_names_it():
    """A wrapped layer that norms q and k whatever the config says, benchmarked without ``--qk-norm``: bench names
    the norm kept on (the diagnosis check gives), not only "compare it with compute()"."""
    doc = run_bench([NormKeptOn()], None, seq_lens=[48], causal="on", config=BenchConfig(**SMALL), log=_quiet)
    point = doc["points"][0]
    assert point["status"] == "wrong-output" and not point["samples_s"], point
    assert "the output matches a q/k norm, an RMSNorm over each head's d_head features" in point["skipped"] and \
        "in a layer built without one" in point["skipped"], point["skipped"]


class _BaseFixedLoaded(NumpyNaiveLoaded):
    def rotary_base(self):
        return 10_000.0  # rope_theta never passed on: the module's default


class RotaryBaseFixed(NumpyNaive):
    """A layer that declares rotary embeddings and turns them at base 10000 whatever config.rotary_base says."""

    name = "rotary-base-fixed"

    def load_native(self, params, dtype):
        return _BaseFixedLoaded(params, dtype)


def test_bench_times_rotary_embeddings_at_the_base_asked_for_and_names_a_layer_that_ignores_it(tmp_path, capsys):
    """``--rotary-base 500000`` (Llama 3's rope_theta) and ``--qk-norm-eps 1e-5`` build the timed layer and its
    reference with that base and epsilon: the header, the plots' titles and bench.json say them, numpy-naive is
    timed; a layer that keeps base 10000 is wrong-output naming the base, not timed."""
    config = BenchConfig(rotary="half_split", rotary_base=500_000.0, qk_norm="rms_per_head", qk_norm_eps=1e-5,
                         **SMALL)
    doc = run_bench([NumpyNaive(), RotaryBaseFixed()], tmp_path, seq_lens=[48], causal="on", config=config)
    header = capsys.readouterr().out.splitlines()[0]
    assert "half_split rotary embeddings on q and k (base 500000;" in header, header
    assert "a rms_per_head q/k norm (epsilon 1e-05," in header, header
    assert "rotary half_split base 500000, q/k norm rms_per_head eps 1e-05" in config.layer_text()
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())["config"]
    assert (saved["rotary_base"], saved["qk_norm_eps"]) == (500_000.0, 1e-5), saved
    by_name = {p["backend"]: p for p in doc["points"]}
    assert by_name["numpy-naive"]["status"] == "measured", by_name["numpy-naive"]
    fixed = by_name["rotary-base-fixed"]
    assert fixed["status"] == "wrong-output" and not fixed["samples_s"], fixed
    assert "rotary embeddings built with base 10000 where config.rotary_base is 500000" in fixed["skipped"], \
        fixed["skipped"]


def test_a_mistake_repeated_at_every_length_is_said_in_full_once_naming_each_point(capsys):
    """The same wrong output at two lengths: the progress says its message once (the second point refers to the
    first), the table's list gives it once, naming both points; bench.json keeps each point's own message."""
    config = BenchConfig(rotary="half_split", rotary_base=500_000.0, **SMALL)
    doc = run_bench([RotaryBaseFixed()], None, seq_lens=[32, 48], causal="on", config=config)
    out = capsys.readouterr().out
    said = "the output matches rotary embeddings built with base 10000"
    assert out.count(said) == 2, out  # the progress line of the first point, the list's line
    assert "wrong-output, the same message as at prefill:32x32:causal:forward but for its figures" in out, out
    assert ("rotary-base-fixed (wrong-output at Tq=32 Tk=32 forward, mask top-left; Tq=48 Tk=48 forward, mask "
            "top-left):") in out, out
    assert all(said in p["output_check"]["wrong"] for p in doc["points"]), doc["points"]


class _WindowOneKeyLateLoaded(NumpyTiledLoaded):
    def key_start(self, inputs, q0):
        start = super().key_start(inputs, q0)  # skips the first key of each query block's window
        return start if self.config.sliding_window is None else start + 1


class TiledWindowOneKeyLate(NumpyTiled):
    """numpy-tiled whose window skip starts one key too late."""

    name = "tiled-window-one-key-late"

    def load_native(self, params, dtype):
        return _WindowOneKeyLateLoaded(params, dtype, self.block_q, self.block_k)


def test_numpy_tiled_skips_the_keys_behind_each_query_blocks_window_and_stays_exact():
    """Under a window of w keys, numpy-tiled's query block from q0 starts at key q0 + offset - w + 1: with small
    blocks (so that later blocks skip) it passes the window cases, and the same kernel starting one key late fails
    them."""
    from mha_harness import check
    cases = ["check_sliding_window_output_matches_reference", "check_decode_step_over_filled_cache_matches_reference"]
    small = NumpyTiled(block_q=4, block_k=8)
    small.name = "numpy-tiled-small-blocks"
    report = check([small], cases=cases)
    windowed = [r for r in report.results if r.case == cases[0] or r.params.get("variant") == "sliding_window"]
    assert report.ok and windowed and all(r.status == "passed" for r in windowed), report.summary_lines()
    late = check([TiledWindowOneKeyLate(block_q=4, block_k=8)], cases=cases)
    failed = {(r.case, r.params.get("variant")) for r in late.results if r.status == "failed"}
    assert (cases[1], "sliding_window") in failed and {c for c, _ in failed} == set(cases), late.summary_lines()
    # the default blocks: a decode step's one block starts where its window does
    loaded = NumpyTiled().load(small_params(), dtype="float32")
    inputs = _decode_inputs(tq=1, tk=1000)
    assert loaded.key_start(inputs, 0) == 1000 - 1 - 16 + 1


def small_params():
    from mha_harness import AttentionConfig, make_params
    return make_params(AttentionConfig(32, 4, sliding_window=16), seed=0)


def _decode_inputs(tq: int, tk: int):
    from mha_harness import AttentionConfig, as_kv_cache_call, make_inputs
    return as_kv_cache_call(make_inputs(AttentionConfig(32, 4, sliding_window=16), 1, tq, tk, seed=0,
                                        causal="bottom-right"))


def test_the_features_are_validated_naming_the_option_and_the_accepted_values(tmp_path, capsys):
    """An odd d_head with --rotary, a window below one key, an unknown norm: a usage error naming the option."""
    from mha_harness.cli import main
    for argv, said in ((["--rotary", "half_split", "--d-model", "24", "--heads", "8"],
                        "--rotary: got 'half_split' with d_head = 3; accepted: an even d_head (rotary embeddings "
                        "turn pairs of a head's features), or no --rotary"),
                       (["--sliding-window", "0"], "--sliding-window"),
                       (["--qk-norm", "rms"], "--qk-norm: invalid choice: 'rms'"),
                       (["--rotary-base", "500000"], "--rotary-base: got 500000 without rotary embeddings; accepted: "
                                                     "a base together with rotary (--rotary)"),
                       (["--rotary", "half_split", "--rotary-base", "1"], "--rotary-base: got '1'; accepted: a "
                                                                          "finite number > 1"),
                       (["--qk-norm-eps", "1e-5"], "--qk-norm-eps: got 1e-05 without a q/k norm; accepted: an "
                                                   "epsilon together with qk_norm (--qk-norm)"),
                       (["--workload", "decode", "--causal", "off"], "--causal: got 'off' with --workload decode; "
                                                                     "accepted: leave it out"),
                       (["--query-lens", "128"], "--query-lens: got 128 with --workload prefill; accepted: leave it "
                                                 "out (prefill times Tq = Tk = T), or --workload decode"),
                       (["--heads", "7"], "--heads: got 7, which does not divide --d-model 512; accepted: a divisor "
                                          "of --d-model (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)")):
        assert main(["bench", *argv, "--results", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert said in err, err
    with pytest.raises(ValueError, match=r"sliding_window: got 0.*accepted: None .* or an integer >= 1"):
        run_bench([NumpyTiled()], None, seq_lens=[32], config=BenchConfig(sliding_window=0, **SMALL), log=_quiet)


def test_a_backend_is_skipped_at_a_head_width_it_cannot_be_built_with():
    """A backend that declares ``d_head_multiple`` (its kernel needs head widths in multiples of it) is skipped at a
    shape whose d_head is not one, the reason naming the declaration, not left to fail inside its worker."""
    from mha_harness.bench.calls import unsupported
    backend = NumpyNaive()
    backend.capabilities = dataclasses.replace(backend.capabilities, d_head_multiple=8)
    assert unsupported(backend, Shape(1, 32, 32, 64, 4)) is None  # d_head 16
    why = unsupported(backend, Shape(1, 32, 32, 48, 4))  # d_head 12
    assert why and "d_head 12 is not a multiple of 8 (declares d_head_multiple=8)" in why, why


class _AlibiSlopesReversedLoaded(NumpyNaiveLoaded):
    def alibi(self, tq, tk):
        bias = super().alibi(tq, tk)
        return None if bias is None else bias * (alibi_slopes(self.config.num_heads)[::-1]
                                                 / alibi_slopes(self.config.num_heads))[None, :, None, None]


class AlibiSlopesReversed(NumpyNaive):
    """A layer that declares ALiBi and gives head h the slope of head n - 1 - h."""

    name = "alibi-slopes-reversed"

    def load_native(self, params, dtype):
        return _AlibiSlopesReversedLoaded(params, dtype)


@pytest.mark.parametrize("workload", ["prefill", "decode"])
def test_bench_times_an_alibi_layer_skips_backends_without_it_and_names_wrong_slopes(tmp_path, capsys, workload):
    """``--alibi linear`` builds the timed layer and its reference with BLOOM's bias: the header and bench.json say
    it, numpy-naive is timed (its first call checked against the reference with the bias), numpy-tiled (no ALiBi)
    is skipped naming the capability, and a layer whose slopes run backwards is wrong-output naming it, untimed."""
    config = BenchConfig(alibi="linear", workload=workload, **SMALL)
    decode = dict(query_lens=(1,)) if workload == "decode" else dict(causal="on")
    doc = run_bench([NumpyNaive(), NumpyTiled(), AlibiSlopesReversed()], tmp_path, seq_lens=[48], config=config,
                    **decode)
    header = capsys.readouterr().out.splitlines()[0]
    assert "a linear ALiBi bias (-m_h (p - s), the paper's slopes)" in header, header
    saved = json.loads((tmp_path / ("bench-decode" if workload == "decode" else "bench") / "bench.json").read_text())
    assert saved["config"]["alibi"] == "linear" and \
        saved["backends"]["numpy-naive"]["declares"]["alibi"] == ["symmetric", "linear"], saved["backends"]
    by_name = {p["backend"]: p for p in doc["points"]}
    assert by_name["numpy-naive"]["status"] == "measured", by_name["numpy-naive"]
    assert "no linear ALiBi (capabilities.alibi declares: none)" in by_name["numpy-tiled"]["skipped"]
    wrong = by_name["alibi-slopes-reversed"]
    assert wrong["status"] == "wrong-output" and not wrong["samples_s"], wrong
    assert "the ALiBi slopes in reverse head order" in wrong["skipped"], wrong["skipped"]
