"""The causal output case runs a layer's declared rotary embeddings and q/k norm under the causal mask (its
``_with_features`` variants): the grid runs those features without a mask, and an outside user's Qwen 3 layer whose
causal path left out its rotary and norms passed every case of ``check --quick`` (``search`` found it)."""
from __future__ import annotations

import numpy as np

import mha_harness
from mha_harness.cases._fixtures import causal_output_variants, declared_layer_features
from mha_harness.implementations.mutants import mutant_backends
from mha_harness.implementations.mutants.zoo import CausalPathLoaded
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.implementations.numpy_tiled import NumpyTiled

CASE = "check_causal_output_matches_reference"
#: the zoo's mutant whose causal path never turns q and k
ROTARY_LEFT_OUT = "mutant-rotary-left-out-on-causal-path"


class _CausalPathSkipsNorm(CausalPathLoaded):
    def qk_norm(self, y, which):
        return y if self.causal else super().qk_norm(y, which)


class CausalPathSkipsNorm(NumpyNaive):
    name = "causal-path-skips-norm"
    loaded_class = _CausalPathSkipsNorm


def test_a_layer_declaring_rotary_or_a_norm_gets_causal_variants_with_them_and_a_plain_one_none():
    """numpy-naive (every rotary and norm, grouped-query heads) gets Qwen 3's layer under each alignment; numpy-tiled
    (neither) gets no extra variant."""
    features = declared_layer_features(NumpyNaive())
    assert features == {"rotary": "half_split", "rotary_base": 1_000_000.0, "qk_norm": "rms_per_head",
                        "kv_heads": 2}, features
    named = {(v["variant"], v["alignment"]) for v in causal_output_variants(NumpyNaive())
             if v["variant"].endswith("_with_features")}
    assert named == {("square_with_features", "top-left"), ("more_keys_with_features", "top-left"),
                     ("more_keys_with_features", "bottom-right")}, named
    assert declared_layer_features(NumpyTiled()) == {}
    assert not [v for v in causal_output_variants(NumpyTiled()) if v["variant"].endswith("_with_features")]


def test_a_causal_path_without_its_rotary_or_its_norm_fails_the_feature_variants_naming_the_mistake():
    """Each mutant passes the plain causal variants (its features are right without a mask, its mask right without
    features) and fails every ``_with_features`` variant, the message naming what its causal path leaves out; the
    correct layer passes them."""
    rotary_left_out = next(b for b in mutant_backends() if b.name == ROTARY_LEFT_OUT)
    for backend, named in ((rotary_left_out, "no rotary embeddings at all"),
                           (CausalPathSkipsNorm(), "no q/k norm at all")):
        results = mha_harness.check(backend, cases=[CASE], isolate=False).results
        failed = {r.params["variant"] for r in results if r.status == "failed"}
        assert failed == {"square_with_features", "more_keys_with_features"}, (backend.name, failed)
        messages = [r.message for r in results if r.status == "failed"]
        assert all(named in m for m in messages), messages
    correct = mha_harness.check(NumpyNaive(), cases=[CASE], isolate=False).results
    with_features = [r for r in correct if r.params["variant"].endswith("_with_features")]
    assert len(with_features) == 3 and all(r.status == "passed" for r in with_features), \
        [(r.params, r.message) for r in with_features]
    assert np.isfinite([r.max_error for r in with_features]).all()


def test_the_zoo_mutant_whose_causal_path_skips_rotary_is_caught_only_under_the_causal_mask():
    """``mutant-rotary-left-out-on-causal-path`` passes the grid's rotary rows (no causal mask) and fails the causal
    case's feature variants, named."""
    mutant = next(b for b in mutant_backends() if b.name == ROTARY_LEFT_OUT)
    results = mha_harness.check(mutant, cases=["check_output_matches_reference", CASE], isolate=False).results
    failed = [r for r in results if r.status == "failed"]
    assert {r.params["variant"] for r in failed} == {"square_with_features", "more_keys_with_features"}, \
        [(r.case, r.params.get("variant")) for r in failed]
    assert all(mutant.mutant.message_mentions in r.message for r in failed), [r.message for r in failed]
