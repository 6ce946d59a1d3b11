"""Layers as many current models write them (no biases, grouped-query heads, always causal, called with one x) get
the same coverage as the others: a stranger's Llama-style layer lost the grid's grouped-query row to a bias skip,
its padding cases checked nothing under top-left causal with right padding, its tiled key/value heads were caught
but not named, and a small input that two mask mistakes explain alike was pinned on one of them."""
from __future__ import annotations

import dataclasses

import numpy as np

import mha_harness
import mha_harness.implementations.numpy_naive
from mha_harness.cases.agreement import GRID
from mha_harness.conformance.casekit import all_cases
from mha_harness.conformance.diagnoses import mask_mistake, wrong_layer_output
from mha_harness.contract.api import AttentionConfig, AttentionInputs
from mha_harness.contract.params import make_params
from mha_harness.implementations.mutants import MUTANTS
from mha_harness.implementations.mutants.zoo import MutantBackend, PaddingIgnored

BY_NAME = {m.name: m for m in MUTANTS}


def _llama_style(mutant_name: str, *, always_causal: bool = False) -> MutantBackend:
    """A mutant declared as a bias-free layer (and, if asked, an always top-left causal one with one x)."""
    backend = MutantBackend(BY_NAME[mutant_name], weights=False)
    extra = dict(always_causal=True, causal_alignments=("top-left",), inputs="self") if always_causal else {}
    backend.capabilities = dataclasses.replace(backend.capabilities, bias=False, **extra)
    return backend


def test_a_bias_free_backend_runs_every_grid_row_without_biases():
    backend = _llama_style("mutant-no-scale")
    backend.capabilities = dataclasses.replace(backend.capabilities, max_seq_len=None)  # the zoo stops at 512
    variants = all_cases()["check_output_matches_reference"].variants_for(backend)
    assert {v["variant"] for v in variants if "unsupported" not in v} == set(GRID)
    assert not any(v["bias"] for v in variants)


def test_tiled_key_value_heads_of_a_bias_free_layer_fail_the_grid_and_are_named():
    """The grid's grouped-query row was skipped for a bias-free layer ('does not declare capability bias'), so its
    forward output was never compared with grouped heads."""
    report = mha_harness.check(_llama_style("mutant-kv-heads-tiled"), cases=["check_output_matches_reference"])
    failed = [r for r in report.failures() if "grouped-query" in r.variant]
    assert failed and "h % kv_heads" in failed[0].message, [r.message[:200] for r in report.failures()]


def test_an_always_top_left_causal_layer_that_ignores_padding_fails_the_padding_cases():
    """With right padding only, top-left causal already hides every padded key from every real query: a layer that
    ignored the padding mask passed both padding cases. The left-padded batch item's real queries see them."""
    backend = _llama_style("mutant-padding-ignored", always_causal=True)
    names = ["check_padding_mask_blocks_padded_keys", "check_padding_mask_output_matches_reference"]
    report = mha_harness.check(backend, cases=names)
    assert {r.case for r in report.failures()} == set(names), [(r.case, r.status) for r in report.results]
    assert all("padding" in r.message for r in report.failures())


def test_two_mask_mistakes_that_give_the_same_output_are_both_named():
    """The search shrank a query-axis padding bug to Tq = Tk = 2, top-left causal, key 1 padded: there a reversed
    causal mask gives the same output (row 1 sees no key), and only that one was named."""
    config = AttentionConfig(2, 1)
    params = make_params(config, seed=3)
    x = np.random.default_rng(4).standard_normal((1, 2, 2))
    inputs = AttentionInputs(x, x, x, key_padding_mask=np.array([[False, True]]), causal="top-left")
    got = wrong_layer_output(params, inputs.replace(causal=None, key_padding_mask=None,
                                                    attn_mask=np.array([[True, False], [False, False]])))
    got[0, 1] = np.nan  # the row without a key, as a backend declaring fully_masked_rows:nan gives it
    message = mask_mistake(got, params, inputs)
    assert "cannot tell" in message and "reversed causal mask" in message and "query axis" in message, message


def test_a_mistake_only_one_hypothesis_explains_is_named_alone():
    config = AttentionConfig(8, 2)
    params = make_params(config, seed=5)
    x = np.random.default_rng(6).standard_normal((2, 6, 8))
    mask = np.zeros((2, 6), bool)
    mask[1, 3:] = True
    inputs = AttentionInputs(x, x, x, key_padding_mask=mask, causal="top-left")
    got = PaddingIgnored(params, "float64").compute(inputs).output
    message = mask_mistake(got, params, inputs)
    assert "cannot tell" not in message and "dropped when combined" in message, message


class _TilesOnlyWithMoreKeys(mha_harness.implementations.numpy_naive.NumpyNaiveLoaded):
    """Groups its key/value heads right at Tq == Tk and tiles them when there are more keys than queries: a
    KV-cache step's path with a filled cache (a stranger's `if Tk > T: k = k.repeat(1, n_rep, 1, 1)`)."""

    def attend(self, inputs, need_weights):
        self._tile = inputs.tk > inputs.tq
        return super().attend(inputs, need_weights)

    def expand_kv_heads(self, kv):
        return np.tile(kv, (1, self.config.group, 1, 1)) if self._tile else super().expand_kv_heads(kv)


def test_grouped_query_heads_wrong_only_with_more_keys_than_queries_fail_the_grid_without_gradients():
    """Every grouped-query row of the grid had Tq == Tk, so a layer that groups its heads wrongly only on the path
    with more keys (a KV-cache step with a filled cache, a cross-attention call) passed a check without gradients:
    the grid's ``grouped_query_more_keys`` row (7 queries, 64 keys) fails it and names the tiling."""
    from mha_harness.implementations.numpy_naive import NumpyNaive

    class Wrong(NumpyNaive):
        name = "tiles-only-with-more-keys"
        capabilities = dataclasses.replace(NumpyNaive.capabilities, gradients=False)

        def load_native(self, params, dtype):
            return _TilesOnlyWithMoreKeys(params, dtype)

    report = mha_harness.check(Wrong(), cases=["check_output_matches_reference"])
    failed = report.failures()
    # the rotary row with more keys has grouped-query heads too
    assert failed and all("grouped-query-more-keys" in r.variant or "rotary-more-keys" in r.variant
                          for r in failed), [r.variant for r in failed]
    assert any("grouped-query-more-keys" in r.variant for r in failed)
    assert all("h % kv_heads" in r.message for r in failed), [r.message[:300] for r in failed]
