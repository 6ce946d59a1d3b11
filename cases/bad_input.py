"""Bad input reaches the caller as a clear ValueError/TypeError naming the parameter."""
from __future__ import annotations

import numpy as np

from mha_harness.cases._fixtures import ALL_FORMS, form_inputs, small_layer
from mha_harness.conformance.casekit import CaseFailure, Measurement, case


def _with_query(inputs, query):
    """``inputs`` with a new query, keeping the form: with one x the same array is also key and value."""
    if inputs.form == "self":
        return inputs.replace(query=query, key=query, value=query)
    return inputs.replace(query=query)


def _bad_calls(inputs, d_model):
    """(parameter name that the message must contain, description, modified inputs), each in the inputs' form."""
    q, k, v, form = inputs.query, inputs.key, inputs.value, inputs.form
    nan_query = np.where(np.arange(q.shape[1])[None, :, None] == 2, np.nan, q)
    calls = [
        ("query", "query of width d_model + 1", _with_query(inputs, np.concatenate([q, q[..., :1]], -1))),
        ("query", "query of rank 2", _with_query(inputs, q[0])),
        ("query", "empty query sequence", _with_query(inputs, q[:, :0])),
        ("query", "NaN in the query", _with_query(inputs, nan_query)),
        ("key_padding_mask", "key_padding_mask of the wrong shape",
         inputs.replace(key_padding_mask=np.zeros((1, 3), bool))),
        ("key_padding_mask", "float key_padding_mask", inputs.replace(key_padding_mask=np.zeros(k.shape[:2]))),
        ("attn_mask", "attn_mask of the wrong shape", inputs.replace(attn_mask=np.ones((2, 2), bool))),
        ("attn_mask", "integer attn_mask", inputs.replace(attn_mask=np.ones((q.shape[1], k.shape[1]), np.int64))),
        ("causal", "causal='diagonal'", inputs.replace(causal="diagonal")),
    ]
    if form == "separate":
        calls += [("key", "key with another batch size", inputs.replace(key=k[:1], value=v[:1])),
                  ("value", "value shorter than key", inputs.replace(value=v[:, :-1]))]
    if form == "shared_kv":
        calls.append(("key", "x_kv with another batch size", inputs.replace(key=k[:1], value=k[:1])))
    if form != "separate":  # a form the backend did not declare is refused by validation, naming inputs
        calls.append(("inputs", "separate query/key/value arrays", inputs.replace(key=k.copy(), value=v.copy() + 1)))
    return calls


@case(forms=ALL_FORMS)
def check_bad_input_raises_clear_error(backend, *, form, dtype):
    """Each malformed call (wrong width, rank, batch, length, empty sequence, NaN query, bad mask shape or
    dtype, unknown causal alignment, undeclared dtype, an input form the backend did not declare) raises ValueError
    or TypeError whose message names the offending parameter, instead of returning a wrong answer or crashing."""
    params = small_layer(backend)
    inputs = form_inputs(form, params.config, 2, 6)
    loaded = backend.load(params, dtype=dtype)
    problems = []
    for parameter, description, bad in _bad_calls(inputs, params.config.d_model):
        try:
            loaded.forward(bad)
        except (ValueError, TypeError) as exc:
            if parameter not in str(exc):
                problems.append(f"{description}: raised {type(exc).__name__}({exc}) which does not name {parameter!r}")
        except Exception as exc:  # noqa: BLE001 - any other exception is the finding
            problems.append(f"{description}: raised {type(exc).__name__} instead of ValueError/TypeError: {exc}")
        else:
            problems.append(f"{description}: accepted silently (no error)")
    try:
        backend.load(params, dtype="float8")
        problems.append("dtype='float8' at load: accepted silently")
    except (ValueError, TypeError) as exc:
        if "dtype" not in str(exc):
            problems.append(f"dtype='float8' at load: message does not name 'dtype': {exc}")
    if problems:
        raise CaseFailure("bad input not rejected clearly: " + "; ".join(problems))
    return Measurement(observed=f"{len(_bad_calls(inputs, params.config.d_model)) + 1} bad calls rejected")
