"""A third party's conformance case for mha-harness (the case-plugin example).

Installed, it runs wherever the built-in cases run: ``mha-harness check``, ``mha_harness.check()``, the pytest
plugin and the mutation score. A case is a function ``check_<property>(backend, **params)`` whose docstring states
the property, registered with ``@case``; it talks to the backend only through ``run`` (NumPy in, NumPy out).
"""
from __future__ import annotations

import numpy as np

from mha_harness import AttentionConfig, AttentionInputs, make_params
from mha_harness.conformance.casekit import Measurement, assert_close, case, run, tolerance_for


@case()
def check_identical_values_pass_through_unchanged(backend, *, dtype):
    """When every key and value token is the same vector x, the attention weights of a row sum to 1, so whatever
    the scores, every output row is the value projection of x through W_o: (x @ W_v + b_v) @ W_o + b_o.
    A softmax that is not normalised, or heads glued back in the wrong order, breaks it."""
    config = AttentionConfig(32, 4, bias=backend.capabilities.bias)
    params = make_params(config, seed=3)
    rng = np.random.default_rng(5)
    query = rng.standard_normal((2, 9, 32))
    token = rng.standard_normal((2, 1, 32))
    inputs = AttentionInputs(query, np.repeat(token, 9, axis=1), np.repeat(token, 9, axis=1))
    value = token @ params.W_v + (0 if params.b_v is None else params.b_v)
    expected = np.broadcast_to(value @ params.W_o + (0 if params.b_o is None else params.b_o), query.shape)
    _, tol = tolerance_for(params, inputs, dtype)
    got = run(backend, params, inputs, dtype).output
    return Measurement(max_error=assert_close(got, expected, tol, "output for identical value tokens"))
