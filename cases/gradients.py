"""Gradients (vector-Jacobian products) against the reference's exact gradients."""
from __future__ import annotations

import numpy as np

from mha_harness.cases._fixtures import ALL_FORMS, cross_ok, form_inputs, input_gradients
from mha_harness.conformance.casekit import Measurement, assert_gradients_close, case, require
from mha_harness.contract.api import AttentionConfig
from mha_harness.contract.params import make_params
from mha_harness.contract.reference import reference_vjp
from mha_harness.contract.tolerance import naive_dtype


def _gradient_variants(backend):
    caps = backend.capabilities
    out = []
    for dtype in caps.dtypes:  # an always-causal layer runs every variant causal: its parameters say so
        out.append({"dtype": dtype, "causal": caps.always_causal, "bias": caps.bias, "kv_heads": 4})
    if caps.causal_alignments and not caps.always_causal:
        out.append({"dtype": out[0]["dtype"] if "float32" not in caps.dtypes else "float32", "causal": True,
                    "bias": False, "kv_heads": 4})
    if caps.grouped_query:
        out.append({"dtype": "float32" if "float32" in caps.dtypes else caps.dtypes[0], "causal": caps.always_causal,
                    "bias": False, "kv_heads": 2})
    return out


@case(requires=("gradients",), variants=_gradient_variants, forms=ALL_FORMS)
def check_gradients_match_reference(backend, *, form, dtype, causal, bias, kv_heads):
    """Gradients of sum(output * cotangent) with respect to query, key, value and every parameter equal the
    reference's, within the tolerance rule applied to the naive backward in the same dtype. With one x the
    input gradient is d/dx (the sum over its three uses); with shared K/V, d/dx_kv sums the key and value parts."""
    config = AttentionConfig(32, 4, None if kv_heads == 4 else kv_heads, bias=bias)
    params = make_params(config, seed=21)
    # Tq != Tk where declared; the causal variant of a layer whose mask is optional is square, while an
    # always-causal layer, all of whose variants are causal, keeps Tq != Tk
    cross = cross_ok(backend) and (not causal or backend.capabilities.always_causal)
    inputs = form_inputs(form, config, 2, 7, 9 if cross else 7, seed=21,
                         causal=(backend.capabilities.causal_alignments[0] if causal else None))
    require(backend, *inputs.features(), f"dtype:{dtype}")
    cotangent = np.random.default_rng(22).standard_normal((2, 7, 32))
    got = backend.load(params, dtype=dtype).vjp(inputs, cotangent)
    exact = input_gradients(reference_vjp(params, inputs, cotangent), form)
    naive = input_gradients(reference_vjp(params, inputs, cotangent, dtype=naive_dtype(dtype)), form)
    worst = assert_gradients_close(got, exact, naive, dtype, length=inputs.batch * max(inputs.tq, inputs.tk))
    return Measurement(max_error=worst)
