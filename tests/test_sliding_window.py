"""Sliding windows (``AttentionConfig.sliding_window``, declared by ``Capabilities.sliding_window``): Mistral's,
Gemma's and Qwen 2's local layers let each query see only its own position and the w - 1 before it. The reference
against an independent transcription, the declarations and refusals, the mask helpers, the backends, the cases and
their mutants, search, and the diagnoses."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, Capabilities
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention, reference_vjp
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from tests.test_rotary import assert_float64_layer_matches_reference

WINDOW_CASES = ["check_sliding_window_output_matches_reference", "check_sliding_window_hides_keys_behind_it",
                "check_decode_step_over_filled_cache_matches_reference"]


def projected_heads(params, inputs):
    """Q (B, H, Tq, d_head), K and V (B, H, Tk, d_head; grouped-query heads repeated for their group) of a layer
    with biases, written out in float64."""
    c = params.config
    heads = lambda y, n: y.reshape(*y.shape[:2], n, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q = heads(inputs.query @ params.W_q + params.b_q, c.num_heads)
    k = np.repeat(heads(inputs.key @ params.W_k + params.b_k, c.kv_heads), c.group, axis=1)
    v = np.repeat(heads(inputs.value @ params.W_v + params.b_v, c.kv_heads), c.group, axis=1)
    return q, k, v


def _windowed_attention(params, inputs, window):
    """Written out per query and key as transformers' sliding-window mask reads (``kv_idx > q_idx - sliding_window``
    and, causal, ``kv_idx <= q_idx``, at cache positions), with a loop: query i at position i + offset, where offset
    is the causal alignment's diagonal (bottom-right without a causal mask, flash-attn's window convention)."""
    c = params.config
    q, k, v = projected_heads(params, inputs)
    tq, tk = inputs.tq, inputs.tk
    offset = 0 if inputs.causal == "top-left" else tk - tq
    out = np.zeros(q.shape)
    for i in range(tq):
        position = i + offset
        seen = [j for j in range(tk) if j > position - window and (inputs.causal is None or j <= position)]
        s = q[:, :, i, None, :] @ k[:, :, seen].transpose(0, 1, 3, 2) / np.sqrt(c.d_head)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, :, i] = ((p / p.sum(axis=-1, keepdims=True)) @ v[:, :, seen])[:, :, 0]
    return out.transpose(0, 2, 1, 3).reshape(inputs.batch, tq, c.d_model) @ params.W_o + params.b_o


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("tq, tk, causal", [(10, 10, "bottom-right"), (4, 13, "bottom-right"), (4, 13, "top-left"),
                                            (9, 9, None), (3, 11, None)])
def test_the_references_window_hides_the_keys_more_than_w_minus_1_positions_back(window, tq, tk, causal):
    config = AttentionConfig(32, 4, 2, bias=True, sliding_window=window)
    params = make_params(config, seed=4)
    inputs = make_inputs(config, 2, tq, tk, seed=5, causal=causal)
    np.testing.assert_allclose(reference_attention(params, inputs).output, _windowed_attention(params, inputs, window),
                               atol=1e-12)


def test_a_window_as_long_as_the_keys_changes_nothing_and_a_shorter_one_does():
    config = AttentionConfig(32, 4, bias=True)
    params = make_params(config, seed=4)
    inputs = make_inputs(config, 2, 12, 12, seed=5, causal="bottom-right")
    plain = reference_attention(params, inputs).output
    wide = params.replace(config=AttentionConfig(32, 4, bias=True, sliding_window=12))
    np.testing.assert_array_equal(reference_attention(wide, inputs).output, plain)
    narrow = params.replace(config=AttentionConfig(32, 4, bias=True, sliding_window=11))
    got = reference_attention(narrow, inputs).output
    np.testing.assert_array_equal(got[:, :11], plain[:, :11])  # positions 0..10 see at most 11 keys
    assert np.abs(got[:, 11] - plain[:, 11]).max() > 1e-3


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4096"])
def test_a_malformed_window_is_refused_naming_sliding_window(bad):
    with pytest.raises(ValueError, match="sliding_window: got .*accepted: None .* or an integer >= 1"):
        AttentionConfig(32, 4, sliding_window=bad)


def test_a_backend_that_does_not_declare_a_window_refuses_one_at_load_naming_it():
    import dataclasses

    from mha_harness.implementations.numpy_naive import NumpyNaive
    backend = NumpyNaive()
    backend.name = "numpy-naive-without-window"
    backend.capabilities = dataclasses.replace(backend.capabilities, sliding_window=False)
    params = make_params(AttentionConfig(32, 4, sliding_window=4))
    with pytest.raises(ValueError, match=r"sliding_window: got 4 but numpy-naive-without-window does not declare "
                                         r"Capabilities.sliding_window"):
        backend.load(params)
    with pytest.raises(TypeError, match="Capabilities.sliding_window"):
        Capabilities(sliding_window="yes")


def test_the_public_mask_helpers_build_the_window_with_the_calls_alignment():
    from mha_harness import masks
    from mha_harness.contract.api import AttentionInputs
    # bottom-right (and no alignment): query i at position i + Tk - Tq sees the keys after position - w
    want = np.array([[j > i + 3 - 2 for j in range(6)] for i in range(3)])
    np.testing.assert_array_equal(masks.sliding_window_mask(3, 6, 2), want)
    np.testing.assert_array_equal(masks.sliding_window_mask(3, 6, 2, "bottom-right"), want)
    np.testing.assert_array_equal(masks.sliding_window_mask(3, 6, 2, "top-left"),
                                  np.array([[j > i - 2 for j in range(6)] for i in range(3)]))
    np.testing.assert_array_equal(masks.sliding_window_mask(3, 6, 2, polarity="ignore"), ~want)
    with pytest.raises(ValueError, match="window: got 0; accepted: an integer >= 1"):
        masks.sliding_window_mask(3, 6, 0)
    x = np.zeros((1, 3, 4))
    kv = np.zeros((1, 6, 4))
    call = AttentionInputs(x, kv, kv, causal="bottom-right")
    combined = masks.combined_mask(call, sliding_window=2)[0, 0]
    np.testing.assert_array_equal(combined, want & masks.causal_mask(3, 6, "bottom-right"))
    # without the causal mask (a layer with its own causal flag) the window keeps the call's alignment
    np.testing.assert_array_equal(masks.combined_mask(call, causal=False, sliding_window=2)[0, 0], want)
    block, _ = masks.block_mask(call, 1, 3, 2, 6, sliding_window=2)  # a tiled kernel's block of it
    np.testing.assert_array_equal(block[0, 0], combined[1:3, 2:6])
    additive = masks.additive_mask(call, sliding_window=2)[0, 0]
    np.testing.assert_array_equal(np.isneginf(additive), ~combined)
    assert masks.combined_mask(AttentionInputs(x, kv, kv)) is None


@pytest.mark.parametrize("backend_name", ["numpy-naive", "torch-eager"])
def test_the_backends_that_declare_a_window_match_the_reference_in_float64(backend_name):
    if backend_name == "torch-eager":
        pytest.importorskip("torch")
        from mha_harness.implementations.torch_eager import TorchEager as backend_class
    else:
        backend_class = NumpyNaive
    backend = backend_class()
    assert backend.capabilities.sliding_window
    for window in (1, 4):
        params = make_params(AttentionConfig(32, 4, 2, bias=True, sliding_window=window), seed=7)
        assert_float64_layer_matches_reference(backend, params)


def test_torch_eagers_gradients_leave_the_keys_behind_the_window_untouched():
    pytest.importorskip("torch")
    from mha_harness.implementations.torch_eager import TorchEager
    params = make_params(AttentionConfig(32, 4, bias=True, sliding_window=3), seed=8)
    inputs = make_inputs(params.config, 1, 9, 9, seed=9, causal="bottom-right")
    cotangent = np.zeros((1, 9, 32))
    cotangent[0, 8] = 1.0  # only the last query's output: it sees keys 6, 7, 8
    got = TorchEager().load(params, dtype="float64").vjp(inputs, cotangent)
    np.testing.assert_array_equal(got["key"][0, :6], 0.0)
    np.testing.assert_array_equal(got["value"][0, :6], 0.0)
    np.testing.assert_allclose(got["key"], reference_vjp(params, inputs, cotangent)["key"], atol=1e-12)


def test_torch_eager_and_numpy_tiled_pass_every_window_case_and_a_backend_without_one_skips_them_naming_it():
    pytest.importorskip("torch")
    import dataclasses

    from mha_harness.implementations.numpy_tiled import NumpyTiled
    from mha_harness.implementations.torch_eager import TorchEager
    report = mha_harness.check(TorchEager(), cases=WINDOW_CASES + ["check_gradients_match_reference"], isolate=False)
    assert report.ok, [r.message for r in report.failures()]
    window_runs = [r for r in report.results if "window" in r.case or r.params.get("sliding_window")]
    assert len([r for r in window_runs if r.status == "passed"]) == 4 + 4 + 1 + 1 + 1  # the rows, leak, step, gradient
    tiled = mha_harness.check(NumpyTiled(), cases=WINDOW_CASES[:2], isolate=False)
    assert tiled.ok and {r.status for r in tiled.results} == {"passed"}, [r.message for r in tiled.failures()]
    without = NumpyTiled()
    without.name, without.capabilities = "numpy-tiled-without-window", dataclasses.replace(
        without.capabilities, sliding_window=False)
    skipped = mha_harness.check(without, cases=WINDOW_CASES[:2], isolate=False)
    assert {r.status for r in skipped.results} == {"skipped"}
    assert all("does not declare sliding_window" in r.message for r in skipped.results)


def test_every_window_mutant_is_caught_and_named():
    from mha_harness.conformance.mutation import mutation_score
    from mha_harness.implementations.mutants import mutant_backends
    mutants = [b for b in mutant_backends() if b.name.startswith("mutant-sliding-window-")]
    assert len(mutants) == 4
    score = mutation_score(mutants, WINDOW_CASES + ["check_gradients_match_reference"])
    caught = {row["name"]: row["caught_by"] for row in score["mutants"]}
    assert score["caught"] == 4, caught
    assert "check_sliding_window_hides_keys_behind_it" in caught["mutant-sliding-window-ignored"]
    assert "check_sliding_window_hides_keys_behind_it" in caught["mutant-sliding-window-one-key-too-wide"]
    assert "check_sliding_window_output_matches_reference" in caught["mutant-sliding-window-from-query-index"]
    assert caught["mutant-sliding-window-backward-without-window"] == ["check_gradients_match_reference"]


class _WindowFixedInTheLayer(NumpyNaiveLoaded):
    """A wrapped Mistral-style module whose window of 16 keys is fixed inside it whatever the config says."""

    def masks(self, inputs):
        from mha_harness.masks import full_mask
        return full_mask(inputs, sliding_window=16)


def test_a_window_fixed_in_the_layer_is_named_with_its_width_whatever_the_config_says():
    """An outside user's Mistral copy built its window of 16 keys once, whatever config.sliding_window said: named in
    a layer built without one (from the first wrong row; in a KV-cache step, where every row is wrong, by trying each
    width) and where the config's window is another (8)."""
    import dataclasses
    backend = NumpyNaive()
    backend.name, backend.loaded_class = "fixed-window", _WindowFixedInTheLayer
    backend.capabilities = dataclasses.replace(backend.capabilities, sliding_window=True)
    cases = ["check_causal_output_matches_reference", "check_decode_step_over_filled_cache_matches_reference",
             "check_sliding_window_output_matches_reference"]
    failed = {(r.case, r.params["variant"]): r.message
              for r in mha_harness.check(backend, cases=cases, isolate=False).failures()}
    without = ("a sliding window of 16 keys (each query sees its own position and the 15 before it) in a layer built "
               "without one")
    assert without in failed["check_causal_output_matches_reference", "square"]
    assert without in failed["check_decode_step_over_filled_cache_matches_reference", "five_new_queries"]
    assert "a sliding window of 16 keys where config.sliding_window = 8: a window fixed in the layer" in \
        failed["check_sliding_window_output_matches_reference", "new_queries_against_long_cache"]
    assert ("check_sliding_window_output_matches_reference", "mistral_grouped_query") not in failed  # w = 16 there


def test_search_draws_windows_and_finds_the_window_mutants(tmp_path):
    pytest.importorskip("hypothesis")
    from mha_harness.conformance.isolation import Target
    from mha_harness.conformance.search import MUTANT_SPEC, search_backend
    from mha_harness.implementations.mutants import mutant_backends
    clean = search_backend(Target(NumpyNaive(), "numpy-naive"), results=tmp_path / "clean", isolate=False,
                           max_examples=120, seed=0)
    assert clean.passed and clean.drew.get("a sliding window", 0) > 0, (clean.lines(), clean.drew)
    for mutant in (b for b in mutant_backends() if b.name in ("mutant-sliding-window-ignored",
                                                               "mutant-sliding-window-one-key-too-wide")):
        outcome = search_backend(Target(mutant, MUTANT_SPEC), results=tmp_path / mutant.name, isolate=False,
                                 max_examples=200, seed=0)
        assert not outcome.passed and outcome.example.get("sliding_window"), outcome.lines()
        assert mutant.mutant.message_mentions in outcome.message, outcome.message


def test_jax_dpa_runs_its_window_through_local_window_size_and_jax_counts_that_from_the_querys_index():
    """jax.nn.dot_product_attention's ``local_window_size`` is top-left (its window mask compares each query's index
    in the call with the keys'): jax-dpa passes it only where a query's position is its index and folds the window
    into its mask elsewhere. A layer that passes it in a bottom-right call with fewer queries than keys (a KV-cache
    step) is named: the window, and the causal mask its right side of 0 makes, counted from the query's index."""
    pytest.importorskip("jax")
    from mha_harness.implementations.jax_dpa import JaxDpa, JaxDpaLoaded

    class LocalWindowEverywhere(JaxDpaLoaded):
        def native_inputs(self, inputs):
            w = self.config.sliding_window
            if w is None or inputs.causal is None:
                return super().native_inputs(inputs)
            full = super().native_inputs(inputs.replace(causal=None, key_padding_mask=None, attn_mask=None))
            mask = mha_harness.masks.combined_mask(inputs)
            return {**full, "mask": self.array(mask), "local_window": (w - 1, 0)}

    class Backend(JaxDpa):
        def load_native(self, params, dtype):
            return LocalWindowEverywhere(self, params, dtype)

    right = mha_harness.check(JaxDpa(), cases=WINDOW_CASES[:2], isolate=False)
    assert right.ok, [r.message for r in right.failures()]
    backend = Backend()
    backend.name = "jax-dpa-local-window-everywhere"
    failed = mha_harness.check(backend, cases=WINDOW_CASES[:1], isolate=False).failures()
    assert [r.params["variant"] for r in failed] == ["new_queries_against_long_cache"], failed
    assert "a sliding window and a causal mask both counted from each query's index in the call" in failed[0].message
    assert "local_window_size=(7, 0) is top-left" in failed[0].message, failed[0].message


def test_a_window_that_empties_a_row_is_not_offered_for_a_padding_mask_never_applied():
    """A layer that never masks its one padded key (Tq = 1, Tk = 2, uniform-average empty rows declared, as an
    outside user's Flax layer) sees both keys; a window of 1 key would leave its row with no key, whose uniform
    average of V lies within the margin of a softmax over two nearly equal scores. The window is not offered (it
    was, and named alone, in a layer built without one); the mask mistake is."""
    from mha_harness.conformance.diagnoses import mask_mistake
    from mha_harness.conformance.search_examples import build
    from mha_harness.contract.reference import empty_rows_as
    from mha_harness.contract.window_diagnoses import window_hint
    params, inputs = build({"dtype": "float32", "form": "shared_kv", "batch": 1, "tq": 1, "tk": 2, "heads": 1,
                            "kv_heads": 1, "d_head": 1, "bias": False, "causal": None,
                            "padding": {"valid": [1], "side": "end"}, "attn_mask": None, "seed": 0})
    got = reference_attention(params, inputs.replace(key_padding_mask=None)).output
    with empty_rows_as("uniform_average"):
        assert window_hint(got, params, inputs, 1.85e-7) == ""
        assert "the same call without key_padding_mask: the mask is not applied" in mask_mistake(got, params, inputs)
