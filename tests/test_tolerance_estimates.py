"""What the tolerance rule counts as a correct backend's honest error, and the search's false findings that came
from counting too little (each example below failed a correct built-in backend before):

- the gradient floor scales with the size of the terms each gradient sums (reference_vjp_magnitudes), not with
  |gradient|: where the softmax backward cancels (a stranger's search of 2026-12-02 stopped there);
- the naive error is the larger of two valid same-dtype algorithms: the textbook one and the fused kernels' (queries
  scaled first; FlashAttention-2's backward with weights recomputed from the log-sum-exp and the row term from the
  output), whose error torch's flash kernel reproduces to the digit;
- a separate-form backend searched with one x is not asked to refuse separate arrays;
- at large logits (x10, x100) one more estimate: the float64 computation whose scores (and FlashAttention's
  recomputed exponents ``s - lse``) each carry one float32 rounding at the size of their terms, with a seeded
  random sign (``score_error_of``): which way each score rounds decides one algorithm's error there, and the
  search found eight correct-kernel failures of 1.02-9.2 x the bound without it (LARGE_LOGITS);
- in half precision one more: the float64 computation whose scores carry the half dtype's rounding (a textbook
  kernel in it rounds q, k and each score to it; at a q/k norm's large scores torch-eager failed its own search in
  bfloat16 without it, HALF_TEXTBOOK).

Ordinary gradients keep about the bound they had and wrong ones still fail (the mutants' tests cover the rest)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from mha_harness.cases._fixtures import form_inputs
from mha_harness.conformance.casekit import (
    CaseFailure,
    assert_gradients_close,
    bad_calls,
    gradient_reduction_length,
    input_gradient_terms,
    naive_gradients,
)
from mha_harness.conformance.search_examples import build, check_example
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_params
from mha_harness.contract.reference import reference_attention, reference_vjp, reference_vjp_magnitudes
from mha_harness.contract.tolerance import max_abs_error, naive_dtype, tolerance_from

#: the stranger's example: two keys, peaked weights (logits x 10), float64; jax-explicit and flax-mha failed it at
#: 2.06 x the old bound, torch-eager at 1.29 x, torch-nn-mha at 1.06 x
CANCELLING = {"dtype": "float64", "form": "separate", "batch": 1, "tq": 1, "tk": 2, "heads": 2, "kv_heads": 2,
              "d_head": 1, "bias": False, "causal": None, "padding": None, "attn_mask": None, "logit_scale": 10,
              "cut": 0, "poison": "random", "gradients": True, "malformed": None, "seed": 0}

#: the BLAS kernel the measured figures of the tests marked with :func:`on_measured_blas_kernel` were taken on
MEASURED_KERNEL = "Haswell"


def on_measured_blas_kernel(test):
    """Run ``test`` under OpenBLAS's Haswell kernel (``OPENBLAS_CORETYPE``, read when NumPy loads, so in a child
    pytest): its assertions are about the float32 rounding of particular inputs, measured with that kernel's
    summation order; on a host whose OpenBLAS picks another (SkylakeX's AVX-512 kernel, 2026-12-03) the same inputs
    round differently. The assertions are unchanged; only the kernel is fixed."""
    import functools
    import os
    import subprocess
    import sys

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("OPENBLAS_CORETYPE") == MEASURED_KERNEL:
            return test(*args, **kwargs)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"{__file__}::{test.__name__}"], capture_output=True, text=True,
                              env={**os.environ, "OPENBLAS_CORETYPE": MEASURED_KERNEL}, cwd=os.path.dirname(
                                  os.path.dirname(os.path.abspath(__file__))))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return run



def _gradient_case_inputs(kv_heads=4, bias=True, tq=7, tk=9, causal=None):
    config = AttentionConfig(32, 4, None if kv_heads == 4 else kv_heads, bias=bias)
    params = make_params(config, seed=21)
    inputs = form_inputs("separate", config, 2, tq, tk, seed=21, causal=causal)
    return params, inputs, np.random.default_rng(22).standard_normal((2, tq, 32))


def test_magnitudes_are_far_above_the_gradients_of_query_and_key_where_the_softmax_backward_cancels():
    params, inputs = build(CANCELLING)
    cotangent = np.random.default_rng(3).standard_normal((1, 1, 2))
    exact, terms = reference_vjp(params, inputs, cotangent), reference_vjp_magnitudes(params, inputs, cotangent)
    assert terms["key"].max() > 50 * np.abs(exact["key"]).max()
    assert terms["W_k"].max() > 50 * np.abs(exact["W_k"]).max()


GROWTH_VARIANTS = [(d, 4, True, 7, 9, None) for d in ("float32", "float64", "bfloat16", "float16")] + \
    [("float32", 4, False, 9, 9, "top-left"), ("float32", 2, False, 7, 9, None)]


def _bound_growth(dtype, kv_heads, bias, tq, tk, causal) -> dict[str, float]:
    """Each gradient's bound under today's rule over the bound of the rule before 2026-12-02 (the textbook naive
    error alone, n = batch x max(Tq, Tk), floor magnitude max(1, |ref|)), on the gradient case's inputs."""
    params, inputs, cotangent = _gradient_case_inputs(kv_heads, bias, tq, tk, causal)
    exact = reference_vjp(params, inputs, cotangent)
    textbook = reference_vjp(params, inputs, cotangent, dtype=naive_dtype(dtype))
    estimates = naive_gradients(params, inputs, cotangent, dtype, "separate")
    terms = input_gradient_terms(reference_vjp_magnitudes(params, inputs, cotangent), "separate")
    out = {}
    for name in exact:
        old = tolerance_from(exact[name], textbook[name], dtype, length=2 * max(tq, tk)).bound
        honest = max((e[name] for e in estimates), key=lambda a: max_abs_error(a, exact[name]))
        out[name] = tolerance_from(exact[name], honest, dtype, length=gradient_reduction_length(params, inputs),
                                   terms=terms[name]).bound / old
    return out


def test_bound_growth_on_ordinary_gradients_is_at_most_about_3x():
    """On the gradient case's inputs every bound grows by at most 3.4x (half precision: 2x), b_k's (whose exact
    gradient is 0 by the softmax's shift invariance, so its floor was eps-sized) by at most 4.5x (3.2x); ``-s``
    prints the table. Up to 1.85x came with the floor's terms and FlashAttention's backward, the rest in float32
    and float64 with the score-error estimate of FlashAttention's recomputed weights (later the same day: 3.21x,
    b_k 4.26x), which no normalisation evens out."""
    for variant in GROWTH_VARIANTS:
        growth = _bound_growth(*variant)
        others = {n: g for n, g in growth.items() if n != "b_k"}
        worst = max(others, key=others.get)
        print(f"{variant}: max {others[worst]:.2f}x ({worst}), median {np.median(list(others.values())):.2f}x"
              + (f", b_k {growth['b_k']:.2f}x" if "b_k" in growth else ""))
        half = variant[0] in ("bfloat16", "float16")
        assert max(others.values()) <= (2.0 if half else 3.4), (variant, growth)
        assert growth.get("b_k", 1.0) <= (3.2 if half else 4.5), (variant, growth)


@on_measured_blas_kernel
def test_output_bounds_over_the_grid_grow_by_at_most_2_3x():
    """The score-error estimate leaves most output bounds of ordinary inputs near what they were: over every GRID
    row (T capped at 129 to keep the test short; the T = 1000 rows measured alike) and dtype the bound with it is at
    most 2.3 x the bound from the two rounding algorithms alone. Before its q and k projections carried their
    rounding in layers without a q/k norm (2026-12-07): median 1.00 x, the most 1.54 x (more_keys in float32 and
    float64); with it, median 1.16 x, the most 2.28 x (more_keys; multi_query 1.62 x, short_with_bias 1.54 x); in
    half precision, whose projections' error is still float32's, 1.56 x (more_keys in bfloat16, from the textbook
    estimate in that dtype) as before."""
    from mha_harness.cases.agreement import GRID
    from mha_harness.conformance.casekit import naive_forwards
    from mha_harness.contract.params import make_inputs
    from mha_harness.contract.tolerance import farthest
    for dtype in ("float32", "float64", "bfloat16", "float16"):
        for batch, heads, d_head, tq, tk, bias, kv in GRID.values():
            config = AttentionConfig(heads * d_head, heads, kv, bias=bias)
            params = make_params(config, seed=tq + tk)
            inputs = make_inputs(config, batch, min(tq, 129), min(tk, 129), seed=batch + heads)
            ref = reference_attention(params, inputs).output
            estimates = [e.output for e in naive_forwards(params, inputs, dtype)]
            old = tolerance_from(ref, farthest(estimates[:2], ref), dtype, length=inputs.tk).bound
            new = tolerance_from(ref, farthest(estimates, ref), dtype, length=inputs.tk).bound
            assert new <= 2.3 * old, (dtype, batch, heads, d_head, tq, tk, new / old)


def test_a_wrong_gradient_on_the_cancelling_example_still_fails():
    """The looser floor there is eps-sized: a key gradient off by 1e-9 relative (float64) is still a failure."""
    params, inputs = build(CANCELLING)
    cotangent = np.random.default_rng(3).standard_normal((1, 1, 2))
    exact = reference_vjp(params, inputs, cotangent)
    naive = reference_vjp(params, inputs, cotangent, dtype="float32")
    terms = reference_vjp_magnitudes(params, inputs, cotangent)
    wrong = {**exact, "key": exact["key"] * (1 + 1e-9)}
    with pytest.raises(CaseFailure, match="gradient of key"):
        assert_gradients_close(wrong, exact, naive, "float64", length=2, terms=terms)
    assert assert_gradients_close(exact, exact, naive, "float64", length=2, terms=terms) == 0.0


def test_the_floor_never_drops_below_the_one_from_the_reference():
    params, inputs, cotangent = _gradient_case_inputs()
    exact = reference_vjp(params, inputs, cotangent)
    naive = reference_vjp(params, inputs, cotangent, dtype="float32")
    tiny = {n: np.zeros_like(g) for n, g in exact.items()}
    for name in exact:
        old = tolerance_from(exact[name], naive[name], "float32", length=18)
        new = tolerance_from(exact[name], naive[name], "float32", length=18, terms=tiny[name])
        assert new.bound == old.bound


def _builtin(spec: str, name: str, needs: str):
    """The built-in backend ``name`` that ``mha_harness.implementations.<spec>`` (``module`` or ``module:object``,
    default object ``backends``) produces; the test skips where ``needs`` is not installed."""
    if importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    from mha_harness.registry import backends_from_spec
    module, _, obj = spec.partition(":")
    return next(b for b in backends_from_spec(f"mha_harness.implementations.{module}:{obj or 'backends'}")
                if b.name == name)


@pytest.mark.parametrize("module, name, needs", [
    ("torch_eager", "torch-eager", "torch"), ("torch_nn_mha", "torch-nn-mha", "torch"),
    ("jax_explicit", "jax-explicit", "jax"), ("flax_mha", "flax-mha", "flax")])
def test_correct_backends_pass_the_cancelling_example(module, name, needs):
    # raised CaseFailure "gradient of key ... (1.06-2.06 x the bound)" before
    check_example(_builtin(module, name, needs), CANCELLING)


FLASH_RECOMPUTE = {"dtype": "float32", "form": "self", "batch": 1, "tq": 9, "tk": 9, "heads": 1, "kv_heads": 1,
                   "d_head": 1, "bias": False, "causal": None, "padding": None, "attn_mask": None, "logit_scale": 10,
                   "cut": 8, "poison": "random", "gradients": True, "malformed": None, "seed": 3}
ONE_KEY = {"dtype": "float32", "form": "separate", "batch": 1, "tq": 1, "tk": 1, "heads": 1, "kv_heads": 1,
           "d_head": 12, "bias": False, "causal": None, "padding": None, "attn_mask": None, "logit_scale": 1, "cut": 0,
           "poison": "random", "gradients": True, "malformed": None, "seed": 0}
SCALED_QUERIES = {"dtype": "float32", "form": "separate", "batch": 2, "tq": 4, "tk": 8, "heads": 1, "kv_heads": 1,
                  "d_head": 14, "bias": False, "causal": None, "padding": None, "attn_mask": None,
                  "logit_scale": 100, "cut": 8, "poison": "random", "gradients": False, "malformed": None, "seed": 0}


def test_the_flash_backward_estimate_is_the_error_torchs_flash_kernel_makes():
    """On FLASH_RECOMPUTE torch-sdpa-flash-cpu's W_v gradient is off by 6.53e-6 (1.47 x the textbook bound): the
    FlashAttention-2 backward rounded in float32 makes the same error; the textbook one 8.1e-7."""
    params, inputs = build(FLASH_RECOMPUTE)
    cotangent = np.random.default_rng(6).standard_normal((1, 9, 1))
    exact = reference_vjp(params, inputs, cotangent)
    textbook = reference_vjp(params, inputs, cotangent, dtype="float32")
    flash = reference_vjp(params, inputs, cotangent, dtype="float32", flash=True)
    assert np.max(np.abs(flash["W_v"] - exact["W_v"])) > 5 * np.max(np.abs(textbook["W_v"] - exact["W_v"]))


@on_measured_blas_kernel
def test_the_scaled_queries_estimate_is_larger_at_large_logits():
    params, inputs = build(SCALED_QUERIES)
    exact = reference_attention(params, inputs).output
    errors = [np.max(np.abs(reference_attention(params, inputs, dtype="float32", scale_first=first).output - exact))
              for first in (False, True)]
    assert errors[1] > 4 * errors[0]


@pytest.mark.parametrize("example, module, name", [
    (FLASH_RECOMPUTE, "torch_sdpa", "torch-sdpa-flash-cpu"), (ONE_KEY, "torch_nn_mha", "torch-nn-mha"),
    (SCALED_QUERIES, "torch_sdpa", "torch-sdpa-math-cpu")])
def test_correct_torch_kernels_pass_what_the_search_flagged(example, module, name):
    check_example(_builtin(module, name, "torch"), example)


def _example(dtype="float32", form="separate", tq=4, tk=15, d_head=2, heads=1, kv_heads=1, bias=False,
             padding=None, attn_mask=None, logit_scale=100, cut=14, gradients=True, seed=0):
    return {"dtype": dtype, "form": form, "batch": 1, "tq": tq, "tk": tk, "heads": heads, "kv_heads": kv_heads,
            "d_head": d_head, "bias": bias, "causal": None, "padding": padding, "attn_mask": attn_mask,
            "logit_scale": logit_scale, "cut": cut, "poison": "random", "gradients": gradients, "malformed": None,
            "seed": seed}


_ADDITIVE = {"kind": "additive", "per": "shared", "density": 1.0, "empty_rows": [], "seed": 0, "magnitude": 1.0}
#: what `mha-harness search --backend torch-nn-mha --backend torch-sdpa-flash-cpu --backend torch-sdpa-math-cpu
#: --backend onnxruntime-cpu --seed S --max-examples 200` (S = 0..3) stopped at before the score-error estimate:
#: (example, module, backend, what failed and by how much)
LARGE_LOGITS = [
    (_example(), "torch_sdpa", "torch-sdpa-flash-cpu", "gradient of W_v, 9.22x"),
    (_example(), "torch_nn_mha", "torch-nn-mha", "gradient of W_v, 9.22x"),
    (_example(form="self", tq=15, d_head=3, logit_scale=10), "torch_nn_mha", "torch-nn-mha",
     "gradient of value, 1.04x"),
    (_example(form="self", tq=15, d_head=3, logit_scale=10), "torch_sdpa", "torch-sdpa-flash-cpu",
     "gradient of value, 1.04x"),
    (_example(tq=1, tk=1, attn_mask=_ADDITIVE, logit_scale=10, cut=0, seed=1), "torch_sdpa", "torch-sdpa-flash-cpu",
     "gradient of W_v, 1.14x"),
    (_example(tq=1, tk=1, attn_mask=_ADDITIVE, logit_scale=10, cut=0, seed=1), "torch_nn_mha", "torch-nn-mha",
     "gradient of W_v, 1.14x"),
    (_example(dtype="float64", tq=6, tk=2, d_head=4, bias=True, cut=1, gradients=False), "torch_sdpa",
     "torch-sdpa-math-cpu", "output, 1.51x"),
    (_example(form="self", tq=16, tk=16, heads=3, d_head=12, bias=True, padding={"valid": [4], "side": "end"},
              cut=15, gradients=False, seed=3), "ort_attention", "onnxruntime-cpu", "output, 1.02x"),
]


@pytest.mark.parametrize("example, module, name, before", LARGE_LOGITS,
                         ids=[f"{n}-{b.split(',')[0].replace(' ', '-')}-{e['logit_scale']}x"
                              for e, _, n, b in LARGE_LOGITS])
def test_correct_kernels_pass_at_large_logits(example, module, name, before):
    check_example(_builtin(module, name, "onnxruntime" if module == "ort_attention" else "torch"), example)


def _logits_x1000_examples(count: int = 40) -> list[dict]:
    """Seeded float32 examples at logits x1000, beyond the search's space (float32 stops at x100, where exp
    overflows without max subtraction): batch 1-2, Tq up to 33, Tk up to 127, half of them with gradients."""
    rng = np.random.default_rng(7)
    out = []
    for seed in range(count):
        heads = int(rng.choice([1, 2]))
        out.append(_example(tq=int(rng.choice([1, 4, 9, 16, 33])), tk=int(rng.choice([1, 2, 9, 15, 64, 127])),
                            heads=heads, kv_heads=heads, d_head=int(rng.choice([1, 3, 8, 16])),
                            bias=bool(rng.integers(0, 2)), logit_scale=1000, cut=0,
                            gradients=bool(rng.integers(0, 2)), seed=seed) | {"batch": int(rng.integers(1, 3))})
    return out


@pytest.mark.parametrize("spec, name", [
    ("numpy_naive:NumpyNaive", "numpy-naive"), ("numpy_tiled:NumpyTiled", "numpy-tiled"),
    ("torch_sdpa:backends", "torch-sdpa-math-cpu"), ("torch_sdpa:backends", "torch-sdpa-flash-cpu"),
    ("torch_eager:backends", "torch-eager")])
def test_correct_kernels_pass_at_logits_x1000(spec, name):
    """Before the score-error estimate 11 of these 200 checks failed (torch-sdpa-flash-cpu's gradient of W_v up to
    146 x the bound, the outputs of three torch kernels up to 1.17 x); the numpy kernels passed."""
    backend = _builtin(spec, name, "torch" if spec.startswith("torch") else "numpy")
    for example in _logits_x1000_examples():
        check_example(backend, example)


def test_the_score_error_estimate_is_the_flash_kernels_error_at_large_logits():
    """On the first LARGE_LOGITS example the W_v gradient of FlashAttention's backward whose recomputed exponents
    carry one float32 rounding is off by more than 10x (17x measured) the two rounding algorithms' (torch's flash
    kernel: 2.66e-5, 9.2x their bound): the exponent ``s - lse`` of 100s loses digits no normalisation gives back."""
    params, inputs = build(LARGE_LOGITS[0][0])
    cotangent = np.random.default_rng(0).standard_normal((1, 4, 2))
    exact = reference_vjp(params, inputs, cotangent)["W_v"]
    rounding = max(max_abs_error(reference_vjp(params, inputs, cotangent, dtype="float32", flash=f)["W_v"], exact)
                   for f in (False, True))
    erred = max_abs_error(reference_vjp(params, inputs, cotangent, flash=True, score_error_of="float32")["W_v"], exact)
    assert erred > 10 * rounding, (erred, rounding)


def test_a_wrong_output_at_large_logits_still_fails():
    """The score-error estimate is a rounding's size: an output off by 1e-4 relative at logits x100 (float32) is
    still a failure, and so is the reference's own output with the scale of d_model instead of d_head."""
    from mha_harness.conformance.casekit import assert_close, tolerance_for
    params, inputs = build(LARGE_LOGITS[-2][0] | {"dtype": "float32"})
    expected, tol = tolerance_for(params, inputs, "float32")
    with pytest.raises(CaseFailure):
        assert_close(expected * (1 + 1e-4), expected, tol, "output")
    params, inputs = build(LARGE_LOGITS[-1][0])
    expected, tol = tolerance_for(params, inputs, "float32")
    assert tol.bound < 1e-4 * np.abs(expected).max()
    from mha_harness.contract.mistakes import with_score_scale
    d_model_scale = reference_attention(with_score_scale(params, np.sqrt(1 / params.config.num_heads)), inputs)
    with pytest.raises(CaseFailure):
        assert_close(d_model_scale.output, expected, tol, "output")


@pytest.mark.parametrize("scale", [100, 1000])
def test_a_gradient_one_percent_wrong_at_large_logits_still_fails(scale):
    """The score-error estimate's gradient bounds stay far below a real mistake: W_v and value 1% off fail."""
    params, inputs = build(LARGE_LOGITS[0][0] | {"logit_scale": scale})
    cotangent = np.random.default_rng(0).standard_normal((1, 4, 2))
    exact = reference_vjp(params, inputs, cotangent)
    terms = input_gradient_terms(reference_vjp_magnitudes(params, inputs, cotangent), "separate")
    naive = naive_gradients(params, inputs, cotangent, "float32", "separate")
    for name in ("W_v", "value"):
        wrong = dict(exact)
        wrong[name] = exact[name] * 1.01
        with pytest.raises(CaseFailure, match=f"gradient of {name}"):
            assert_gradients_close(wrong, exact, naive, "float32", length=gradient_reduction_length(params, inputs),
                                   terms=terms)


def test_a_huge_finite_mask_value_does_not_make_the_bound_vacuous():
    """A row whose every key carries float32's most negative value (a common way to mask) has uniform weights in
    any precision: the score-error estimate rounds the mask as a float32 kernel does, so the bound stays small and
    a zero output fails."""
    from mha_harness.conformance.casekit import assert_close, tolerance_for
    from mha_harness.contract.params import make_inputs
    config = AttentionConfig(32, 4)
    params = make_params(config, seed=1)
    mask = np.zeros((16, 16))
    mask[3, :] = np.finfo(np.float32).min
    mask[5, 8:] = np.finfo(np.float32).min
    inputs = make_inputs(config, 2, 16, seed=2, attn_mask=mask)
    expected, tol = tolerance_for(params, inputs, "float32")
    assert tol.bound < 1e-4 * np.abs(expected).max(), tol.describe()
    with pytest.raises(CaseFailure):
        assert_close(np.zeros_like(expected), expected, tol, "output")


def test_score_error_of_names_the_accepted_dtypes():
    params, inputs = build(LARGE_LOGITS[-2][0])
    with pytest.raises(ValueError, match="score_error_of: got 'float8'; accepted: None or one of float64"):
        reference_attention(params, inputs, score_error_of="float8")


def test_a_separate_form_backend_searched_with_one_x_may_take_separate_arrays():
    """The last malformed call of a one-x example is 'separate query/key/value arrays': a malformed call only for a
    backend that declares one x or shared K/V."""
    from mha_harness.implementations.mutants import mutant_backends
    from mha_harness.implementations.numpy_naive import NumpyNaive
    one_x = {**CANCELLING, "dtype": "float32", "form": "self", "tk": 1, "gradients": False, "malformed": 9}
    calls = bad_calls(build(one_x)[1])
    assert len(calls) == 10 and calls[9][0] == "inputs"  # the index means the same call for every backend
    check_example(NumpyNaive(), one_x)
    self_form = next(b for b in mutant_backends() if b.name == "mutant-causal-mask-never-applied-self")
    check_example(self_form, {**one_x, "gradients": False})  # it refuses them, naming inputs


def test_the_flash_estimate_follows_the_empty_rows_convention():
    """In float64 the FlashAttention-2 backward equals the exact one, also for rows with no visible key under
    another convention (a declared uniform average): otherwise its 'error' would inflate the bound."""
    from mha_harness.contract.reference import _vjp, empty_rows_as
    params = make_params(AttentionConfig(16, 2, 1), seed=4)
    padding = np.array([[False, False, False], [True, True, True]])
    inputs = form_inputs("separate", params.config, 2, 4, 3, seed=4, key_padding_mask=padding)
    cotangent = np.random.default_rng(5).standard_normal((2, 4, 16))
    for convention in ("zeros", "uniform_average"):
        with empty_rows_as(convention):
            exact = reference_vjp(params, inputs, cotangent)
            flash = _vjp(params, inputs, cotangent, "float64", flash=True)
        for name in exact:
            np.testing.assert_allclose(flash[name], exact[name], atol=1e-12, err_msg=f"{convention} {name}")


def test_one_x_terms_combine_as_root_sum_squares():
    from mha_harness.conformance.casekit import input_gradient_terms
    terms = {"query": np.array([3.0]), "key": np.array([4.0]), "value": np.array([12.0]), "W_q": np.array([1.0])}
    combined = input_gradient_terms(terms, "self")
    assert combined["query"][0] == 13.0 and combined["W_q"][0] == 1.0


#: what `mha-harness search --backend torch-eager --dtype bfloat16 --seed 7 --max-examples 600` (and a seed scan of
#: the first example) stopped at before the half-precision score estimate, 2026-12-06: torch-eager's own bfloat16
#: (scores of about 9 and 100 after the q/k norm's gains, where a score's bfloat16 rounding moves its weight by
#: several percent), (example, what failed and by how much)
HALF_TEXTBOOK = [
    (_example(dtype="bfloat16", tq=4, tk=4, heads=2, kv_heads=2, d_head=1, logit_scale=10, cut=0, seed=52)
     | {"qk_norm": "rms_per_head"}, "gradient of W_v, 1.03x"),
    (_example(dtype="bfloat16", form="self", tq=9, tk=9, d_head=16, cut=8, gradients=False, seed=1)
     | {"qk_norm": "layer_per_head_no_bias", "decode_step": True}, "decode step's first call, 1.71x"),
]


@pytest.mark.parametrize("example, before", HALF_TEXTBOOK, ids=[b.split(",")[0] for _, b in HALF_TEXTBOOK])
def test_torch_eager_passes_its_half_precision_search_findings(example, before):
    check_example(_builtin("torch_eager", "torch-eager", "torch"), example)


def test_the_half_precision_score_estimate_is_what_covers_torch_eagers_bfloat16_gradient():
    """On the first HALF_TEXTBOOK example torch-eager's W_v gradient (0.198 off: its bfloat16 k after the norm
    rounds to the other neighbour of the naive estimate's, and the score of about 8 with it) exceeds the bound of the
    other estimates and is within the bound with the half-precision one."""
    from mha_harness.contract.expected import gradient_bounds, gradient_reduction_length
    backend = _builtin("torch_eager", "torch-eager", "torch")
    params, inputs = build(HALF_TEXTBOOK[0][0])
    cotangent = np.random.default_rng(55).standard_normal((1, 4, 2))
    got = backend.load(params, dtype="bfloat16").vjp(inputs, cotangent)["W_v"]
    exact = reference_vjp(params, inputs, cotangent)
    terms = reference_vjp_magnitudes(params, inputs, cotangent)
    estimates = naive_gradients(params, inputs, cotangent, "bfloat16", "separate")
    others = [reference_vjp(params, inputs, cotangent, dtype="bfloat16", flash=flash) for flash in (False, True)] + \
        [reference_vjp(params, inputs, cotangent, flash=flash, score_error_of="float32", score_error_sign=sign)
         for flash in (False, True) for sign in (1, -1)]
    assert len(estimates) == len(others) + 2  # the textbook estimate in bfloat16, with each sign (a q/k norm)
    length = gradient_reduction_length(params, inputs)
    error = max_abs_error(got, exact["W_v"])
    without = gradient_bounds(exact, others, "bfloat16", length, terms)["W_v"][1].bound
    with_it = gradient_bounds(exact, estimates, "bfloat16", length, terms)["W_v"][1].bound
    assert without < error <= with_it, (without, error, with_it)


def test_a_wrong_half_precision_output_still_fails():
    """Where the half-precision estimate grows an ordinary bound most (the grid's more_keys row in bfloat16, 1.56x:
    0.128, of which 0.0625 is the eps * sqrt(64 keys) floor, against max |output| 0.88), an output 20% off fails,
    and so does the reference's own output with the scale of d_model instead of d_head (0.38 off), rounded to
    bfloat16."""
    from mha_harness.cases.agreement import GRID
    from mha_harness.conformance.casekit import assert_close, tolerance_for
    from mha_harness.contract.conventions import round_to
    from mha_harness.contract.mistakes import with_score_scale
    from mha_harness.contract.params import make_inputs
    batch, heads, d_head, tq, tk, bias, kv = GRID["more_keys"]
    config = AttentionConfig(heads * d_head, heads, kv, bias=bias)
    params = make_params(config, seed=tq + tk)
    inputs = make_inputs(config, batch, tq, tk, seed=batch + heads)
    expected, tol = tolerance_for(params, inputs, "bfloat16")
    with pytest.raises(CaseFailure):
        assert_close(expected * 1.2, expected, tol, "output")
    d_model_scale = reference_attention(with_score_scale(params, np.sqrt(1 / heads)), inputs).output
    with pytest.raises(CaseFailure):
        assert_close(round_to(d_model_scale, "bfloat16"), expected, tol, "output")


#: an outside user's search of transformers 5.25's Gemma2Attention (a local layer: soft cap 50, scores scaled by
#: 256 ** -0.5, rotary, biases; float32) stopped here: two keys, weights 0.26 / 0.74 in the second row, max error
#: 1.01e-6 against a bound of 6.76e-7, while the score-error estimate had drawn one sign for both keys (6.1e-8)
TWO_KEYS_CAPPED = _example(form="self", tq=2, tk=2, d_head=8, bias=True, cut=1, gradients=False) | {
    "rotary": "half_split", "rotary_base": 10000.0}


def test_the_two_heaviest_keys_of_a_row_round_apart_in_the_score_error_estimate():
    from mha_harness.contract.reference import _apart_at_the_top
    signs = np.ones((1, 1, 3, 4))
    scores = np.array([[[[0.0, 5.0, 4.0, -1.0], [3.0, 2.0, 1.0, 0.0], [1.0, 9.0, 8.0, 7.0]]]])
    allowed = np.array([[[[True, True, True, True], [True, False, False, False], [True, False, True, True]]]])
    out = _apart_at_the_top(signs.copy(), scores, allowed)
    np.testing.assert_array_equal(out[0, 0], [[1, 1, -1, 1], [1, 1, 1, 1], [1, 1, 1, -1]])
    flipped = _apart_at_the_top(-signs, scores, allowed)  # set against the largest's sign, whichever it drew
    np.testing.assert_array_equal(flipped, -out)


def test_a_two_key_row_whose_draw_rounded_alike_still_bounds_the_gemma_layers_error():
    """On TWO_KEYS_CAPPED, capped and scaled as Gemma 2's local layer, the score-error estimate's output error is
    2.1e-6 (its two keys now round apart) and the bound covers the 1.01e-6 transformers' layer made."""
    from mha_harness.conformance.casekit import tolerance_for
    from mha_harness.contract.reference import logit_softcap_as, score_scale_as
    params, inputs = build(TWO_KEYS_CAPPED)
    with logit_softcap_as(50.0), score_scale_as(256 ** -0.5):
        exact = reference_attention(params, inputs).output
        erred = reference_attention(params, inputs, score_error_of="float32").output
        _, tol = tolerance_for(params, inputs, "float32")
    assert max_abs_error(erred, exact) > 1.5e-6
    assert tol.bound > 3 * 1.01e-6, tol.describe()


#: what `mha-harness search --backend torch-eager --backend numpy-naive --seed 31 --max-examples 600` stopped at,
#: 2026-12-06 (before as after the estimates above): torch-eager's own float32 output at 1.26 x the bound. Its
#: projections', norm's and rotation's roundings each move the output by about 1.7e-6 through the scores; the
#: score-error estimate's own error (4.8e-7) had its projections' error before the norm and its scores' error cancel
NORMED_ROTARY = _example(form="self", tq=5, tk=5, d_head=10, bias=True, cut=4, gradients=False, seed=1) | {
    "qk_norm": "rms_per_head", "rotary": "half_split", "rotary_base": 500000.0, "rotary_dims": 8}


def test_a_normed_layers_score_error_is_also_taken_the_other_way_round():
    """In a layer with a q/k norm the estimate also runs with its scores' error negated (its projections' kept):
    torch-eager passes NORMED_ROTARY, and the negated draw is what covers it (1.4e-5 against 4.8e-7)."""
    from mha_harness.contract.expected import score_error_signs
    check_example(_builtin("torch_eager", "torch-eager", "torch"), NORMED_ROTARY)
    params, inputs = build(NORMED_ROTARY)
    assert score_error_signs(params) == (1, -1)
    assert score_error_signs(make_params(AttentionConfig(16, 2), seed=0)) == (1,)
    exact = reference_attention(params, inputs).output
    drawn, negated = (max_abs_error(reference_attention(params, inputs, score_error_of="float32",
                                                        score_error_sign=sign).output, exact) for sign in (1, -1))
    assert negated > 10 * drawn, (drawn, negated)
    with pytest.raises(ValueError, match="score_error_sign: got 0; accepted: 1 or -1"):
        reference_attention(params, inputs, score_error_of="float32", score_error_sign=0)


#: search's float64 finding at logits x 1000 (`mha-harness search --backend torch-eager --backend numpy-naive --seed 43
#: --max-examples 600`, 2026-12-06): torch-eager at 1.04 x the bound on one row, while the reference's q and k
#: projections were float64 matmuls (docs/cases.md, the tolerance rule: "The float64 reference's projections")
FLOAT64_REFERENCE_OFF = {"dtype": "float64", "form": "separate", "batch": 2, "tq": 255, "tk": 127, "heads": 4,
                         "kv_heads": 1, "d_head": 1, "bias": False, "causal": None,
                         "padding": {"valid": [127, 108], "side": "start"}, "attn_mask": None, "logit_scale": 1000,
                         "cut": 126, "poison": "random", "gradients": False, "malformed": None, "seed": 3}


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="needs an extended long double (x86's 80-bit)")
def test_the_float64_reference_is_exact_where_its_projections_cancel():
    """On the row search stopped torch-eager's float64 layer at, a query head of 0.08 sums terms of about 30: a
    float64 matmul's rounding of it scaled every score of the row, and the reference was 4.2e-14 off a long-double
    computation of the layer, 7x farther than torch-eager. With exact projections the reference is within two
    float64 roundings of the long double there. On an AVX-512 box (OpenBLAS's SkylakeX kernels, 2026-12-07)
    torch-eager's float64 layer and the harness's own textbook one (numpy-naive) were both 4.2e-14 off there,
    1.2x the bound of the day (5.7e-15 on the AVX2 box where search found the row): that rounding of a q or k
    projection whose terms cancel, which logits x1000 turn into the row's largest error, was modelled only in
    layers with a q/k norm. Now the score-error estimate carries it in every layer (bound 3.2e-13 there), and
    both correct layers pass the example on every CPU."""
    pytest.importorskip("torch")
    from mha_harness.implementations.torch_eager import TorchEager
    params, inputs = build(FLOAT64_REFERENCE_OFF)
    b, t = 1, 65
    wide = np.longdouble
    q = inputs.query[b, t].astype(wide) @ params.W_q.astype(wide)
    k, v = (getattr(inputs, n)[b].astype(wide) @ getattr(params, f"W_{n[0]}").astype(wide) for n in ("key", "value"))
    heads = []
    for h in range(4):
        scores = np.where(inputs.key_padding_mask[b], -np.inf, q[h] * k[:, 0])
        weights = np.exp(scores - scores.max())
        heads.append((weights / weights.sum() * v[:, 0]).sum())
    truth = (np.array(heads) @ params.W_o.astype(wide)).astype(np.float64)
    reference = reference_attention(params, inputs).output[b, t]
    plain_q = inputs.query[b, t] @ params.W_q
    assert np.abs(plain_q - q.astype(np.float64))[1] > 100 * np.spacing(np.abs(plain_q[1]))  # head 1: -0.084
    assert max_abs_error(reference, truth) <= 2 * np.spacing(np.abs(truth).max())
    from mha_harness.contract.expected import tolerance_for
    from mha_harness.implementations.numpy_naive import NumpyNaive
    got = {name: np.asarray(backend.load(params, dtype="float64").compute(inputs).output)[b, t]
           for name, backend in (("torch-eager", TorchEager()), ("numpy-naive", NumpyNaive()))}
    errors = {name: max_abs_error(out, truth) for name, out in got.items()}
    _, tol = tolerance_for(params, inputs, "float64")
    assert max(errors.values()) <= tol.bound / 3, (errors, tol)
    check_example(TorchEager(), FLOAT64_REFERENCE_OFF)
    check_example(NumpyNaive(), FLOAT64_REFERENCE_OFF)
