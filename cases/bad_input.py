"""Bad input reaches the caller as a clear ValueError/TypeError naming the parameter."""
from __future__ import annotations

from mha_harness.cases._fixtures import ALL_FORMS, form_inputs, small_layer
from mha_harness.conformance.casekit import CaseFailure, Measurement, bad_call_problem, bad_calls, case


@case(forms=ALL_FORMS)
def check_bad_input_raises_clear_error(backend, *, form, dtype):
    """Each malformed call (wrong width, rank, batch, length, empty sequence, NaN query, bad mask shape or
    dtype, unknown causal alignment, undeclared dtype, an input form the backend did not declare) raises ValueError
    or TypeError whose message names the offending parameter, instead of returning a wrong answer or crashing."""
    params = small_layer(backend)
    inputs = form_inputs(form, params.config, 2, 6)
    loaded = backend.load(params, dtype=dtype)
    calls = bad_calls(inputs)
    problems = [p for p in (bad_call_problem(loaded, *call) for call in calls) if p]
    try:
        backend.load(params, dtype="float8")
        problems.append("dtype='float8' at load: accepted silently")
    except (ValueError, TypeError) as exc:
        if "dtype" not in str(exc):
            problems.append(f"dtype='float8' at load: message does not name 'dtype': {exc}")
    if problems:
        raise CaseFailure("bad input not rejected clearly: " + "; ".join(problems))
    return Measurement(observed=f"{len(calls) + 1} bad calls rejected")
