"""The float64 reference: the lesson's worked example, gradients, masks, grouped-query heads, row subsets."""
from __future__ import annotations

import numpy as np
import pytest

from mha_harness.cases.golden import LESSON_HEAD_WEIGHTS, lesson_example
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.conventions import round_to
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention, reference_vjp


def test_reference_reproduces_the_lessons_printed_head_weights():
    params, inputs = lesson_example()
    weights = reference_attention(params, inputs, need_weights=True).weights[0]
    assert np.array_equal(np.round(weights, 2), LESSON_HEAD_WEIGHTS)


def test_reference_output_is_concat_of_heads_times_w_o_for_the_lesson():
    params, inputs = lesson_example()
    x = inputs.query[0]

    def split(m):
        return m.reshape(4, 2, 4).transpose(1, 0, 2)
    q, k, v = split(x @ params.W_q), split(x @ params.W_k), split(x @ params.W_v)
    s = q @ k.transpose(0, 2, 1) / 2.0
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    expected = (w @ v).transpose(1, 0, 2).reshape(4, 8) @ params.W_o
    np.testing.assert_allclose(reference_attention(params, inputs).output[0], expected, rtol=1e-12)


@pytest.mark.parametrize("masks", [{}, {"causal": "top-left"}, {"causal": "bottom-right"},
                                   {"key_padding_mask": np.array([[False] * 5 + [True] * 2, [False] * 7])}])
def test_reference_gradients_match_finite_differences(masks):
    config = AttentionConfig(8, 2, 1, bias=True)
    params = make_params(config, seed=3)
    inputs = make_inputs(config, 2, 4, 7, seed=4, self_attention=False, **masks)
    cotangent = np.random.default_rng(5).standard_normal((2, 4, 8))
    grads = reference_vjp(params, inputs, cotangent)

    def loss(p, i):
        return float((reference_attention(p, i).output * cotangent).sum())
    eps = 1e-6
    rng = np.random.default_rng(6)
    for name in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"):
        array = getattr(params, name)
        idx = tuple(int(rng.integers(0, n)) for n in array.shape)
        plus, minus = array.copy(), array.copy()
        plus[idx] += eps
        minus[idx] -= eps
        numeric = (loss(params.replace(**{name: plus}), inputs)
                   - loss(params.replace(**{name: minus}), inputs)) / (2 * eps)
        assert grads[name][idx] == pytest.approx(numeric, rel=1e-5, abs=1e-7), name
    for name in ("query", "key", "value"):
        array = getattr(inputs, name)
        plus, minus = array.copy(), array.copy()
        plus[1, 2, 3] += eps
        minus[1, 2, 3] -= eps
        numeric = (loss(params, inputs.replace(**{name: plus}))
                   - loss(params, inputs.replace(**{name: minus}))) / (2 * eps)
        assert grads[name][1, 2, 3] == pytest.approx(numeric, rel=1e-5, abs=1e-7), name


def test_row_subset_equals_the_same_rows_of_the_full_computation():
    config = AttentionConfig(16, 4)
    params = make_params(config)
    inputs = make_inputs(config, 2, 50, causal="top-left")
    rows = np.array([0, 7, 31, 49])
    full = reference_attention(params, inputs).output
    np.testing.assert_allclose(reference_attention(params, inputs, rows=rows).output, full[:, rows], rtol=1e-13)


def test_grouped_query_head_n_uses_kv_head_n_over_group():
    config = AttentionConfig(16, 4, 2)
    params = make_params(config)
    inputs = make_inputs(config, 1, 6)
    # expand K/V weights so each query head gets its own copy of kv head n // 2: plain MHA must agree
    d_head = 4
    blocks = lambda w: [w[:, i * d_head:(i + 1) * d_head] for i in range(2)]  # noqa: E731
    wide = params.replace(config=AttentionConfig(16, 4),
                          W_k=np.concatenate([b for b in blocks(params.W_k) for _ in range(2)], 1),
                          W_v=np.concatenate([b for b in blocks(params.W_v) for _ in range(2)], 1))
    np.testing.assert_allclose(reference_attention(params, inputs).output, reference_attention(wide, inputs).output,
                               rtol=1e-12)


def test_causal_alignments_differ_only_when_lengths_differ():
    config = AttentionConfig(8, 2)
    params = make_params(config)
    same = make_inputs(config, 1, 5, self_attention=False)
    a = reference_attention(params, same.replace(causal="top-left")).output
    b = reference_attention(params, same.replace(causal="bottom-right")).output
    np.testing.assert_array_equal(a, b)
    cross = make_inputs(config, 1, 3, 6)
    w_tl = reference_attention(params, cross.replace(causal="top-left"), need_weights=True).weights
    w_br = reference_attention(params, cross.replace(causal="bottom-right"), need_weights=True).weights
    assert np.count_nonzero(w_tl[0, 0, 0]) == 1  # query 0 sees key 0 only
    assert np.count_nonzero(w_br[0, 0, 0]) == 4  # query 0 sees keys 0..3 (aligned to the end)


def test_fully_masked_rows_output_zeros_before_w_o():
    config = AttentionConfig(8, 2, bias=True)
    params = make_params(config)
    mask = np.zeros((2, 4), bool)
    mask[1] = True
    out = reference_attention(params, make_inputs(config, 2, 4, key_padding_mask=mask), need_weights=True)
    np.testing.assert_allclose(out.output[1], np.broadcast_to(params.b_o, (4, 8)))
    assert np.all(out.weights[1] == 0)


def test_masked_nan_values_do_not_reach_unmasked_rows():
    config = AttentionConfig(8, 2)
    params = make_params(config)
    inputs = make_inputs(config, 1, 5, causal="top-left", self_attention=False)
    value = inputs.value.copy()
    value[0, 3:] = np.nan
    out = reference_attention(params, inputs.replace(value=value)).output
    assert np.all(np.isfinite(out[0, :3])) and np.all(np.isnan(out[0, 3:]))


def test_additive_minus_inf_equals_boolean_mask():
    config = AttentionConfig(8, 2)
    params = make_params(config)
    allowed = np.random.default_rng(1).random((4, 6)) < 0.6
    allowed[:, 0] = True
    inputs = make_inputs(config, 1, 4, 6)
    a = reference_attention(params, inputs.replace(attn_mask=allowed)).output
    b = reference_attention(params, inputs.replace(attn_mask=np.where(allowed, 0.0, -np.inf))).output
    np.testing.assert_allclose(a, b, rtol=1e-14)


def test_bfloat16_rounding_keeps_8_significant_bits():
    x = np.array([1.0, 1.00390625, 1.0078125, 3.14159265, -2.5e-3, np.inf])
    r = round_to(x, "bfloat16")
    assert r[0] == 1.0 and r[1] == 1.0 and r[2] == 1.0078125  # ties to even, then the next representable
    assert abs(r[3] - 3.140625) < 1e-9 and np.isinf(r[5])


def test_the_reference_is_computed_once_per_content_and_every_caller_gets_its_own_copy():
    """Backends checked in one process share each variant's reference (keyed by the inputs' content, not identity);
    what a caller gets is a fresh writable copy, and anything that changes the result changes the key."""
    from mha_harness.contract.reference import clear_reference_cache, empty_rows_as, reference_cache_info
    config = AttentionConfig(16, 2)
    params = make_params(config, seed=3)
    inputs = make_inputs(config, 2, 5, seed=4, key_padding_mask=np.array([[False] * 5, [True] * 5]))
    clear_reference_cache()
    first = reference_attention(params, inputs, need_weights=True)
    again = reference_attention(make_params(config, seed=3), make_inputs(
        config, 2, 5, seed=4, key_padding_mask=np.array([[False] * 5, [True] * 5])), need_weights=True)
    assert reference_cache_info()["misses"] == 1 and reference_cache_info()["hits"] == 1
    np.testing.assert_array_equal(first.output, again.output)
    first.output[:] = 7.0  # a caller's copy: the memo is untouched
    assert not np.array_equal(reference_attention(params, inputs).output, first.output)
    with empty_rows_as("uniform_average"):  # fully padded item 1: another convention, another result
        uniform = reference_attention(params, inputs).output
    assert not np.allclose(uniform[1], again.output[1])
    assert not np.array_equal(reference_attention(params, inputs, dtype="bfloat16").output, again.output)
    changed = inputs.replace(query=inputs.query + 1e-12)
    assert reference_attention(params, changed).output is not None
    assert reference_cache_info()["misses"] == 5
    cot = np.ones((2, 5, 16))
    g1, g2 = reference_vjp(params, inputs, cot), reference_vjp(params, inputs, cot)
    assert g1.keys() == g2.keys() and all(np.array_equal(g1[k], g2[k]) and g1[k] is not g2[k] for k in g1)


def test_hashed_once_reuses_one_digest_for_the_same_objects_and_only_for_them():
    """Inside ``hashed_once(params, inputs)`` the memo keys of those objects come from one digest (the same
    results as without it); other objects, even equal ones, are hashed as before; after the block a change of an
    array is seen again."""
    from mha_harness.contract import reference as ref
    config = AttentionConfig(16, 2)
    params = make_params(config, seed=3)
    inputs = make_inputs(config, 2, 5, seed=4)
    ref.clear_reference_cache()
    outside = reference_attention(params, inputs).output
    calls = []
    real = ref._call_digest
    ref._call_digest = lambda p, i: calls.append((p, i)) or real(p, i)
    try:
        with ref.hashed_once(params, inputs):
            inside = reference_attention(params, inputs).output
            reference_attention(params, inputs, dtype="float32")
            reference_vjp(params, inputs, np.ones((2, 5, 16)))
            assert len(calls) == 1  # the block's own digest
            other = make_inputs(config, 2, 5, seed=5)
            reference_attention(params, other)
            assert len(calls) == 2 and calls[1][1] is other
    finally:
        ref._call_digest = real
    np.testing.assert_array_equal(inside, outside)
    inputs.query[0, 0, 0] += 1.0  # the same objects, changed in place after the block: hashed anew
    assert not np.array_equal(reference_attention(params, inputs).output, outside)


def test_a_self_attention_call_and_its_separate_copy_have_the_same_reference():
    """One x (query is key is value) is hashed once; the result equals that of three equal separate arrays."""
    config = AttentionConfig(16, 2)
    params = make_params(config, seed=3)
    x = make_inputs(config, 2, 5, seed=4, self_attention=True)
    assert x.query is x.key
    separate = x.replace(key=x.query.copy(), value=x.query.copy())
    np.testing.assert_array_equal(reference_attention(params, x).output, reference_attention(params, separate).output)
