"""Rescaled rotary frequencies (``AttentionConfig.rotary_scaling``, declared by ``Capabilities.rotary_scalings``):
Llama 3.1's ``rope_type="llama3"``, a linear position interpolation and YaRN (``rope_type="yarn"``). The rescaling
against an independent transcription (and transformers' own YaRN), the reference, the declarations, the backends, the
grid rows, search and the diagnoses."""
from __future__ import annotations

import math

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, Capabilities
from mha_harness.contract.conventions import COMMON_ROTARY_SCALINGS, ROTARY_KINDS, RotaryScaling, rotary_positions
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention
from tests.test_rotary import assert_float64_layer_matches_reference

GRID = "check_output_matches_reference"
LLAMA_3_1 = RotaryScaling("llama3", 8.0, 1.0, 4.0, 8192)


def _llama3_loop(inv_freq, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's llama-models apply_scaling, one frequency at a time: short wavelengths kept, long ones divided by the
    factor, the ones between blended by how far their wavelength lies between the two bounds."""
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high_freq_factor:
            out.append(freq)
        elif wavelen > old_context_len / low_freq_factor:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("d_head, base", [(128, 500_000.0), (16, 500_000.0), (64, 10_000.0)])
def test_llama3_rescaling_is_metas_apply_scaling_and_linear_divides_every_frequency(d_head, base):
    inv_freq = 1.0 / base ** (np.arange(0, d_head, 2) / d_head)
    scaled = LLAMA_3_1.frequencies(inv_freq)
    np.testing.assert_allclose(scaled, _llama3_loop(inv_freq, 8.0, 1.0, 4.0, 8192), rtol=1e-15)
    assert np.any(scaled == inv_freq) and np.any(np.isclose(scaled, inv_freq / 8)), "all three regimes at d_head 128"
    np.testing.assert_allclose(RotaryScaling("linear", 4.0).frequencies(inv_freq), inv_freq / 4, rtol=1e-15)


@pytest.mark.parametrize("kind", ROTARY_KINDS)
@pytest.mark.parametrize("scaling", list(COMMON_ROTARY_SCALINGS), ids=str)
def test_the_references_rescaled_rotary_turns_by_the_rescaled_frequencies(kind, scaling):
    from tests.test_rotary import _llama_rotary
    config = AttentionConfig(64, 2, rotary=kind, rotary_base=500_000.0, rotary_scaling=COMMON_ROTARY_SCALINGS[scaling])
    params = make_params(config, seed=1)
    inputs = make_inputs(config, 1, 5, 40, seed=2)
    # the rescaled frequencies are base ** (-2i / d) for an equivalent per-frequency base: turn by them directly
    d = config.d_head
    inv_freq = config.rotary_scaling.frequencies(1.0 / 500_000.0 ** (np.arange(0, d, 2) / d), 500_000.0)
    factor = config.rotary_scaling.attention_scale  # YaRN's, on q and k alike (1 for the others)
    heads = lambda y, n: y.reshape(*y.shape[:2], n, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q_pos, k_pos = rotary_positions(inputs.tq, inputs.tk)
    turn = lambda x, pos: factor * _llama_rotary(x, pos * 1.0, None, kind, inv_freq)  # noqa: E731
    q, k = turn(heads(inputs.query @ params.W_q, 2), q_pos), turn(heads(inputs.key @ params.W_k, 2), k_pos)
    v = heads(inputs.value @ params.W_v, 2)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    want = ((p / p.sum(axis=-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(1, 5, 64) @ params.W_o
    got = reference_attention(params, inputs).output
    np.testing.assert_allclose(got, want, atol=1e-12)
    unscaled = params.replace(config=AttentionConfig(64, 2, rotary=kind, rotary_base=500_000.0))
    assert np.abs(got - reference_attention(unscaled, inputs).output).max() > 1e-3


def test_a_malformed_rescaling_is_refused_naming_the_parameter_and_the_accepted_values():
    with pytest.raises(ValueError, match=r"RotaryScaling.kind: got 'dynamic'; accepted: 'linear', 'llama3', 'yarn'"):
        RotaryScaling("dynamic")
    with pytest.raises(ValueError, match=r"RotaryScaling.factor: got 0; accepted: a finite number > 0"):
        RotaryScaling("linear", 0)
    with pytest.raises(ValueError, match=r"RotaryScaling.high_freq_factor: got 1.0 with low_freq_factor 1.0"):
        RotaryScaling("llama3", 8.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"RotaryScaling.original_max_positions: got 8192.0; accepted: an integer"):
        RotaryScaling("llama3", original_max_positions=8192.0)
    with pytest.raises(TypeError, match=r"rotary_scaling: got 'llama3'; accepted: None or a mha_harness.RotaryScaling"):
        AttentionConfig(32, 2, rotary="half_split", rotary_scaling="llama3")
    with pytest.raises(ValueError, match=r"rotary_scaling: got .* with rotary=None; accepted: None, or set rotary"):
        AttentionConfig(32, 2, rotary_scaling=LLAMA_3_1)
    with pytest.raises(ValueError, match=r"Capabilities.rotary_scalings: got unknown 'dynamic'"):
        Capabilities(rotary_scalings=("dynamic",))
    assert mha_harness.RotaryScaling is RotaryScaling


def test_a_backend_refuses_a_rescaling_it_does_not_declare_and_skips_its_rows_naming_it():
    from mha_harness.implementations.numpy_naive import NumpyNaive
    backend = type("Unscaled", (NumpyNaive,), {"name": "unscaled", "capabilities": Capabilities(rotary=ROTARY_KINDS)})()
    with pytest.raises(ValueError, match=r"rotary_scaling: got 'llama3' but unscaled declares no rescaled rotary "
                                         r"frequencies \(Capabilities.rotary_scalings is empty\); accepted: None"):
        backend.load(make_params(AttentionConfig(32, 2, rotary="half_split", rotary_scaling=LLAMA_3_1)))
    report = mha_harness.check(backend, cases=[GRID], isolate=False)
    skipped = {r.params.get("variant"): r.message for r in report.results if r.status == "skipped"}
    assert "does not declare rotary_scalings 'llama3'" in skipped["rotary_scaled_llama3"], skipped
    assert "does not declare rotary_scalings 'linear'" in skipped["rotary_scaled_linear"], skipped


@pytest.mark.parametrize("backend_name", ["numpy-naive", "torch-eager"])
@pytest.mark.parametrize("scaling", list(COMMON_ROTARY_SCALINGS), ids=str)
def test_the_backends_that_declare_a_rescaling_match_the_reference_forward_backward_and_decode_step(backend_name,
                                                                                                    scaling):
    if backend_name == "torch-eager":
        pytest.importorskip("torch")
        from mha_harness.implementations.torch_eager import TorchEager as make
    else:
        from mha_harness.implementations.numpy_naive import NumpyNaive as make
    backend = make()
    assert scaling in backend.capabilities.rotary_scalings
    config = AttentionConfig(64, 2, 1, bias=True, rotary="half_split", rotary_base=500_000.0, rotary_dims=16,
                             rotary_scaling=COMMON_ROTARY_SCALINGS[scaling])
    assert_float64_layer_matches_reference(backend, make_params(config, seed=5))


class _KeptLlama3:
    """A wrapped Llama 3.1 module built from the model's own config: its rope_scaling is on whatever the harness's
    config says."""

    @staticmethod
    def backend():
        from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

        class Loaded(NumpyNaiveLoaded):
            def rotary_scaling(self):
                return LLAMA_3_1

        return type("KeptLlama3", (NumpyNaive,), {"name": "kept-llama3", "loaded_class": Loaded,
                                                   "capabilities": Capabilities(dtypes=("float32",),
                                                                                rotary=ROTARY_KINDS)})()


def test_a_layer_that_keeps_llama3_rescaling_where_the_config_has_none_is_told_so():
    failed = mha_harness.check(_KeptLlama3.backend(), cases=[GRID], isolate=False).failures()
    assert failed
    for r in failed:
        assert ("the output matches rotary embeddings with frequencies rescaled as rope_type 'llama3', factor 8"
                in r.message and "where config.rotary_scaling is None" in r.message), r.message


def test_the_rescaling_mutant_is_caught_and_named_by_both_scaled_rows_and_found_by_search(tmp_path):
    pytest.importorskip("hypothesis")
    from mha_harness.conformance.isolation import Target
    from mha_harness.conformance.search import MUTANT_SPEC, search_backend
    from mha_harness.implementations.mutants import mutant_backends
    mutant = next(b for b in mutant_backends() if b.name == "mutant-rotary-scaling-ignored")
    failed = mha_harness.check(mutant, cases=[GRID], isolate=False).failures()
    assert sorted(r.params["variant"] for r in failed) == ["rotary_scaled_linear", "rotary_scaled_llama3",
                                                           "rotary_scaled_yarn"]
    assert all(mutant.mutant.message_mentions in r.message for r in failed), [r.message for r in failed]
    outcome = search_backend(Target(mutant, MUTANT_SPEC), results=tmp_path, isolate=False, max_examples=200, seed=0)
    assert not outcome.passed and outcome.example.get("rotary_scaling"), outcome.lines()


@pytest.mark.parametrize("name, wrong, named", [
    ("linear-at-the-configs-factor", lambda s: RotaryScaling("linear", s.factor),
     "rescaled as rope_type 'linear', factor 8 where config.rotary_scaling is rope_type 'llama3', factor 8"),
    ("llama-3-2s-factor", lambda s: RotaryScaling(s.kind, 32.0, s.low_freq_factor, s.high_freq_factor,
                                                  s.original_max_positions),
     "rescaled as rope_type 'llama3', factor 32, low_freq_factor 1"),
])
def test_another_rescaling_in_the_configs_place_is_named_at_its_own_factor(name, wrong, named):
    """An outside user's Llama 3.1 copies: linear at the config's factor 8, and Llama 3.2's factor 32 where 3.1's 8
    belongs, were numbers only (the second with a half-precision guess whose declaration would have hidden it)."""
    from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

    class Loaded(NumpyNaiveLoaded):
        def rotary_scaling(self):
            real = self.config.rotary_scaling
            return real if real is None or real.kind != "llama3" else wrong(real)

    backend = type(name, (NumpyNaive,), {"name": name, "loaded_class": Loaded, "capabilities": Capabilities(
        dtypes=("float32",), rotary=ROTARY_KINDS, rotary_scalings=("llama3",))})()
    (failed,) = mha_harness.check(backend, cases=[GRID], isolate=False).failures()
    assert failed.params["variant"] == "rotary_scaled_llama3"
    assert named in failed.message and "half precision" not in failed.message, failed.message


#: transformers 5.25's ROPE_INIT_FUNCTIONS["yarn"] (its float32 inv_freq) for gpt-oss's rope_parameters (factor 32
#: over 4,096 positions, beta_fast 32, beta_slow 1, "truncate": false) at base 150,000 and head_dim 64, and its
#: attention factor
GPT_OSS_YARN = RotaryScaling("yarn", 32.0, original_max_positions=4096, truncate=False)
GPT_OSS_INV_FREQ = [
    1.0, 0.6890442967414856, 0.4747820496559143, 0.32714587450027466, 0.22541800141334534, 0.15532298386096954,
    0.1070244237780571, 0.07374456524848938, 0.05081327259540558, 0.031705696135759354, 0.019334999844431877,
    0.011592049151659012, 0.006794959306716919, 0.0038603590801358223, 0.002093792660161853, 0.00105260219424963,
    0.0004564839182421565, 0.00012931869423482567, 3.830881178146228e-05, 2.6396468456368893e-05,
    1.818833698052913e-05, 1.253256959898863e-05, 8.635495760245249e-06, 5.95023948335438e-06, 4.099978468730114e-06,
    2.8250667583051836e-06, 1.9465962850517826e-06, 1.3412909538601525e-06, 9.242089618055616e-07,
    6.368209142237902e-07, 4.38797854940276e-07, 3.023511396804679e-07]
#: the same function for Qwen 2.5's (factor 4 over 32,768 positions, truncated ramp) at base 1,000,000 and head_dim
#: 32: each frequency over the unscaled one
QWEN_YARN_RATIOS = [1.0] * 6 + [0.85, 0.7, 0.55, 0.4] + [0.25] * 6


def test_yarn_is_transformers_rope_init_and_attention_factor():
    inv_freq = 1.0 / 150_000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(GPT_OSS_YARN.frequencies(inv_freq, 150_000.0), GPT_OSS_INV_FREQ, rtol=2e-6)
    assert GPT_OSS_YARN.attention_scale == pytest.approx(1.3465735902799727, rel=1e-15)
    qwen = COMMON_ROTARY_SCALINGS["yarn"]
    inv_freq = 1.0 / 1e6 ** (np.arange(0, 32, 2) / 32)
    np.testing.assert_allclose(qwen.frequencies(inv_freq, 1e6) / inv_freq, QWEN_YARN_RATIOS, rtol=1e-12)
    assert qwen.attention_scale == pytest.approx(1.138629436111989, rel=1e-15)
    assert RotaryScaling("yarn", 4.0, attention_factor=0.5).attention_scale == 0.5
    assert RotaryScaling("yarn", 1.0).attention_scale == 1.0 and LLAMA_3_1.attention_scale == 1.0


@pytest.mark.parametrize("field, value, accepted", [
    ("beta_fast", 0.5, "accepted: a number above beta_slow"), ("beta_slow", -1.0, "accepted: a finite number > 0"),
    ("attention_factor", 0.0, "accepted: a finite number > 0 or None"), ("truncate", "no", "accepted: True or False")])
def test_a_malformed_yarn_field_is_refused_naming_it(field, value, accepted):
    with pytest.raises(ValueError, match=rf"RotaryScaling.{field}: got .*; {accepted}"):
        RotaryScaling("yarn", 4.0, **{field: value})


def _yarn_layer(name: str, wrong):
    """numpy-naive declaring YaRN, its rescaling replaced by ``wrong(config's)`` where the config has YaRN."""
    from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

    class Loaded(NumpyNaiveLoaded):
        def rotary_scaling(self):
            real = self.config.rotary_scaling
            return real if real is None or real.kind != "yarn" else wrong(real)

    return type(name, (NumpyNaive,), {"name": name, "loaded_class": Loaded, "capabilities": Capabilities(
        dtypes=("float32",), rotary=ROTARY_KINDS, rotary_scalings=("yarn",))})()


@pytest.mark.parametrize("name, wrong, named", [
    ("yarn-without-attention-factor", lambda s: RotaryScaling("yarn", s.factor, original_max_positions=4096 * 8,
                                                             attention_factor=1.0),
     "the output matches YaRN's rescaled rotary embeddings without its attention factor (q and k not multiplied by "
     "1.139"),
    ("yarn-ramp-not-truncated", lambda s: RotaryScaling("yarn", s.factor, original_max_positions=32_768,
                                                       truncate=False),
     "the output matches rotary embeddings with YaRN's ramp without its ends rounded to whole frequency indices "
     "where config.rotary_scaling.truncate is True"),
    ("yarn-left-out", lambda s: None, "lack the 'yarn' rescaling config.rotary_scaling asks for (rope_type 'yarn', "
                                      "factor 4, original_max_position_embeddings 32768"),
])
def test_a_wrong_yarn_layer_is_named(name, wrong, named):
    """Qwen 2.5's row (YaRN by 4 over 32,768 positions) on a layer without YaRN's attention factor (its q and k
    1.139 x too small), with gpt-oss's untruncated ramp where the config truncates, and without YaRN at all."""
    (failed,) = mha_harness.check(_yarn_layer(name, wrong), cases=[GRID], isolate=False).failures()
    assert failed.params["variant"] == "rotary_scaled_yarn"
    assert named in failed.message and "half precision" not in failed.message, failed.message


def test_a_gradient_failure_whose_forward_lacks_yarns_attention_factor_names_it_not_a_score_scale():
    """Without its attention factor a YaRN layer is also a layer whose scores are scaled by 1 / 1.139^2: the gradient
    case's note on the wrong forward named that scale and said to declare it (an outside user's Qwen 2 copy); it
    names the rotary mistake, as the output cases do."""
    import dataclasses

    from mha_harness.conformance.casekit import forward_also_wrong
    yarn = COMMON_ROTARY_SCALINGS["yarn"]
    config = AttentionConfig(32, 4, 2, bias=True, rotary="half_split", rotary_base=1e6, rotary_scaling=yarn)
    params = make_params(config, seed=1)
    inputs = make_inputs(config, 2, 9, seed=2, causal="top-left")
    without = params.replace(config=dataclasses.replace(config, rotary_scaling=dataclasses.replace(
        yarn, attention_factor=1.0)))
    wrong = reference_attention(without, inputs).output
    note = forward_also_wrong(lambda: wrong, params, inputs, "float32", np.ones_like(wrong))
    assert "the forward's output for this call is wrong too" in note
    assert "without its attention factor" in note and "scores scaled by" not in note, note


def test_a_layer_that_ignores_yarns_truncate_fails_the_decode_steps_gpt_oss_scaling():
    """The grid's YaRN row is Qwen 2.5's (truncate true), the decode step's gpt-oss's (truncate false): a layer whose
    ramp is always rounded (an outside user's wrapper that dropped "truncate" from rope_parameters passed every case
    before) fails the step, named."""
    import dataclasses

    from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded

    class Loaded(NumpyNaiveLoaded):
        def rotary_scaling(self):
            real = self.config.rotary_scaling
            return real if real is None else dataclasses.replace(real, truncate=True)

    backend = type("truncate-dropped", (NumpyNaive,), {"name": "truncate-dropped", "loaded_class": Loaded})()
    failed = mha_harness.check(backend, cases=[GRID, "check_decode_step_over_filled_cache_matches_reference"],
                               isolate=False).failures()
    assert [(r.case, r.params["variant"]) for r in failed] == [
        ("check_decode_step_over_filled_cache_matches_reference", "rotary_scaled_yarn")]
    assert "YaRN's ramp with its ends rounded to whole frequency indices where config.rotary_scaling.truncate is " \
           "False" in failed[0].message, failed[0].message
