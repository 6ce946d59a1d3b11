"""Framework adapters: parameter loading must be exact, and a wrong layout must fail a case."""
from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

import mha_harness
from mha_harness import AttentionBackend

CASES = ["check_output_projection_mixes_heads", "check_heads_are_separated"]
torch_only = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
jax_only = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="jax/flax are not installed")


class MisloadedBackend(AttentionBackend):
    """A real backend whose freshly loaded parameters are then laid out wrongly by ``corrupt(loaded, params)``:
    the adapter bug a case must catch, injected by composition (nothing in the backend's module is patched)."""

    def __init__(self, inner: AttentionBackend, corrupt):
        self.inner, self.corrupt = inner, corrupt
        self.name = f"{inner.name}-misloaded"
        self.capabilities, self.divergences = inner.capabilities, inner.divergences

    def availability(self):
        return self.inner.availability()

    def load_native(self, params, dtype):
        loaded = self.inner.load_native(params, dtype)
        self.corrupt(loaded, params)
        return loaded


def _transposed_linear(loaded, params):
    """The classic layout slip: torch's (out, in) weights used as x @ W (square, so shapes still fit)."""
    loaded.w = {name: loaded.tensor(a.T if a.ndim == 2 else a) for name, a in params.arrays().items()}


def _transposed_tree(loaded, params):
    loaded.params = {name: loaded.array(a.T if a.ndim == 2 else a) for name, a in params.arrays().items()}


def _wrong_in_proj(loaded, params):
    """in_proj_weight packed without the transpose to torch's (out, in) layout."""
    with loaded.torch.no_grad():
        loaded.module.in_proj_weight.copy_(loaded.tensor(np.concatenate([params.W_q, params.W_k, params.W_v], axis=0)))


def _wrong_flax_tree(loaded, params):
    """Kernels split head-minor ((d, d_head, heads) transposed) instead of (d, heads, d_head)."""
    from mha_harness.implementations.flax_mha import to_flax_tree
    tree = to_flax_tree(params)
    c = params.config
    for name, w in (("query", "q"), ("key", "k"), ("value", "v")):
        tree[name]["kernel"] = getattr(params, f"W_{w}").reshape(c.d_model, c.d_head, c.num_heads).transpose(0, 2, 1)
    loaded.params = loaded.jax.tree_util.tree_map(loaded.array, tree)


ADAPTERS = [
    pytest.param("torch-eager", _transposed_linear, marks=torch_only),
    pytest.param("torch-sdpa-math-cpu", _transposed_linear, marks=torch_only),
    pytest.param("torch-nn-mha", _wrong_in_proj, marks=torch_only),
    pytest.param("jax-explicit", _transposed_tree, marks=jax_only),
    pytest.param("jax-dpa", _transposed_tree, marks=jax_only),
    pytest.param("flax-mha", _wrong_flax_tree, marks=jax_only),
]


@pytest.mark.parametrize("backend, corrupt", ADAPTERS)
def test_adapter_loads_parameters_exactly_and_a_wrong_layout_fails(backend, corrupt):
    registry = mha_harness.load_registry()
    good = mha_harness.check(backend, cases=CASES, registry=registry)
    assert good.ok, [r.message for r in good.failures()]
    bad = mha_harness.check(MisloadedBackend(registry.get(backend).backend, corrupt), cases=CASES)
    assert not bad.ok and any(r.status == "failed" for r in bad.results)


@torch_only
def test_nn_mha_parameter_count_comes_from_module_parameters():
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.implementations.torch_nn_mha import TorchNnMha
    shapes = TorchNnMha().native_parameter_shapes(AttentionConfig(64, 8, bias=True))
    assert shapes == {"in_proj_weight": (192, 64), "in_proj_bias": (192,), "out_proj.weight": (64, 64),
                      "out_proj.bias": (64,)}


@jax_only
def test_flax_parameter_count_comes_from_its_param_tree():
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.implementations.flax_mha import FlaxMha
    shapes = FlaxMha().native_parameter_shapes(AttentionConfig(64, 8, bias=True))
    assert shapes["['query']['kernel']"] == (64, 8, 8) and shapes["['out']['kernel']"] == (8, 8, 64)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 4 * 64 * 64 + 4 * 64


@torch_only
def test_sdpa_kernel_check_rejects_a_kernel_that_did_not_run():
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_params
    from mha_harness.implementations.torch_sdpa import TorchSdpa
    loaded = TorchSdpa("flash", "cpu").load(make_params(AttentionConfig(8, 2)), dtype="float32")
    with pytest.raises(RuntimeError, match="the flash kernel was requested but torch ran the math decomposition"):
        loaded._verify_kernel(["aten._safe_softmax.default", "aten.bmm.default"])
    loaded._verify_kernel(["aten._scaled_dot_product_flash_attention_for_cpu.default"])


@torch_only
def test_sdpa_kernels_torch_refuses_on_cpu_say_so():
    from mha_harness.implementations.torch_sdpa import TorchSdpa
    reason = TorchSdpa("efficient", "cpu").availability()
    assert reason.startswith("torch refuses the efficient kernel on cpu")


@pytest.mark.parametrize("backend", [pytest.param("torch-sdpa-math-cpu", marks=torch_only),
                                     pytest.param("torch-nn-mha", marks=torch_only),
                                     pytest.param("jax-dpa", marks=jax_only),
                                     pytest.param("flax-mha", marks=jax_only)])
def test_declared_divergences_are_observed_not_assumed(backend):
    """Every declared divergence shows up as an expected divergence: none is an unexpected pass."""
    report = mha_harness.check(backend, cases=["check_fully_masked_rows_output_zeros",
                                               "check_padding_mask_blocks_padded_keys"])
    statuses = {r.status for r in report.results}
    assert "unexpected-pass" not in statuses and "failed" not in statuses
    assert "expected-divergence" in statuses


@pytest.mark.parametrize("backend", [pytest.param("torch-sdpa-math-cpu", marks=torch_only),
                                     pytest.param("torch-sdpa-flash-cpu", marks=torch_only),
                                     pytest.param("jax-dpa", marks=jax_only)])
@pytest.mark.parametrize("causal", [None, "top-left"])
def test_direct_library_call_computes_the_same_layer_as_the_backend(backend, causal):
    """The public hook fidelity times against the harness: the library called directly, same layer, same result."""
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_inputs, make_params
    config = AttentionConfig(32, 4)
    params, inputs = make_params(config), make_inputs(config, 2, 9, causal=causal)
    impl = mha_harness.load_registry().get(backend).backend
    direct = impl.direct_callable(inputs, params, dtype="float32")
    got = np.asarray(direct(), dtype=np.float64)
    expected = impl.load(params, dtype="float32").forward(inputs).output
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_direct_library_call_is_optional_and_refusals_are_unsupported():
    from mha_harness import Unsupported
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_inputs, make_params
    from mha_harness.implementations.numpy_naive import NumpyNaive
    config = AttentionConfig(8, 2)
    params, inputs = make_params(config), make_inputs(config, 1, 4)
    with pytest.raises(Unsupported, match="numpy-naive offers no direct library call"):
        NumpyNaive().direct_callable(inputs, params)
    if importlib.util.find_spec("torch"):
        from mha_harness.implementations.torch_sdpa import TorchSdpa
        with pytest.raises(Unsupported, match="no masks other than top-left causal"):
            TorchSdpa("math").direct_callable(inputs.replace(causal="bottom-right"), params)


@jax_only
@pytest.mark.parametrize("name", ["jax-explicit", "jax-dpa", "flax-mha"])
def test_jax_vjp_is_one_program_per_configuration_and_shape(name):
    """Gradients come from one jitted program (forward and backward together) per layer configuration and input
    shape, shared by every layer loaded with that configuration; it keeps no layer's parameters alive."""
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.contract.params import make_inputs, make_params
    from mha_harness.contract.reference import reference_vjp
    from mha_harness.implementations import _jax_common
    backend = mha_harness.load_registry().get(name).backend
    config = AttentionConfig(16, 2)
    inputs = make_inputs(config, 2, 5, 7, seed=3)
    cotangent = np.random.default_rng(4).standard_normal((2, 5, 16))
    for seed in (1, 2):  # a second layer, other parameters, same configuration
        params = make_params(config, seed=seed)
        got = backend.load(params, dtype="float64").vjp(inputs, cotangent)
        exact = reference_vjp(params, inputs, cotangent)
        for grad_name, expected in exact.items():
            np.testing.assert_allclose(got[grad_name], expected, rtol=1e-6, atol=1e-6, err_msg=grad_name)
    programs = [(key, p) for key, p in _jax_common._VJP_PROGRAMS.items() if key[1] is backend]
    assert len(programs) == 1
    assert programs[0][1]._cache_size() == 1  # one compiled program for both layers
    layers = _closure_layers(programs[0][1])
    assert layers and all(layer.params is None for layer in layers)


def _closure_layers(program):
    """The loaded layers a jitted vjp's traced function closes over."""
    from mha_harness.implementations._jax_common import JaxLoaded
    fn = getattr(program, "__wrapped__", program)
    return [c.cell_contents for c in (fn.__closure__ or ()) if isinstance(c.cell_contents, JaxLoaded)]


@jax_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_explicit_nan_safe_values_product_equals_three_products(dtype):
    """jax-explicit's NaN/inf-safe P @ V finds the NaN, +inf and -inf hits with one product over the three
    indicator matrices side by side: exactly the hits three separate products give (the same NaN and inf entries,
    outputs and gradients), and the finite entries the same up to the rounding of one float32 product (two
    programs that fuse the product differently may sum it in another order: on an AVX2-only EPYC, 2026-12-03, an
    entry differed by 4 units in the last place, bitwise equal on the AVX-512 boxes before)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from mha_harness.implementations.jax_explicit import _weighted_values

    def three_products(p, v):  # the earlier formulation, under the same lax.cond
        def safe(p, v):
            out = p @ jnp.where(jnp.isfinite(v), v, 0)
            touched = (p != 0).astype(v.dtype)
            out = jnp.where(touched @ (v == jnp.inf).astype(v.dtype) > 0, out + jnp.inf, out)
            out = jnp.where(touched @ (v == -jnp.inf).astype(v.dtype) > 0, out - jnp.inf, out)
            return jnp.where(touched @ jnp.isnan(v).astype(v.dtype) > 0, jnp.nan, out)
        return lax.cond(jnp.all(jnp.isfinite(v)), lambda p, v: p @ v, safe, p, v)

    rng = np.random.default_rng(0)
    p = rng.random((2, 3, 7, 9))
    p[rng.random(p.shape) < 0.4] = 0
    v = rng.standard_normal((2, 3, 9, 5))
    v[rng.random(v.shape) < 0.2] = np.nan
    v[0, 0, 2], v[1, 2, 5, 1] = np.inf, -np.inf
    p, v = jnp.asarray(p, dtype), jnp.asarray(v, dtype)
    cotangent = jnp.asarray(rng.standard_normal((2, 3, 7, 5)), dtype)

    def same(got, want, p, v):
        """Outputs and both gradients: identical NaN and inf entries; finite ones within the rounding of each one's
        product (n terms: 2 n eps times the sum of the terms' magnitudes)."""
        ap, av, ac = (np.abs(np.where(np.isfinite(x), np.asarray(x, np.float64), 0)) for x in (p, v, cotangent))
        sizes = (ap @ av, ac @ av.swapaxes(-1, -2), ap.swapaxes(-1, -2) @ ac)  # out, d/dp, d/dv
        eps = float(jnp.finfo(dtype).eps)
        for a, b, size, n in zip(got, want, sizes, (p.shape[-1], v.shape[-1], p.shape[-2])):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            np.testing.assert_array_equal(np.where(np.isinf(a), a, 0), np.where(np.isinf(b), b, 0))
            finite = np.isfinite(a)
            assert np.all(np.abs(a - b)[finite] <= 2 * n * eps * size[finite] + 1e-30), np.max(np.abs(a - b)[finite])

    got, pull_got = jax.vjp(lambda p, v: _weighted_values(jnp, p, v, values_finite=False), p, v)
    want, pull_want = jax.vjp(three_products, p, v)
    same((got, *pull_got(cotangent)), (want, *pull_want(cotangent)), p, v)
    # on finite values, the NaN-safe program and the plain product agree with the lax.cond formulation
    finite_v = jnp.where(jnp.isfinite(v), v, 1)
    want, pull_want = jax.vjp(three_products, p, finite_v)
    for values_finite in (True, False):
        got, pull_got = jax.vjp(functools.partial(_weighted_values, jnp, values_finite=values_finite), p, finite_v)
        same((got, *pull_got(cotangent)), (want, *pull_want(cotangent)), p, finite_v)


@pytest.mark.parametrize(("value", "w_v", "b_v", "dtype_max", "expected"), [
    (np.ones((2, 3, 4)), np.full((4, 4), 0.5), np.zeros(4), 65504.0, True),
    (np.ones((2, 3, 4)), np.full((4, 4), 0.5), None, 65504.0, True),
    (np.where(np.eye(4)[None, :3] > 0, np.nan, 1.0), np.full((4, 4), 0.5), None, 65504.0, False),  # a NaN value
    (np.ones((2, 3, 4)), np.full((4, 4), np.inf), None, 3.4e38, False),  # a non-finite parameter
    (np.full((1, 2, 4), 1e5), np.eye(4), None, 65504.0, False),  # casting the value to float16 overflows
    (np.full((1, 2, 4), 300.0), np.full((4, 4), 75.0), None, 65504.0, False),  # 300 * 4 * 75 = 90,000 overflows
    (np.full((1, 2, 4), 300.0), np.full((4, 4), 75.0), None, 3.4e38, True),  # ... but not in float32
    (np.ones((1, 2, 4)), np.eye(4), np.full(4, 4e4), 65504.0, False),  # a bias past half of the largest float16
    (np.ones((1, 2, 4)), np.eye(4), np.array([0.0, np.nan, 0.0, 0.0]), 3.4e38, False),  # a NaN bias
])
def test_jax_explicit_runs_the_nan_safe_program_whenever_projected_values_could_be_non_finite(
        value, w_v, b_v, dtype_max, expected):
    """The host-side choice between jax-explicit's two programs: the plain ``P @ V`` only when the projected values
    cannot hold NaN or inf (finite inputs and parameters, no overflow possible in the layer's dtype)."""
    from mha_harness.implementations.jax_explicit import value_projection_bounds, values_are_surely_finite

    assert values_are_surely_finite(value, value_projection_bounds(w_v, b_v), dtype_max) is expected


@jax_only
def test_jax_explicit_compiles_only_the_program_it_runs():
    """A call with finite values lowers to one straight-line program: no conditional whose untaken branch XLA
    would compile too (that doubled every jax-explicit compile of the suite)."""
    from mha_harness.contract.api import AttentionConfig, AttentionInputs
    from mha_harness.contract.params import make_params
    from mha_harness.implementations.jax_explicit import JaxExplicit, _compiled

    config = AttentionConfig(d_model=8, num_heads=2)
    layer = JaxExplicit("cpu").load_native(make_params(config), "float32")
    x = np.random.default_rng(0).standard_normal((1, 3, 8))
    native = layer.native_inputs(AttentionInputs(x, x, x))
    assert native["values_finite"] is True
    args = (layer.params, native["query"], native["key"], native["value"], native["allowed"], native["additive"])
    for values_finite in (True, False):
        hlo = _compiled(2, 2, False, values_finite).lower(*args).as_text()
        assert "conditional" not in hlo and "stablehlo.case" not in hlo and "stablehlo.if" not in hlo
