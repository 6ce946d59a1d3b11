"""A norm on q and k (``AttentionConfig.qk_norm``, ``Capabilities.qk_norms``): the reference's forward and backward
through it, its validation, the cases that run it, the diagnoses of its mistakes, and search."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, AttentionParams, Capabilities
from mha_harness.contract.conventions import QK_NORMS
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention, reference_vjp, reference_vjp_magnitudes
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

GRID = "check_output_matches_reference"


def _finite_difference(params, inputs, cotangent, name, step=1e-6):
    """d sum(output * cotangent) / d ``name`` (a parameter or an input array) by central differences."""
    source = params if name in params.arrays() else inputs
    array = getattr(source, name)
    grad = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        def loss(delta, index=index):
            changed = array.copy()
            changed[index] += delta
            p, x = (params.replace(**{name: changed}), inputs) if source is params \
                else (params, inputs.replace(**{name: changed}))
            return float((reference_attention(p, x).output * cotangent).sum())
        grad[index] = (loss(step) - loss(-step)) / (2 * step)
    return grad


@pytest.mark.parametrize("kind", QK_NORMS)
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_the_references_backward_through_the_qk_norm_is_the_derivative_of_its_forward(kind, kv_heads):
    config = AttentionConfig(8, 4, kv_heads, bias=True, qk_norm=kind)
    params = make_params(config, seed=3)
    inputs = make_inputs(config, 2, 3, 4, causal="bottom-right")
    cotangent = np.random.default_rng(0).standard_normal((2, 3, 8))
    grads = reference_vjp(params, inputs, cotangent)
    norm_params = [n for n in ("g_q", "g_k", "beta_q", "beta_k") if n in params.arrays()]
    assert set(params.arrays()) <= set(grads) and len(norm_params) == (4 if kind == "layer_per_head" else 2)
    for name in (*norm_params, "W_q", "W_k", "b_q", "b_k", "query", "key"):
        fd = _finite_difference(params, inputs, cotangent, name)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-6, atol=1e-8, err_msg=name)
    magnitudes = reference_vjp_magnitudes(params, inputs, cotangent)
    for name in norm_params:
        assert magnitudes[name].shape == grads[name].shape and np.all(magnitudes[name] > 0)


@pytest.mark.parametrize("kind, torch_norm", [("rms_per_head", "rms_norm"), ("layer_per_head", "layer_norm"),
                                              ("layer_per_head_no_bias", "layer_norm")])
def test_the_references_per_head_norm_is_torchs_norm_of_each_head(kind, torch_norm):
    """rms_per_head is torch's RMSNorm of each head; layer_per_head its LayerNorm with beta_q, beta_k as its biases,
    layer_per_head_no_bias its LayerNorm without."""
    torch = pytest.importorskip("torch")
    norm = getattr(torch.nn.functional, torch_norm)
    config = AttentionConfig(32, 4, 2, qk_norm=kind, qk_norm_eps=1e-5)
    params = make_params(config, seed=2)
    inputs = make_inputs(config, 2, 5, 6)
    t = {n: torch.tensor(a) for n, a in params.arrays().items()}
    q = (torch.tensor(inputs.query) @ t["W_q"]).view(2, 5, 4, 8)
    k = (torch.tensor(inputs.key) @ t["W_k"]).view(2, 6, 2, 8)
    v = (torch.tensor(inputs.value) @ t["W_v"]).view(2, 6, 2, 8)
    biases = [{"bias": t[f"beta_{w}"]} if f"beta_{w}" in t else {} for w in "qk"]
    q = norm(q, (8,), t["g_q"], eps=1e-5, **biases[0]).transpose(1, 2)
    k = norm(k, (8,), t["g_k"], eps=1e-5, **biases[1]).transpose(1, 2).repeat_interleave(2, dim=1)
    v = v.transpose(1, 2).repeat_interleave(2, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32) @ t["W_o"]
    np.testing.assert_allclose(reference_attention(params, inputs).output, out.numpy(), atol=1e-12)


def test_make_params_draws_the_norms_gains_after_every_other_array():
    plain = make_params(AttentionConfig(16, 2, bias=True), seed=4)
    normed = make_params(AttentionConfig(16, 2, bias=True, qk_norm="rms_over_projection"), seed=4)
    for name, array in plain.arrays().items():
        np.testing.assert_array_equal(getattr(normed, name), array)
    assert normed.g_q.shape == (16,) and normed.g_k.shape == (16,)
    assert np.all((normed.g_q >= 0.5) & (normed.g_q <= 1.5)) and np.ptp(normed.g_q) > 0.1


def test_the_expected_parameter_count_adds_one_gain_vector_per_norm():
    assert AttentionConfig(64, 8, 2, qk_norm="rms_per_head").expected_parameter_count() \
        == AttentionConfig(64, 8, 2).expected_parameter_count() + 2 * 8
    assert AttentionConfig(64, 8, 2, qk_norm="rms_over_projection").expected_parameter_count() \
        == AttentionConfig(64, 8, 2).expected_parameter_count() + 64 + 16


@pytest.mark.parametrize("make, names", [
    (lambda: AttentionConfig(16, 2, qk_norm="rms"), ("qk_norm", "'rms_per_head'", "'rms_over_projection'")),
    (lambda: AttentionConfig(16, 2, qk_norm="rms_per_head", qk_norm_eps=-1.0), ("qk_norm_eps", ">= 0")),
    (lambda: Capabilities(qk_norms=("layer_norm",)), ("qk_norms", "'rms_per_head'")),
    (lambda: Capabilities(qk_norms="rms_per_head"), ("qk_norms", "a tuple")),
])
def test_a_malformed_qk_norm_declaration_is_refused_naming_the_parameter_and_the_accepted_values(make, names):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    for name in names:
        assert name in str(info.value)


def test_the_norms_gains_must_be_given_exactly_when_the_config_has_a_norm():
    plain = make_params(AttentionConfig(16, 2), seed=0)
    normed = make_params(AttentionConfig(16, 2, qk_norm="rms_per_head"), seed=0)
    with pytest.raises(ValueError, match=r"g_q: got None; accepted: an array of shape \(8,\) \(config.qk_norm"):
        AttentionParams(normed.config, W_q=plain.W_q, W_k=plain.W_k, W_v=plain.W_v, W_o=plain.W_o)
    with pytest.raises(ValueError, match="g_q: got an array but config.qk_norm is None; accepted: None"):
        AttentionParams(plain.config, W_q=plain.W_q, W_k=plain.W_k, W_v=plain.W_v, W_o=plain.W_o, g_q=normed.g_q,
                        g_k=normed.g_k)
    with pytest.raises(ValueError, match=r"g_k: got shape \(16,\); accepted: \(8,\)"):
        normed.replace(g_k=np.ones(16))


def test_a_backend_refuses_a_norm_it_does_not_declare_naming_the_accepted_values():
    from mha_harness.implementations.numpy_tiled import NumpyTiled
    params = make_params(AttentionConfig(16, 2, qk_norm="rms_per_head"))
    with pytest.raises(ValueError, match=r"qk_norm: got 'rms_per_head' but numpy-tiled declares no norm on q and k "
                                         r"\(Capabilities.qk_norms is empty\); accepted: None"):
        NumpyTiled().load(params)


def test_the_grids_norm_rows_skip_naming_the_capability_for_a_backend_without_a_norm():
    from mha_harness.implementations.numpy_tiled import NumpyTiled
    report = mha_harness.check(NumpyTiled(), cases=[GRID], isolate=False)
    skipped = {r.params.get("variant"): r.message for r in report.results if r.status == "skipped"}
    assert {v for v in skipped if not v.startswith("rotary_")} == {
        "qk_norm_per_head", "qk_norm_over_projection", "qk_layer_norm_per_head", "qk_layer_norm_no_bias_per_head"}
    assert "does not declare qk_norms 'rms_per_head'" in skipped["qk_norm_per_head"]


def test_the_norm_runs_in_the_grid_the_gradients_and_the_parameter_count_of_a_backend_that_declares_it():
    pytest.importorskip("torch")
    from mha_harness.implementations.torch_eager import TorchEager
    report = mha_harness.check(TorchEager(), cases=[GRID, "check_gradients_match_reference",
                                                    "check_parameter_count_is_4_d_model_squared"], isolate=False)
    normed = [r for r in report.results if r.params.get("qk_norm")]
    assert {(r.case, r.params["qk_norm"]) for r in normed} == {
        (case, kind) for case in (GRID, "check_gradients_match_reference",
                                  "check_parameter_count_is_4_d_model_squared") for kind in QK_NORMS}
    assert all(r.status == "passed" for r in normed), [r.message for r in normed if r.status != "passed"]
    assert {r.params["dtype"] for r in normed if r.case == GRID} == set(TorchEager.capabilities.dtypes)


class _NormsKeptOn(NumpyNaiveLoaded):
    """A wrapped Qwen-3-style module whose norms (their initial unit gains) stay on whatever the config says."""

    def project(self, x, which):
        y = super().project(x, which)
        if which in ("q", "k") and self.config.qk_norm is None:
            b, t, width = y.shape
            heads = y.reshape(b, t, width // self.config.d_head, self.config.d_head)
            y = (heads / np.sqrt(np.mean(np.square(heads), axis=-1, keepdims=True) + 1e-6)).reshape(b, t, width)
        return y


class NormsKeptOn(NumpyNaive):
    name = "norms-kept-on"
    loaded_class = _NormsKeptOn


def test_a_layer_that_keeps_its_norms_on_without_a_norm_in_the_config_is_told_to_declare_and_build_them():
    """In every case that compares outputs, padded rows left out or large logits too (there it was fitted as "scores
    scaled by 0.001 ... declare Capabilities(score_scale=...)": an outside user's Qwen 3 copy)."""
    report = mha_harness.check(NormsKeptOn(), cases=[GRID, "check_scores_scaled_by_sqrt_d_head",
                                                     "check_large_logits_stay_finite_and_correct",
                                                     "check_padding_mask_output_matches_reference"], isolate=False)
    failed = [r for r in report.failures() if not r.params.get("qk_norm")]
    assert {r.case for r in failed} == {GRID, "check_scores_scaled_by_sqrt_d_head",
                                        "check_large_logits_stay_finite_and_correct",
                                        "check_padding_mask_output_matches_reference"}
    assert all("a q/k norm, an RMSNorm over each head's d_head features" in r.message
               and "Capabilities(qk_norms=('rms_per_head',))" in r.message for r in failed), failed[0].message


def test_search_draws_a_declared_norm_and_finds_a_key_norm_never_called(tmp_path):
    from mha_harness.conformance.isolation import Target
    from mha_harness.conformance.search import MUTANT_SPEC, search_backend
    from mha_harness.implementations.mutants import mutant_backends
    mutant = next(b for b in mutant_backends() if b.name == "mutant-qk-norm-key-forgotten")
    outcome = search_backend(Target(mutant, MUTANT_SPEC), results=tmp_path, isolate=False, max_examples=100, seed=0)
    assert not outcome.passed and outcome.example.get("qk_norm") == "rms_over_projection"
    assert "k is not normed" in outcome.message
    assert "qk_norm rms_over_projection" in outcome.repro or '"qk_norm": "rms_over_projection"' in outcome.repro


def test_list_shows_the_norms_a_backend_declares():
    from tests.conftest import run_cli
    lines = run_cli("list").stdout.splitlines()
    eager = next(i for i, line in enumerate(lines) if line.startswith("torch-eager "))
    assert "q/k norms rms_per_head,rms_over_projection" in lines[eager + 1], lines[eager:eager + 2]


def test_the_other_diagnoses_hold_on_a_layer_with_a_norm_a_wrong_scale_and_tiled_kv_heads_are_named():
    """A scale folded into W_q is undone by the norm: the diagnoses scale the norm's gain instead."""
    from mha_harness.implementations.mutants.zoo import KVHeadsTiled, ScaleByDModel
    for loaded, named in ((ScaleByDModel, "scores scaled by 1/sqrt(d_model)"), (KVHeadsTiled, "h % kv_heads")):
        backend = type("Normed", (NumpyNaive,), {"name": f"normed-{loaded.__name__}", "loaded_class": loaded})()
        report = mha_harness.check(backend, cases=[GRID], isolate=False)
        normed = [r for r in report.failures() if r.params.get("qk_norm")]
        assert normed and all(named in r.message for r in normed), [r.message[-200:] for r in normed]


def test_the_policy_tables_scores_column_names_the_declared_norms():
    report = mha_harness.check(NumpyNaive(), cases=["check_parameter_count_is_4_d_model_squared"], isolate=False)
    assert ("q and k normed in the layers whose config asks (rms_per_head, rms_over_projection, layer_per_head, "
            "layer_per_head_no_bias declared)") in report.policies()["numpy-naive"]["scores"]


class _GainGradientLeftOut(NumpyNaiveLoaded):
    """Returns no g_k gradient, and a wrong W_o one: the gradient message must say which one is missing."""

    def compute_vjp(self, inputs, cotangent):
        grads = reference_vjp(self._params, inputs, cotangent)
        grads.pop("g_k", None)
        grads["W_o"] = grads["W_o"] * 2
        return grads


class GainGradientLeftOut(NumpyNaive):
    name = "gain-gradient-left-out"
    capabilities = Capabilities(gradients=True, qk_norms=("rms_per_head",))

    def load_native(self, params, dtype):
        loaded = _GainGradientLeftOut(params, dtype)
        loaded._params = params
        return loaded


def test_a_gradient_not_returned_is_named_beside_the_wrong_ones():
    report = mha_harness.check(GainGradientLeftOut(), cases=["check_gradients_match_reference"], isolate=False)
    normed = [r for r in report.failures() if r.params.get("qk_norm")]
    assert normed and "not returned: g_k" in normed[0].message, normed[0].message if normed else report.failures()


@pytest.mark.parametrize("kind", QK_NORMS)
def test_a_decode_step_with_a_norm_runs_over_an_empty_cache_too(kind):
    """A KV-cache call with nothing cached projects zero cached rows through the norm: a reshape with -1 cannot
    size an empty array (numpy-naive raised there; search found it on a q/k-norm mutant's decode-step draw)."""
    from mha_harness.contract.api import as_kv_cache_call
    backends = [NumpyNaive()]
    if pytest.importorskip("torch", reason="torch-eager's decode step") is not None:
        from mha_harness.implementations.torch_eager import TorchEager
        backends.append(TorchEager())
    params = make_params(AttentionConfig(16, 2, qk_norm=kind), seed=5)
    for tq, tk in ((1, 1), (2, 6)):
        inputs = as_kv_cache_call(make_inputs(params.config, 1, tq, tk, self_attention=False, causal="bottom-right"))
        expected = reference_attention(params, inputs).output
        for backend in backends:
            step = backend.load(params, dtype="float64").prepare_decode_step(inputs)
            got = backend.load(params, dtype="float64").decode_step_output(step())
            np.testing.assert_allclose(got, expected, atol=1e-12, err_msg=f"{backend.name} Tq={tq} Tk={tk}")


@pytest.mark.parametrize("tk", [1, 6])
def test_flax_normalize_qk_is_the_per_head_layer_norm_in_its_forward_and_its_own_decode_cache(tk):
    """flax-mha declares layer_per_head as MultiHeadDotProductAttention(normalize_qk=True); its autoregressive cache
    holds keys through the module's key LayerNorm, so the cache the adapter fills must norm them too."""
    pytest.importorskip("flax")
    from mha_harness.contract.api import as_kv_cache_call
    from mha_harness.implementations.flax_mha import FlaxMha
    params = make_params(AttentionConfig(16, 2, bias=True, qk_norm="layer_per_head_no_bias"), seed=6)
    inputs = as_kv_cache_call(make_inputs(params.config, 2, 1, tk, self_attention=False, causal="bottom-right"))
    loaded = FlaxMha().load(params, dtype="float64")
    got = loaded.decode_step_output(loaded.prepare_decode_step(inputs)())
    np.testing.assert_allclose(got, reference_attention(params, inputs).output, atol=1e-12)


def test_flax_refuses_an_epsilon_its_normalize_qk_cannot_take_naming_the_accepted_value():
    pytest.importorskip("flax")
    from mha_harness.contract.api import Unsupported
    from mha_harness.implementations.flax_mha import FlaxMha
    params = make_params(AttentionConfig(16, 2, qk_norm="layer_per_head_no_bias", qk_norm_eps=1e-5), seed=6)
    with pytest.raises(Unsupported, match=r"qk_norm_eps: got 1e-05; accepted: 1e-06"):
        FlaxMha().load(params, dtype="float32")


#: found by `mha-harness search --backend torch-eager --seed 0`: a one-feature head whose projection is near 0
HALF_NORM_NEAR_ZERO = {"dtype": "float16", "form": "self", "batch": 1, "tq": 15, "tk": 15, "heads": 1, "kv_heads": 1,
                       "d_head": 1, "bias": False, "causal": None, "padding": None, "attn_mask": None,
                       "logit_scale": 1, "cut": 14, "poison": "random", "gradients": True, "malformed": None,
                       "seed": 0, "qk_norm": "rms_per_head"}


def test_torch_eagers_float16_rms_norm_backward_stays_finite_at_a_projection_near_zero():
    """torch-eager norms with torch's RMSNorm kernel: autograd through the formula written out (a float16 rsqrt of
    y^2 + eps) gave inf in W_q's gradient, d rsqrt(v)/dv being about 5e8 at v = eps."""
    pytest.importorskip("torch")
    from mha_harness.conformance.search_examples import check_example
    from mha_harness.implementations.torch_eager import TorchEager
    check_example(TorchEager(), HALF_NORM_NEAR_ZERO)


#: found by `mha-harness search --backend flax-mha --seed 0 --dtype float32`: a key head whose two features' mean is
#: 37 times their spread, where flax's one-pass variance (mean(y^2) - mean(y)^2) loses most of its digits
ONE_PASS_VARIANCE = {"dtype": "float32", "form": "separate", "batch": 1, "tq": 1, "tk": 4, "heads": 2, "kv_heads": 2,
                     "d_head": 2, "bias": False, "causal": None, "padding": None, "attn_mask": None,
                     "logit_scale": 1, "cut": 3, "poison": "random", "gradients": False, "malformed": None, "seed": 0,
                     "qk_norm": "layer_per_head_no_bias"}


def test_the_tolerance_of_a_layer_norm_covers_the_one_pass_variances_rounding():
    """The float32 bound of a LayerNorm layer holds the rounding of its variance taken in one pass, at the size of
    that sum's terms (flax's LayerNorm, jax.nn.standardize): flax-mha's own normalize_qk was 11.6x a bound that held
    only the two-pass variance's, and 1.5x one that held a single sample of the one-pass rounding."""
    pytest.importorskip("flax")
    from mha_harness.conformance.search_examples import check_example
    from mha_harness.implementations.flax_mha import FlaxMha
    check_example(FlaxMha(), ONE_PASS_VARIANCE)


def _torch_layer_norms_kept_on():
    """torch-eager with timm's LayerNorms (unit gains, zero biases) kept on whatever the config says."""
    import torch

    from mha_harness.implementations.torch_eager import TorchEager, TorchEagerLoaded
    from mha_harness.toolkit.masks import full_mask

    class Loaded(TorchEagerLoaded):
        def forward_tensors(self, q, k, v, inputs, need_weights):
            c = self.config
            if c.qk_norm is not None:
                return super().forward_tensors(q, k, v, inputs, need_weights)
            ones, zeros = torch.ones(c.d_head, dtype=self.dtype), torch.zeros(c.d_head, dtype=self.dtype)
            w = {**self.w, "g_q": ones, "g_k": ones, "beta_q": zeros, "beta_k": zeros}
            allowed, additive = full_mask(inputs)
            return self.layer(q, k, v, w, self.mask_tensor(allowed), self.mask_tensor(additive), c.num_heads,
                              c.kv_heads, need_weights, qk_norm="layer_per_head", rotary=c.rotary,
                              rotary_base=c.rotary_base, rotary_dims=c.rotary_dims, rotary_scaling=c.rotary_scaling)

    class KeptOn(TorchEager):
        name = "layer-norms-kept-on"

        def load_native(self, params, dtype):
            return Loaded(self, params, dtype)
    return KeptOn()


def test_a_layer_norm_kept_on_in_half_precision_is_named_a_norm_not_a_score_scale():
    """In bfloat16 and float16 the norm's output also came within a 1/sqrt(d_model) scale's margin at d_head 64 and
    80, and the scale, tried first, was named (an outside user's timm copy): the closer match now wins."""
    pytest.importorskip("torch")
    report = mha_harness.check(_torch_layer_norms_kept_on(), cases=[GRID], isolate=False)
    failed = [r for r in report.failures() if r.params["dtype"] in ("bfloat16", "float16")]
    assert {r.params["variant"] for r in failed} >= {"d_head_64_with_bias", "d_head_80"}
    for r in failed:
        assert "the output matches a q/k norm, a LayerNorm over each head's d_head features" in r.message, \
            (r.params["variant"], r.params["dtype"], r.message[-300:])


def test_a_layer_norm_over_one_feature_per_head_gets_the_rounding_of_its_mean_in_the_gain_gradients():
    """torch's LayerNorm over one feature: x_hat is 0 exactly, but its backward's gain gradient, sum(dy * y) - mean *
    sum(dy) times 1/sqrt(eps), rounds at the size of y * 1000 (an outside user's search of Phi's layer failed at
    d_head 1: "gradient of g_k: expected 0 ... naive float32 error 0"). The tolerance's terms are those of y - mean."""
    pytest.importorskip("torch")
    from mha_harness.conformance.search_examples import check_example
    from mha_harness.implementations.torch_eager import TorchEager
    example = {"dtype": "float32", "form": "separate", "batch": 2, "tq": 3, "tk": 3, "heads": 2, "kv_heads": 2,
               "d_head": 1, "bias": True, "causal": None, "padding": None, "attn_mask": None, "logit_scale": 1,
               "cut": 0, "poison": "random", "gradients": True, "malformed": None, "qk_norm": "layer_per_head"}
    for seed in range(4):
        check_example(TorchEager(), {**example, "seed": seed})


def test_the_references_mistaken_norm_is_the_numpy_layers_at_the_checked_rows_and_has_no_backward():
    """A diagnosis' reference under ``qk_norm_mistaken`` (the gains not loaded) equals a NumPy layer built with that
    mistake, at a benchmarked call's few rows as on the whole output; its backward is refused, naming the mistake,
    and a malformed mistake is refused naming the accepted values."""
    from mha_harness.contract.qk_norm_diagnoses import mistaken_qk_norm
    from mha_harness.contract.reference import qk_norm_mistaken

    config = AttentionConfig(d_model=32, num_heads=4, qk_norm="rms_per_head")
    params, inputs = make_params(config, seed=3), make_inputs(config, 2, 12, seed=4, causal="top-left")
    unit = params.replace(g_q=np.ones_like(params.g_q), g_k=np.ones_like(params.g_k))
    expected = NumpyNaive().load_native(unit, "float64").compute(inputs).output
    rows = [0, 5, 11]
    with qk_norm_mistaken("gains_ignored", mistaken_qk_norm(params, "gains_ignored")):
        np.testing.assert_allclose(reference_attention(params, inputs).output, expected, rtol=0, atol=1e-12)
        np.testing.assert_allclose(reference_attention(params, inputs, rows=rows).output, expected[:, rows],
                                   rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="qk_norm_mistaken\\('gains_ignored'\\) has a forward only"):
            reference_vjp(params, inputs, np.ones_like(expected))
    assert np.abs(reference_attention(params, inputs).output - expected).max() > 1e-3  # the memo keeps them apart
    with pytest.raises(ValueError, match="accepted: a non-empty str"), qk_norm_mistaken("", lambda y, w, n: y):
        pass
