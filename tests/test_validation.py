"""Bad input: every public entry point raises ValueError/TypeError naming the parameter and what it accepts."""
from __future__ import annotations

import numpy as np
import pytest

import mha_harness
from mha_harness.contract.api import AttentionConfig, AttentionParams
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.implementations.numpy_naive import NumpyNaive
from mha_harness.registry import RegistryError, load_registry, parse_spec


@pytest.mark.parametrize("kwargs, error, words", [
    ({"d_model": 10, "num_heads": 4}, ValueError, ["num_heads", "10", "divisor"]),
    ({"d_model": 16, "num_heads": 4, "num_kv_heads": 3}, ValueError, ["num_kv_heads", "3", "divisor"]),
    ({"d_model": 0, "num_heads": 1}, ValueError, ["d_model", ">= 1"]),
    ({"d_model": 8.0, "num_heads": 2}, TypeError, ["d_model", "integer"]),
    ({"d_model": 8, "num_heads": 2, "bias": "yes"}, TypeError, ["bias", "True or False"]),
])
def test_bad_config_names_the_parameter(kwargs, error, words):
    with pytest.raises(error) as info:
        AttentionConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_bad_parameter_shapes_name_the_weight():
    config = AttentionConfig(8, 2)
    good = make_params(config)
    with pytest.raises(ValueError, match=r"W_k: got shape \(8, 4\); accepted: \(8, 8\)"):
        AttentionParams(config, good.W_q, good.W_k[:, :4], good.W_v, good.W_o)
    with pytest.raises(ValueError, match="b_q: got an array but config.bias is False"):
        AttentionParams(config, good.W_q, good.W_k, good.W_v, good.W_o, b_q=np.zeros(8))
    bad = good.W_q.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"W_q: got a non-finite value nan at index \(1, 2\)"):
        AttentionParams(config, bad, good.W_k, good.W_v, good.W_o)


@pytest.fixture
def loaded():
    config = AttentionConfig(8, 2)
    return NumpyNaive().load(make_params(config), dtype="float64"), make_inputs(config, 2, 5, 6)


@pytest.mark.parametrize("change, error, name", [
    (lambda i: i.replace(query=i.query[0]), ValueError, "query: got rank 2"),
    (lambda i: i.replace(query=i.query[..., :7]), ValueError, "query: got width 7"),
    (lambda i: i.replace(key=i.key[:1], value=i.value[:1]), ValueError, "key/value: got batch sizes 1/1"),
    (lambda i: i.replace(value=i.value[:, :3]), ValueError, "value: got sequence length 3"),
    (lambda i: i.replace(query=i.query[:, :0]), ValueError, "query: got an empty sequence"),
    (lambda i: i.replace(query=np.full_like(i.query, np.inf)), ValueError, "query: got a non-finite value inf"),
    (lambda i: i.replace(key=np.full_like(i.key, np.nan)), ValueError, "key: got a non-finite value nan"),
    (lambda i: i.replace(query=i.query.astype(np.int64)), TypeError, "query: got dtype int64"),
    (lambda i: i.replace(key_padding_mask=np.zeros((2, 5), bool)), ValueError, "key_padding_mask: got shape (2, 5)"),
    (lambda i: i.replace(key_padding_mask=np.zeros((2, 6))), TypeError, "key_padding_mask: got dtype float64"),
    (lambda i: i.replace(attn_mask=np.ones((6, 5), bool)), ValueError, "attn_mask: got shape (6, 5)"),
    (lambda i: i.replace(attn_mask=np.ones((5, 6), np.int32)), TypeError, "attn_mask: got dtype int32"),
    (lambda i: i.replace(attn_mask=np.full((5, 6), np.nan)), ValueError, "attn_mask: got NaN"),
    (lambda i: i.replace(causal="future"), ValueError, "causal: got 'future'; accepted: None, 'top-left'"),
    (lambda i: i.replace(query=[[1.0]]), TypeError, "query: got list"),
])
def test_bad_inputs_are_rejected_before_computing(loaded, change, error, name):
    layer, inputs = loaded
    with pytest.raises(error) as info:
        layer.forward(change(inputs))
    assert name in str(info.value)
    assert "accepted" in str(info.value)


def test_load_rejects_an_undeclared_dtype_and_unsupported_features():
    from mha_harness.implementations.flax_mha import FlaxMha
    with pytest.raises(ValueError, match="dtype: got 'float16'; accepted: float32, float64"):
        NumpyNaive().load(make_params(AttentionConfig(8, 2)), dtype="float16")
    with pytest.raises(ValueError, match="num_kv_heads: got 1 .* does not support grouped-query"):
        FlaxMha().load(make_params(AttentionConfig(8, 2, 1)), dtype="float32")
    with pytest.raises(TypeError, match="params: got dict"):
        NumpyNaive().load({}, dtype="float32")


@pytest.mark.parametrize("spec", ["nocolon", "a.b:", ":obj", "pkg..mod:x", "pkg.mod:x:y", "1pkg:x", ""])
def test_malformed_backend_spec_is_a_value_error(spec):
    with pytest.raises(ValueError, match="backend spec: got .*accepted: 'package.module:object'"):
        parse_spec(spec)


def test_unknown_backend_name_lists_the_accepted_names():
    with pytest.raises(RegistryError, match="backend: got 'nope'; accepted: one of .*numpy-naive, numpy-tiled"):
        load_registry().get("nope")


def test_unknown_case_name_lists_the_accepted_names():
    with pytest.raises(ValueError, match="case: got 'check_nothing'; accepted: .*check_scores_scaled_by_sqrt_d_head"):
        mha_harness.check(NumpyNaive(), cases=["check_nothing"])


def test_function_backend_rejects_non_callables():
    with pytest.raises(TypeError, match="fn: got int"):
        mha_harness.function_backend(3, name="x")
    with pytest.raises(ValueError, match="name: got ''"):
        mha_harness.function_backend(lambda *a: None, name="")


# --- non-finite keys/values: refused where some query sees them, accepted only where every query is blind ---

def _layer():
    params = make_params(AttentionConfig(8, 2), seed=3)
    return params, NumpyNaive().load(params, dtype="float64")


def _poisoned(inputs, position, value=np.nan):
    key, val = inputs.key.copy(), inputs.value.copy()
    key[0, position, 0] = value
    val[0, position, 1] = value
    return inputs.replace(key=key, value=val)


@pytest.mark.parametrize("masks, position", [
    ({"causal": "top-left"}, 2),                       # query 2 and later see key 2
    ({"causal": "bottom-right"}, 5),                   # Tq = Tk: the last query sees every key
    ({"attn_mask": np.eye(6, dtype=bool)}, 3),         # query 3 sees key 3
    ({"attn_mask": np.where(np.eye(6, dtype=bool), 0.0, -np.inf)}, 1),
    ({"causal": "top-left", "attn_mask": np.ones((6, 6), bool)}, 0),
])
def test_non_finite_key_or_value_that_a_query_sees_is_refused(masks, position):
    params, loaded = _layer()
    inputs = _poisoned(make_inputs(params.config, 1, 6, seed=4, self_attention=False, **masks), position)
    with pytest.raises(ValueError, match=rf"key: got a non-finite value nan at index \(0, {position}, 0\), a "
                                         "position some query attends to"):
        loaded.forward(inputs)


@pytest.mark.parametrize("tq, tk, masks, position", [
    (3, 6, {"causal": "top-left"}, 4),                  # top-left, Tq < Tk: keys >= Tq are seen by no query
    (6, 6, {"attn_mask": np.ones((6, 6), bool) & (np.arange(6) != 2)[None, :]}, 2),  # column 2 all False
    (6, 6, {"attn_mask": np.where(np.arange(6)[None, :] == 5, -np.inf, np.zeros((6, 6)))}, 5),
    (6, 6, {"key_padding_mask": np.arange(6)[None, :] == 4}, 4),
])
def test_non_finite_key_or_value_that_no_query_sees_is_accepted(tq, tk, masks, position):
    params, loaded = _layer()
    inputs = _poisoned(make_inputs(params.config, 1, tq, tk, seed=4, self_attention=False, **masks), position)
    assert np.all(np.isfinite(loaded.forward(inputs).output))


def test_vjp_cotangent_is_validated_like_an_output():
    params = make_params(AttentionConfig(8, 2), seed=3)
    entry = load_registry().get("torch-eager")
    if not entry.available:
        pytest.skip(f"no backend with gradients here: {entry.reason_unavailable}")
    loaded = entry.backend.load(params, dtype="float64")
    inputs = make_inputs(params.config, 2, 5, seed=1)
    with pytest.raises(ValueError, match=r"cotangent: got shape \(2, 4, 8\); accepted: the output's shape "
                                         r"\(batch, Tq, d_model\) = \(2, 5, 8\)"):
        loaded.vjp(inputs, np.ones((2, 4, 8)))
    bad = np.ones((2, 5, 8))
    bad[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=r"cotangent: got a non-finite value nan at index \(1, 2, 3\)"):
        loaded.vjp(inputs, bad)
    with pytest.raises(TypeError, match="cotangent: got dtype int64; accepted: a floating dtype"):
        loaded.vjp(inputs, np.ones((2, 5, 8), dtype=np.int64))
    with pytest.raises(TypeError, match="cotangent: got list; accepted: a numpy.ndarray"):
        loaded.vjp(inputs, [[0.0]])


def test_params_with_a_dict_config_name_config():
    good = make_params(AttentionConfig(8, 2))
    with pytest.raises(TypeError, match=r"config: got dict; accepted: mha_harness.AttentionConfig\("):
        AttentionParams({"d_model": 8, "num_heads": 2}, good.W_q, good.W_k, good.W_v, good.W_o)


def test_forward_with_something_other_than_inputs_names_inputs():
    _, loaded = _layer()
    with pytest.raises(TypeError, match=r"inputs: got dict; accepted: mha_harness.AttentionInputs\("):
        loaded.forward({"query": np.zeros((1, 2, 8))})


@pytest.mark.parametrize("call, error, words", [
    (lambda: mha_harness.make_params({"d_model": 8}), TypeError, "config: got dict"),
    (lambda: mha_harness.make_params(AttentionConfig(8, 2), seed="x"), TypeError, "seed: got 'x'"),
    (lambda: mha_harness.make_inputs(AttentionConfig(8, 2), 0, 5), ValueError, "batch: got 0"),
    (lambda: mha_harness.make_inputs(AttentionConfig(8, 2), 1, -5), ValueError, "tq: got -5"),
    (lambda: mha_harness.make_inputs(AttentionConfig(8, 2), 1, 5, causal="up"), ValueError, "causal: got 'up'"),
    (lambda: mha_harness.load_registry(42), TypeError, "extra_specs: got int"),
    (lambda: mha_harness.check("numpy-naive", isolate="yes"), TypeError, "isolate: got 'yes'"),
    (lambda: mha_harness.reference_attention(AttentionConfig(8, 2), None), TypeError, "params: got AttentionConfig"),
    (lambda: mha_harness.reference_attention(make_params(AttentionConfig(8, 2)), {}), TypeError, "inputs: got dict"),
])
def test_public_functions_name_the_offending_parameter(call, error, words):
    with pytest.raises(error, match=words):
        call()
