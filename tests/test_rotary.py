"""Rotary position embeddings: the reference, the declarations, the backends that declare them, the cases and the
diagnoses of the rotary mistakes people make."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, Capabilities
from mha_harness.contract.conventions import ROTARY_KINDS, rotary_positions
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention, reference_vjp, reference_vjp_magnitudes
from tests.test_qk_norm import _finite_difference

GRID = "check_output_matches_reference"


def _llama_rotary(x, positions, base, kind, inv_freq=None):
    """An independent rotary: Hugging Face's rotate_half (half_split), or Meta's complex multiplication
    (interleaved), on (batch, heads, T, d_head) heads (``inv_freq``: frequencies of its own instead of base's)."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (np.arange(0, d, 2) / d) if inv_freq is None else inv_freq
    angles = np.outer(positions, inv_freq)
    if kind == "interleaved":
        pairs = x.reshape(*x.shape[:-1], d // 2, 2)
        turned = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angles)
        return np.stack([turned.real, turned.imag], axis=-1).reshape(x.shape)
    emb = np.concatenate([angles, angles], axis=-1)
    rotate_half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def _attention_with_rotary(params, inputs, kind, base):
    c = params.config
    heads = lambda y, n: y.reshape(*y.shape[:2], n, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q_pos, k_pos = rotary_positions(inputs.tq, inputs.tk)
    q = _llama_rotary(heads(inputs.query @ params.W_q, c.num_heads), q_pos, base, kind)
    k = np.repeat(_llama_rotary(heads(inputs.key @ params.W_k, c.kv_heads), k_pos, base, kind), c.group, axis=1)
    v = np.repeat(heads(inputs.value @ params.W_v, c.kv_heads), c.group, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(c.d_head)
    if inputs.causal:
        s = np.where(np.arange(inputs.tk)[None, :] <= np.arange(inputs.tq)[:, None] + inputs.tk - inputs.tq, s,
                     -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    o = (p / p.sum(axis=-1, keepdims=True)) @ v
    return o.transpose(0, 2, 1, 3).reshape(inputs.batch, inputs.tq, c.d_model) @ params.W_o


@pytest.mark.parametrize("kind", ROTARY_KINDS)
@pytest.mark.parametrize("base", [10_000.0, 500_000.0])
def test_the_references_rotary_is_llamas_rotate_half_or_metas_complex_turn_at_the_last_positions(kind, base):
    config = AttentionConfig(32, 4, 2, rotary=kind, rotary_base=base)
    params = make_params(config, seed=2)
    for tq, tk, causal in ((6, 6, None), (3, 9, "bottom-right")):
        inputs = make_inputs(config, 2, tq, tk, seed=3, causal=causal)
        np.testing.assert_allclose(reference_attention(params, inputs).output,
                                   _attention_with_rotary(params, inputs, kind, base), atol=1e-12)
        rows = [0, tq - 1]
        np.testing.assert_allclose(reference_attention(params, inputs, rows=rows).output,
                                   reference_attention(params, inputs).output[:, rows], atol=1e-14)


def test_the_two_pairings_and_two_bases_give_different_outputs_and_no_rotary_another():
    outputs = []
    for kind, base in ((None, 10_000.0), ("half_split", 10_000.0), ("interleaved", 10_000.0),
                       ("half_split", 1_000_000.0)):
        config = AttentionConfig(32, 2, rotary=kind, rotary_base=base)
        outputs.append(reference_attention(make_params(config, seed=1), make_inputs(config, 1, 12, seed=1)).output)
    for i in range(len(outputs)):
        for j in range(i):
            assert np.abs(outputs[i] - outputs[j]).max() > 1e-3, (i, j)


@pytest.mark.parametrize("kind", ROTARY_KINDS)
@pytest.mark.parametrize("qk_norm", [None, "rms_per_head"])
def test_the_references_backward_through_the_rotary_is_the_derivative_of_its_forward(kind, qk_norm):
    config = AttentionConfig(8, 2, 1, bias=True, rotary=kind, qk_norm=qk_norm)
    params = make_params(config, seed=3)
    inputs = make_inputs(config, 2, 3, 5, causal="bottom-right")
    cotangent = np.random.default_rng(0).standard_normal((2, 3, 8))
    grads = reference_vjp(params, inputs, cotangent)
    for name in ("W_q", "W_k", "b_q", "b_k", "query", "key", *(("g_q", "g_k") if qk_norm else ())):
        fd = _finite_difference(params, inputs, cotangent, name)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-6, atol=1e-8, err_msg=name)
    for name, low in reference_vjp(params, inputs, cotangent, "float32").items():
        np.testing.assert_allclose(low, grads[name], rtol=1e-3, atol=1e-4, err_msg=name)
    magnitudes = reference_vjp_magnitudes(params, inputs, cotangent)
    assert all(np.all(np.isfinite(m)) and m.shape == grads[n].shape for n, m in magnitudes.items())
    # at position 0 (one query, one key) nothing turns: the terms are those of the layer without rotary
    one = make_inputs(config, 2, 1, 1)
    plain = params.replace(config=AttentionConfig(8, 2, 1, bias=True, qk_norm=qk_norm))
    for name, m in reference_vjp_magnitudes(params, one, cotangent[:, :1]).items():
        np.testing.assert_allclose(m, reference_vjp_magnitudes(plain, one, cotangent[:, :1])[name], rtol=1e-12)


def test_a_malformed_rotary_declaration_is_refused_naming_the_parameter_and_the_accepted_values():
    with pytest.raises(ValueError, match=r"rotary: got 'rope'; accepted: None .*'half_split', 'interleaved'"):
        AttentionConfig(16, 2, rotary="rope")
    with pytest.raises(ValueError, match=r"rotary: got 'half_split' with d_head = 3; accepted: an even d_head"):
        AttentionConfig(6, 2, rotary="half_split")
    for base in (1.0, float("inf"), "10000", True):
        with pytest.raises(ValueError, match=r"rotary_base: got .*; accepted: a finite number > 1"):
            AttentionConfig(16, 2, rotary="half_split", rotary_base=base)
    with pytest.raises(ValueError, match=r"Capabilities.rotary: .*'half_split'"):
        Capabilities(rotary=("rope",))
    with pytest.raises((TypeError, ValueError), match=r"Capabilities.rotary"):
        Capabilities(rotary="half_split")


def test_a_backend_refuses_a_rotary_it_does_not_declare_naming_the_accepted_values():
    from mha_harness.implementations.numpy_tiled import NumpyTiled
    params = make_params(AttentionConfig(16, 2, rotary="interleaved"))
    with pytest.raises(ValueError, match=r"rotary: got 'interleaved' but numpy-tiled declares no rotary position "
                                         r"embeddings \(Capabilities.rotary is empty\); accepted: None"):
        NumpyTiled().load(params)


@pytest.mark.parametrize("backend_name", ["numpy-naive", "torch-eager"])
@pytest.mark.parametrize("kind", ROTARY_KINDS)
def test_the_backends_that_declare_rotary_match_the_reference_forward_backward_and_decode_step(backend_name, kind):
    if backend_name == "torch-eager":
        pytest.importorskip("torch")
    if backend_name == "numpy-naive":
        from mha_harness.implementations.numpy_naive import NumpyNaive as make
    else:
        from mha_harness.implementations.torch_eager import TorchEager as make
    config = AttentionConfig(32, 4, 2, bias=True, rotary=kind, rotary_base=500_000.0)
    assert_float64_layer_matches_reference(make(), make_params(config, seed=5))


def assert_float64_layer_matches_reference(backend, params):
    """The backend's float64 layer equals the reference to 1e-12 (its gradients to 1e-11) at Tq = Tk and at Tq < Tk
    (bottom-right causal), and so does its decode step over the same call."""
    from mha_harness.contract.api import as_kv_cache_call
    loaded = backend.load(params, dtype="float64")
    for tq, tk in ((7, 7), (3, 11)):
        inputs = make_inputs(params.config, 2, tq, tk, seed=6, causal="bottom-right")
        want = reference_attention(params, inputs).output
        np.testing.assert_allclose(loaded.forward(inputs).output, want, atol=1e-12)
        cached = as_kv_cache_call(inputs)
        np.testing.assert_allclose(np.asarray(loaded.prepare_decode_step(cached)(), np.float64),
                                   reference_attention(params, cached).output, atol=1e-12)
        if backend.capabilities.gradients:
            cotangent = np.random.default_rng(1).standard_normal(want.shape)
            got = loaded.vjp(inputs, cotangent)
            for name, grad in reference_vjp(params, inputs, cotangent).items():
                np.testing.assert_allclose(got[name], grad, atol=1e-11, err_msg=name)


class _RotaryKeptOn:
    """A wrapped Llama-style module that turns q and k at positions 0 .. T - 1 (rotate_half, base 10,000) whatever
    the config says: the wrapper never gave every token one position."""

    @staticmethod
    def loaded():
        from mha_harness.implementations.numpy_naive import NumpyNaiveLoaded

        class Loaded(NumpyNaiveLoaded):
            def rotate(self, x, positions, which):
                if self.config.rotary is not None or self.config.d_head % 2:
                    return super().rotate(x, positions, which)
                import dataclasses
                real = self.config
                self.config = dataclasses.replace(real, rotary="half_split")
                try:
                    return super().rotate(x, positions, which)
                finally:
                    self.config = real
        return Loaded


def test_a_layer_that_turns_q_and_k_without_rotary_in_the_config_is_told_to_give_one_position_or_declare_it():
    from mha_harness.implementations.numpy_naive import NumpyNaive
    backend = type("RotaryKeptOn", (NumpyNaive,), {"name": "rotary-kept-on", "loaded_class": _RotaryKeptOn.loaded(),
                                                    "capabilities": Capabilities(dtypes=("float32",))})()
    report = mha_harness.check(backend, cases=[GRID], isolate=False)
    failed = report.failures()
    assert failed and all(r.params["seq"] > 1 or r.params["tk"] > 1 for r in failed)
    named = [r for r in failed if "the output matches rotary embeddings ('half_split', base 10000) in a layer built "
             "without them: give every token, cached and new, one and the same position" in r.message]
    assert len(named) >= len(failed) - 1, [r.message for r in failed if r not in named]


def test_the_rotary_rows_skip_naming_the_capability_for_a_backend_without_rotary():
    from mha_harness.implementations.numpy_tiled import NumpyTiled
    report = mha_harness.check(NumpyTiled(), cases=[GRID], isolate=False)
    skipped = {r.params.get("variant"): r.message for r in report.results if r.status == "skipped"}
    assert {"rotary_half_split", "rotary_interleaved", "rotary_more_keys", "rotary_qk_norm_per_head"} <= set(skipped)
    assert "does not declare rotary 'half_split' (Capabilities.rotary" in skipped["rotary_half_split"]


def test_each_rotary_mutant_is_caught_and_named_by_the_grid_the_decode_step_and_the_gradients():
    from mha_harness.implementations.mutants import mutant_backends
    mutants = [b for b in mutant_backends() if b.name.startswith("mutant-rotary-")
               and not b.name.startswith(("mutant-rotary-partial-", "mutant-rotary-scaling-"))
               and b.name != "mutant-rotary-left-out-on-causal-path"]
    # the partial rotary's two and the rescaling's: test_partial_rotary, test_rotary_scaling; the causal path's, whose
    # rotary is right in these cases (they carry no causal mask): test_causal_layer_features
    assert len(mutants) == 6
    for mutant in mutants:
        report = mha_harness.check(mutant, cases=[GRID, "check_decode_step_over_filled_cache_matches_reference",
                                                  "check_gradients_match_reference"], isolate=False)
        failed = report.failures()
        assert failed and all(mutant.mutant.message_mentions in r.message for r in failed), \
            (mutant.name, [r.message for r in failed])


def test_q_k_norm_gains_loaded_into_each_others_norms_are_named_in_the_forward_of_a_rotary_layer():
    """Without rotary they give the same scores (only the gradients show them); the turned pairs mix features."""
    import dataclasses

    from mha_harness.implementations.mutants import mutant_backends
    mutant = next(b for b in mutant_backends() if b.name == "mutant-qk-norm-gains-swapped")
    mutant.capabilities = dataclasses.replace(mutant.capabilities, rotary=ROTARY_KINDS)
    failed = mha_harness.check(mutant, cases=[GRID], isolate=False).failures()
    assert [r.params["variant"] for r in failed] == ["rotary_qk_norm_per_head"]
    assert "the q/k norms' gains loaded into each other's norms" in failed[0].message, failed[0].message


class _NewTokensFromZero:
    """A Hugging Face-style KV-cache step given position_ids = arange(Tq): its queries and the keys of its new tokens
    (the last Tq) are turned from position 0, the cached keys at their own positions."""

    @staticmethod
    def backend():
        from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

        class Loaded(NumpyNaiveLoaded):
            def positions(self, tq, tk):
                return np.arange(tq), np.concatenate([np.arange(tk - tq), np.arange(tq)])

        return type("NewTokensFromZero", (NumpyNaive,), {"name": "new-tokens-from-zero", "loaded_class": Loaded,
                                                          "capabilities": Capabilities(dtypes=("float32",),
                                                                                       rotary=ROTARY_KINDS)})()


def test_a_step_that_turns_its_new_tokens_from_position_zero_is_named_with_its_keys_too():
    """An outside user's Hugging Face copy: position_ids = arange(Tq) turns the new keys with the queries (one
    cos/sin), which "the queries turned from 0" alone did not match."""
    failed = mha_harness.check(_NewTokensFromZero.backend(), cases=[GRID], isolate=False).failures()
    assert [r.params["variant"] for r in failed] == ["rotary_more_keys"]
    assert "the new tokens' rotary embeddings, the queries' and their own keys'" in failed[0].message, \
        failed[0].message


def test_mistakes_that_give_a_call_the_same_output_are_named_together_the_specific_one_first():
    """At one new query and one cached key both positions are 0 when the new tokens are turned from 0: no rotary at
    all gives the same output, and search's shrunk example said only that, with the advice to declare no rotary."""
    from mha_harness.contract.reference import rotary_mistaken
    from mha_harness.contract.rotary_diagnoses import rotary_hint
    config = AttentionConfig(8, 1, rotary="half_split")
    params = make_params(config, seed=1)
    inputs = make_inputs(config, 1, 1, 2, seed=1)
    with rotary_mistaken("new_tokens_from_zero"):
        got = reference_attention(params, inputs).output
    hint = rotary_hint(got, params, inputs, 1e-6)
    assert hint.startswith("; the output matches the new tokens' rotary embeddings"), hint
    assert "; or, the same output at this call, no rotary embeddings at all" in hint, hint


def test_a_layer_with_only_the_interleaved_pairing_runs_the_rows_with_more_keys_and_a_norm_in_it():
    """The rows without a pairing of their own take the first declared (an outside user's Meta-style layer got no
    Tq != Tk row)."""
    from mha_harness.cases.agreement import _grid_variants
    from mha_harness.implementations.numpy_naive import NumpyNaive
    backend = type("Interleaved", (NumpyNaive,), {"name": "interleaved-only", "capabilities": Capabilities(
        dtypes=("float32",), rotary=("interleaved",), qk_norms=("rms_per_head",))})()
    rows = {v["variant"]: v for v in _grid_variants(backend) if v["variant"].startswith("rotary_")}
    assert rows["rotary_more_keys"]["rotary"] == rows["rotary_qk_norm_per_head"]["rotary"] == "interleaved"
    assert "unsupported" in rows["rotary_half_split"] and "unsupported" not in rows["rotary_more_keys"]


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_one_weight_alone_permuted_between_the_pairings_is_named(which, kv_heads):
    """An outside user's copy loaded an interleaved layer into Hugging Face's rotate_half module permuting W_q's
    columns (transformers' [0, 2, ..., 1, 3, ...] per head) and not W_k's: numbers only before."""
    import dataclasses

    from mha_harness.contract.rotary_diagnoses import pairing_permutation, rotary_hint
    config = AttentionConfig(32, 4, kv_heads, bias=True, rotary="interleaved", rotary_base=500_000.0)
    params = make_params(config, seed=1)
    inputs = make_inputs(config, 2, 6, 9, seed=2)
    order = pairing_permutation(config)
    permuted = {f"W_{which}": getattr(params, f"W_{which}")[:, order[:getattr(params, f"W_{which}").shape[1]]],
                f"b_{which}": getattr(params, f"b_{which}")[order[:getattr(params, f"b_{which}").shape[0]]]}
    module = params.replace(config=dataclasses.replace(config, rotary="half_split"), **permuted)
    got = reference_attention(module, inputs).output  # the rotate_half module with one side permuted
    assert rotary_hint(got, params, inputs, 1e-6).startswith(
        "; the output matches W_q's and W_k's columns in different orders within each head: one of them (with its "
        "bias) permuted between the two pairings"), rotary_hint(got, params, inputs, 1e-6)


def _one_x_half_split(name: str, loaded):
    """A one-x (self-attention) layer of Hugging Face's pairing alone, without gradients, as an outside user's
    hand-written JAX Llama layer declared itself; ``loaded``: its NumpyNaiveLoaded with a rotary mistake."""
    from mha_harness.implementations.numpy_naive import NumpyNaive
    caps = Capabilities(inputs="self", cross_attention=False, more_queries_than_keys=False, dtypes=("float32",),
                        rotary=("half_split",))
    return type(name, (NumpyNaive,), {"name": name, "loaded_class": loaded, "capabilities": caps})()


def test_a_one_x_layer_of_one_pairing_runs_a_rotary_row_at_another_base_and_a_hard_coded_base_fails():
    """An outside user's one-x half_split layer ran the grid's base-10,000 row alone (the other rotary rows need
    Tq != Tk, the other pairing or a q/k norm), and with its base hard-coded to 10,000 it passed `check --quick`.
    ``rotary_other_base`` turns the declared pairing at the base its own row does not use."""
    import dataclasses

    from mha_harness.cases.agreement import OTHER_BASE, ROTARY_GRID, _grid_variants
    from mha_harness.implementations.numpy_naive import NumpyNaiveLoaded

    own = {kind: ROTARY_GRID[f"rotary_{kind}"][9] for kind in ROTARY_KINDS}
    assert all(OTHER_BASE[kind] != own[kind] for kind in ROTARY_KINDS)

    class BaseTenThousand(NumpyNaiveLoaded):
        def rotate(self, x, positions, which):
            real = self.config
            self.config = dataclasses.replace(real, rotary_base=10_000.0) if real.rotary else real
            try:
                return super().rotate(x, positions, which)
            finally:
                self.config = real

    backend = _one_x_half_split("base-hard-coded", BaseTenThousand)
    ran = [v["variant"] for v in _grid_variants(backend) if v["variant"].startswith("rotary_")
           and "unsupported" not in v]
    assert ran == ["rotary_half_split", "rotary_other_base"], ran
    failed = mha_harness.check(backend, cases=[GRID], isolate=False).failures()
    assert [r.params["variant"] for r in failed] == ["rotary_other_base"]
    assert "the output matches rotary embeddings built with base 10000 where config.rotary_base is 500000" \
        in failed[0].message, failed[0].message


@pytest.mark.parametrize("shift, words", [(1, "one position later"), (-1, "one position earlier")])
def test_keys_turned_one_position_off_the_queries_are_named(shift, words):
    """An outside user's layer turned its keys at position + 1: 38 failures, none naming it (only "every row that
    sees several keys is wrong")."""
    from mha_harness.implementations.numpy_naive import NumpyNaiveLoaded

    class KeysOff(NumpyNaiveLoaded):
        def positions(self, tq, tk):
            q_pos, k_pos = super().positions(tq, tk)
            return q_pos, k_pos + shift

    failed = mha_harness.check(_one_x_half_split("keys-off", KeysOff), cases=[GRID], isolate=False).failures()
    assert {r.params["variant"] for r in failed} == {"rotary_half_split", "rotary_other_base"}
    assert all(f"the keys' rotary embeddings turned {words} than the queries'" in r.message for r in failed), \
        [r.message for r in failed]
