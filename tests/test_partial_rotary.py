"""Partial rotary embeddings (``AttentionConfig.rotary_dims``, declared by ``Capabilities.partial_rotary``): GPT-NeoX's
and StableLM's rotary_pct, Phi's partial_rotary_factor and GPT-J's rotary_dim turn only each head's first features.
The reference against an independent implementation, the declarations, the backends, the grid row, search, and the
diagnoses of the width mistakes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, Capabilities
from mha_harness.contract.conventions import ROTARY_KINDS, rotary_positions
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention, reference_vjp
from tests.test_qk_norm import _finite_difference
from tests.test_rotary import assert_float64_layer_matches_reference

GRID = "check_output_matches_reference"


def _neox_partial_rotary(x, positions, base, kind, dims):
    """GPT-NeoX's split (``x[..., :rotary_ndims]`` turned, ``x[..., rotary_ndims:]`` passed), its inv_freq over the
    rotary_ndims; the turned part by rotate_half (half_split) or GPT-J's complex pairs (interleaved)."""
    rot, passed = x[..., :dims], x[..., dims:]
    angles = np.outer(positions, 1.0 / base ** (np.arange(0, dims, 2) / dims))
    if kind == "interleaved":
        pairs = rot.reshape(*rot.shape[:-1], dims // 2, 2)
        turned = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angles)
        rot = np.stack([turned.real, turned.imag], axis=-1).reshape(rot.shape)
    else:
        emb = np.concatenate([angles, angles], axis=-1)
        rot = rot * np.cos(emb) + np.concatenate([-rot[..., dims // 2:], rot[..., :dims // 2]], axis=-1) * np.sin(emb)
    return np.concatenate([rot, passed], axis=-1)


def _neox_attention(params, inputs, kind, base, dims):
    c = params.config
    heads = lambda y, n: y.reshape(*y.shape[:2], n, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q_pos, k_pos = rotary_positions(inputs.tq, inputs.tk)
    q = _neox_partial_rotary(heads(inputs.query @ params.W_q + params.b_q, c.num_heads), q_pos, base, kind, dims)
    k = _neox_partial_rotary(heads(inputs.key @ params.W_k + params.b_k, c.kv_heads), k_pos, base, kind, dims)
    k = np.repeat(k, c.group, axis=1)
    v = np.repeat(heads(inputs.value @ params.W_v + params.b_v, c.kv_heads), c.group, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(c.d_head)
    s = np.where(np.arange(inputs.tk)[None, :] <= np.arange(inputs.tq)[:, None] + inputs.tk - inputs.tq, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    o = (p / p.sum(axis=-1, keepdims=True)) @ v
    return o.transpose(0, 2, 1, 3).reshape(inputs.batch, inputs.tq, c.d_model) @ params.W_o + params.b_o


@pytest.mark.parametrize("kind", ROTARY_KINDS)
@pytest.mark.parametrize("dims", [2, 8, 12])
def test_the_references_partial_rotary_turns_the_first_features_over_their_own_frequencies(kind, dims):
    config = AttentionConfig(64, 4, 2, bias=True, rotary=kind, rotary_base=10_000.0, rotary_dims=dims)
    params = make_params(config, seed=2)
    for tq, tk in ((6, 6), (3, 9)):
        inputs = make_inputs(config, 2, tq, tk, seed=3, causal="bottom-right")
        np.testing.assert_allclose(reference_attention(params, inputs).output,
                                   _neox_attention(params, inputs, kind, 10_000.0, dims), atol=1e-12)
    # all of d_head is the full rotary; every width gives another output
    full = dataclasses.replace(config, rotary_dims=16)
    inputs = make_inputs(config, 1, 8, seed=4)
    unset = params.replace(config=dataclasses.replace(config, rotary_dims=None))
    np.testing.assert_array_equal(reference_attention(params.replace(config=full), inputs).output,
                                  reference_attention(unset, inputs).output)
    assert np.abs(reference_attention(params, inputs).output
                  - reference_attention(params.replace(config=full), inputs).output).max() > 1e-3


@pytest.mark.parametrize("kind", ROTARY_KINDS)
def test_the_references_backward_through_a_partial_rotary_is_the_derivative_of_its_forward(kind):
    config = AttentionConfig(16, 2, 1, bias=True, rotary=kind, rotary_dims=4, qk_norm="rms_per_head")
    params = make_params(config, seed=3)
    inputs = make_inputs(config, 2, 3, 5, causal="bottom-right")
    cotangent = np.random.default_rng(0).standard_normal((2, 3, 16))
    grads = reference_vjp(params, inputs, cotangent)
    for name in ("W_q", "W_k", "b_q", "b_k", "query", "key", "g_q", "g_k"):
        np.testing.assert_allclose(grads[name], _finite_difference(params, inputs, cotangent, name), rtol=1e-6,
                                   atol=1e-8, err_msg=name)


def test_a_malformed_rotary_width_is_refused_naming_rotary_dims_and_the_accepted_values():
    for dims in (3, 0, 18, 2.0, True, "8"):
        with pytest.raises(ValueError, match=r"rotary_dims: got .* with d_head = 16; accepted: None \(all of each "
                                             r"head's features turned\) or an even integer from 2 to 16"):
            AttentionConfig(32, 2, rotary="half_split", rotary_dims=dims)
    with pytest.raises(ValueError, match=r"rotary_dims: got 8 with rotary=None; accepted: None, or set rotary"):
        AttentionConfig(32, 2, rotary_dims=8)
    with pytest.raises(TypeError, match=r"Capabilities.partial_rotary: got 1 .*accepted: True or False"):
        Capabilities(partial_rotary=1)
    assert AttentionConfig(32, 2, rotary="interleaved", rotary_dims=16).partial_rotary is False
    assert AttentionConfig(32, 2, rotary="interleaved", rotary_dims=6).rotary_width == 6


def test_a_backend_refuses_a_partial_rotary_it_does_not_declare_naming_rotary_dims():
    from mha_harness.implementations.numpy_naive import NumpyNaive
    backend = type("FullRotaryOnly", (NumpyNaive,), {"name": "full-rotary-only",
                                                      "capabilities": Capabilities(rotary=ROTARY_KINDS)})()
    with pytest.raises(ValueError, match=r"rotary_dims: got 4 of d_head = 16 but full-rotary-only does not declare "
                                         r"Capabilities.partial_rotary; accepted: None or 16"):
        backend.load(make_params(AttentionConfig(32, 2, rotary="half_split", rotary_dims=4)))
    backend.load(make_params(AttentionConfig(32, 2, rotary="half_split", rotary_dims=16)))  # all of it: not partial
    report = mha_harness.check(backend, cases=[GRID], isolate=False)
    skipped = {r.params.get("variant"): r.message for r in report.results if r.status == "skipped"}
    assert "does not declare partial_rotary (rotary_dims = 32" in skipped["rotary_partial"], skipped


@pytest.mark.parametrize("backend_name", ["numpy-naive", "torch-eager"])
@pytest.mark.parametrize("kind", ROTARY_KINDS)
def test_the_backends_that_declare_a_partial_rotary_match_the_reference_forward_backward_and_decode_step(
        backend_name, kind):
    if backend_name == "torch-eager":
        pytest.importorskip("torch")
        from mha_harness.implementations.torch_eager import TorchEager as make
    else:
        from mha_harness.implementations.numpy_naive import NumpyNaive as make
    backend = make()
    assert backend.capabilities.partial_rotary
    config = AttentionConfig(80, 2, 1, bias=True, rotary=kind, rotary_base=10_000.0, rotary_dims=16)
    assert_float64_layer_matches_reference(backend, make_params(config, seed=5))


def test_the_partial_rotary_rows_run_for_a_backend_that_declares_one():
    from mha_harness.cases.agreement import _grid_variants
    from mha_harness.cases.gradients import _gradient_variants
    from mha_harness.implementations.torch_eager import TorchEager
    pytest.importorskip("torch")
    backend = TorchEager()
    partial = [v for v in _grid_variants(backend) if v.get("rotary_dims")]
    assert {v["dtype"] for v in partial} == set(backend.capabilities.dtypes)
    assert all(v["d_head"] == 80 and v["rotary_dims"] == 32 and "unsupported" not in v for v in partial)
    assert [v["rotary_dims"] for v in _gradient_variants(backend) if v.get("rotary_dims")] == [4]


class _AlwaysQuarterTurned:
    """A wrapped GPT-NeoX-style module whose rotary_pct (0.25) is fixed: it turns each head's first quarter whatever
    config.rotary_dims says."""

    @staticmethod
    def backend():
        from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

        class Loaded(NumpyNaiveLoaded):
            def rotary_width(self):
                return int(self.config.d_head * 0.25)

        return type("QuarterTurned", (NumpyNaive,), {"name": "quarter-turned", "loaded_class": Loaded,
                                                      "capabilities": Capabilities(dtypes=("float32",),
                                                                                   rotary=ROTARY_KINDS,
                                                                                   partial_rotary=True)})()


def test_a_layer_that_always_turns_a_quarter_of_each_head_is_told_to_read_rotary_dims_and_declare_it():
    """An outside user's GPT-NeoX wrapper with rotary_pct fixed at 0.25: its partial row (32 of 80 asked, 20 turned)
    was numbers only, and search's shrunk example (d_head 2, where a quarter turns nothing) said "no rotary at all:
    declare only the rotary the layer applies"."""
    failed = mha_harness.check(_AlwaysQuarterTurned.backend(), cases=[GRID], isolate=False).failures()
    assert {r.params["variant"] for r in failed} == {"rotary_half_split", "rotary_interleaved", "rotary_more_keys",
                                                     "rotary_other_base", "rotary_partial"}
    for r in failed:
        d_head, dims = r.params["d_head"], r.params.get("rotary_dims")
        asks = "None turns them all" if dims is None else f"{dims} turns the first {dims}"
        assert (f"the output matches rotary embeddings on the first {d_head // 4} of each head's {d_head} features "
                f"only, where config.rotary_dims = {asks}") in r.message, r.message
        assert "declare Capabilities(partial_rotary=True)" in r.message
    from mha_harness.contract.rotary_diagnoses import rotary_hint
    config = AttentionConfig(2, 1, rotary="half_split")
    params, inputs = make_params(config, seed=1), make_inputs(config, 1, 3, 3, seed=1)
    got = reference_attention(params.replace(config=AttentionConfig(2, 1)), inputs).output
    assert "; or, at this d_head of 2, a partial rotary whose fraction is fixed in the layer turns no feature" \
        in rotary_hint(got, params, inputs, 1e-7)


def test_the_partial_rotary_mutants_are_named_by_the_grid():
    from mha_harness.implementations.mutants import mutant_backends
    mutants = [b for b in mutant_backends() if b.name.startswith("mutant-rotary-partial-")]
    assert len(mutants) == 2
    for mutant in mutants:
        failed = mha_harness.check(mutant, cases=[GRID], isolate=False).failures()
        assert [r.params["variant"] for r in failed] == ["rotary_partial"], (mutant.name, failed)
        assert mutant.mutant.message_mentions in failed[0].message, failed[0].message


def test_search_draws_partial_rotary_widths_and_finds_both_partial_mutants(tmp_path):
    pytest.importorskip("hypothesis")
    from mha_harness.conformance.isolation import Target
    from mha_harness.conformance.search import MUTANT_SPEC, search_backend
    from mha_harness.implementations.mutants import mutant_backends
    from mha_harness.implementations.numpy_naive import NumpyNaive
    clean = search_backend(Target(NumpyNaive(), "numpy-naive"), results=tmp_path / "clean", isolate=False,
                           max_examples=120, seed=0)
    assert clean.passed and clean.drew.get("a partial rotary", 0) > 0, (clean.lines(), clean.drew)
    for mutant in (b for b in mutant_backends() if b.name.startswith("mutant-rotary-partial-")):
        outcome = search_backend(Target(mutant, MUTANT_SPEC), results=tmp_path / mutant.name, isolate=False,
                                 max_examples=200, seed=0)
        assert not outcome.passed and outcome.example.get("rotary_dims"), outcome.lines()
        assert mutant.mutant.message_mentions in outcome.message, outcome.message


def test_the_decode_step_and_gradients_run_a_partial_and_a_rescaled_rotary_and_catch_their_mutants():
    """The cache path turns with the layer's width and frequencies too: a decode-step variant for each, and a
    gradient variant for the rescaling."""
    pytest.importorskip("torch")
    from mha_harness.cases.decode_step import _step_variants
    from mha_harness.cases.gradients import _gradient_variants
    from mha_harness.implementations.mutants import mutant_backends
    from mha_harness.implementations.torch_eager import TorchEager
    steps = {v["variant"]: v for v in _step_variants(TorchEager())}
    assert steps["rotary_partial"]["rotary_dims"] == 4
    assert {"rotary_scaled_llama3", "rotary_scaled_linear", "rotary_scaled_yarn"} <= set(steps)
    assert [v["rotary_scaling"] for v in _gradient_variants(TorchEager()) if v.get("rotary_scaling")] == ["linear"]
    step = "check_decode_step_over_filled_cache_matches_reference"
    assert mha_harness.check(TorchEager(), cases=[step, "check_gradients_match_reference"], isolate=False).ok
    for name, variants in (("mutant-rotary-partial-whole-head", {"rotary_partial"}),
                           ("mutant-rotary-scaling-ignored", {"rotary_scaled_llama3", "rotary_scaled_linear",
                                                              "rotary_scaled_yarn"})):
        mutant = next(b for b in mutant_backends() if b.name == name)
        failed = mha_harness.check(mutant, cases=[step], isolate=False).failures()
        assert {r.params["variant"] for r in failed} == variants, (name, [r.params["variant"] for r in failed])
        assert all(mutant.mutant.message_mentions in r.message for r in failed), [r.message for r in failed]
