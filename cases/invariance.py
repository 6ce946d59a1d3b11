"""Structural properties: permutation equivariance, batch independence, stability, determinism."""
from __future__ import annotations

import numpy as np

from mha_harness.cases._fixtures import separate_inputs, small_layer
from mha_harness.conformance.casekit import CaseFailure, Measurement, assert_close, case, run, tolerance_for
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_inputs, make_params


@case()
def check_self_attention_is_permutation_equivariant(backend, *, dtype):
    """Without masks, permuting the tokens of a self-attention input permutes the output rows the same way."""
    params = small_layer(backend, bias=True)
    inputs = make_inputs(params.config, 2, 9, seed=12)
    perm = np.random.default_rng(12).permutation(9)
    x = inputs.query[:, perm]
    base = run(backend, params, inputs, dtype).output
    permuted = run(backend, params, inputs.replace(query=x, key=x, value=x), dtype).output
    _, tol = tolerance_for(params, inputs, dtype)
    return Measurement(max_error=assert_close(permuted, base[:, perm], tol, "permuted output"))


@case(requires=("cross_attention",))
def check_cross_attention_is_invariant_to_key_order(backend, *, dtype):
    """Without masks, permuting key/value positions together leaves the cross-attention output unchanged."""
    params = small_layer(backend, bias=True)
    inputs = separate_inputs(params.config, 2, 5, 11)
    perm = np.random.default_rng(13).permutation(11)
    base = run(backend, params, inputs, dtype).output
    shuffled = run(backend, params, inputs.replace(key=inputs.key[:, perm], value=inputs.value[:, perm]), dtype).output
    _, tol = tolerance_for(params, inputs, dtype)
    return Measurement(max_error=assert_close(shuffled, base, tol, "output after permuting keys"))


@case()
def check_batch_items_are_independent(backend, *, dtype):
    """Changing one batch item's inputs changes no other batch item's output."""
    params = small_layer(backend, bias=True)
    inputs = separate_inputs(params.config, 3, 8)
    base = run(backend, params, inputs, dtype).output
    rng = np.random.default_rng(14)
    changed = {n: getattr(inputs, n).copy() for n in ("query", "key", "value")}
    for array in changed.values():
        array[1] = rng.standard_normal(array[1].shape) * 5
    after = run(backend, params, inputs.replace(**changed), dtype).output
    _, tol = tolerance_for(params, inputs, dtype)
    for b in (0, 2):
        assert_close(after[b:b + 1], base[b:b + 1], tol, f"batch item {b} after changing item 1")
    if np.allclose(after[1], base[1]):
        raise CaseFailure("batch independence: changing batch item 1 did not change its own output")
    return Measurement()


@case()
def check_large_logits_stay_finite_and_correct(backend, *, dtype):
    """Scores of magnitude ~1e4 give finite outputs equal to the reference: softmax subtracts the row maximum."""
    config = AttentionConfig(16, 2)
    params = make_params(config, seed=15, scale=1.0)
    inputs = separate_inputs(config, 2, 6)
    scores = (inputs.query @ params.W_q)[0, :, :8] @ (inputs.key @ params.W_k)[0, :, :8].T / np.sqrt(8)
    boost = np.sqrt(1e4 / np.abs(scores).max())
    params = params.replace(W_q=params.W_q * boost, W_k=params.W_k * boost)
    got = run(backend, params, inputs, dtype).output
    if not np.all(np.isfinite(got)):
        raise CaseFailure("numerical stability: scores of magnitude 1e4 gave non-finite outputs "
                          f"({int(np.sum(~np.isfinite(got)))} entries); softmax must subtract the row maximum")
    expected, tol = tolerance_for(params, inputs, dtype)
    return Measurement(max_error=assert_close(got, expected, tol, "output with 1e4 logits"))


@case(variants=lambda b: [{"dtype": d} for d in b.capabilities.dtypes])
def check_repeated_calls_are_bitwise_identical(backend, *, dtype):
    """Two identical forward calls on one loaded layer return identical bits."""
    params = small_layer(backend, bias=True)
    inputs = separate_inputs(params.config, 2, 33)
    loaded = backend.load(params, dtype=dtype)
    first = run(backend, params, inputs, dtype, loaded=loaded).output
    second = run(backend, params, inputs, dtype, loaded=loaded).output
    if not np.array_equal(first, second, equal_nan=True):
        diff = np.abs(first - second)
        idx = np.unravel_index(int(np.nanargmax(diff)), diff.shape)
        raise CaseFailure(f"determinism: two identical calls differ at (batch, position, feature) "
                          f"{tuple(map(int, idx))}: {first[idx]!r} vs {second[idx]!r}",
                          max_error=float(np.nanmax(diff)))
    return Measurement(max_error=0.0)
