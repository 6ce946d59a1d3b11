"""Running cases against a backend in this process: one variant -> one CaseResult."""
from __future__ import annotations

import time
import traceback
from collections.abc import Iterable

from mha_harness.conformance.casekit import Case, CaseFailure, CaseSkipped, Measurement, all_cases, variant_id
from mha_harness.conformance.results import (
    ERROR,
    EXPECTED_DIVERGENCE,
    FAILED,
    PASSED,
    SKIPPED,
    UNEXPECTED_PASS,
    CaseResult,
    repro_command,
)
from mha_harness.contract.api import AttentionBackend, Unsupported, supported


def select_cases(names: Iterable[str] | None = None, include_slow: bool = True) -> list[Case]:
    """Cases by name (all when None); an unknown name is a ValueError listing the accepted names."""
    cases = all_cases()
    if names:
        unknown = [n for n in names if n not in cases]
        if unknown:
            raise ValueError(f"case: got {', '.join(map(repr, unknown))}; accepted: {', '.join(cases)}")
        chosen = [cases[n] for n in names]
    else:
        chosen = list(cases.values())
    return [c for c in chosen if include_slow or not c.slow]


def plan(backend: AttentionBackend, cases: list[Case]) -> list[tuple[Case, dict]]:
    """Every (case, variant parameters) to run for this backend, in a stable order."""
    out = []
    for case in cases:
        variants = case.variants_for(backend)
        if not variants:
            out.append((case, {"unsupported": True}))
        out += [(case, v) for v in variants]
    return out


def _apply_divergence(backend: AttentionBackend, result: CaseResult) -> CaseResult:
    declared = [d for d in backend.divergences if d.matches(result.case, result.params)]
    if not declared:
        return result
    d = declared[0]
    if result.status == FAILED:
        result.status = EXPECTED_DIVERGENCE
        result.message = f"declared divergence: {d.observed} ({d.reason}); case said: {result.message}"
        result.observed = result.observed or d.observed
    elif result.status == PASSED:
        result.status = UNEXPECTED_PASS
        result.message = (f"declared divergence did not happen: {backend.name} was declared to give "
                          f"'{d.observed}' ({d.reason}) but passed; remove or narrow the declaration")
    return result


def run_case(backend: AttentionBackend, case: Case, params: dict) -> CaseResult:
    """Run one variant; never raises for the backend's faults (they become failed/error results)."""
    vid = variant_id(backend.name, {k: v for k, v in params.items() if k != "unsupported"})
    result = CaseResult(backend.name, case.name, vid, dict(params), PASSED,
                        repro=repro_command(backend.name, case.name, params))
    start = time.perf_counter()
    try:
        if params.get("unsupported"):
            raise CaseSkipped(f"{backend.name} declares no parameters this case can run with")
        reason = supported(backend, case.requires)
        if reason:
            raise CaseSkipped(reason)
        measurement = case.func(backend, **params)
        if isinstance(measurement, Measurement):
            result.max_error, result.observed = measurement.max_error, measurement.observed
    except (CaseSkipped, Unsupported) as skip:
        result.status, result.message = SKIPPED, str(skip)
    except CaseFailure as failure:
        result.status, result.message = FAILED, str(failure)
        result.max_error, result.observed = failure.max_error, failure.observed
    except Exception as exc:  # noqa: BLE001 - the backend's fault, reported not raised
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        result.status, result.message = ERROR, f"{type(exc).__name__}: {exc}{where}"
    result.seconds = round(time.perf_counter() - start, 4)
    return _apply_divergence(backend, result)


def run_backend(backend: AttentionBackend, cases: list[Case], progress=None) -> list[CaseResult]:
    results = []
    for case, params in plan(backend, cases):
        results.append(run_case(backend, case, params))
        if progress:
            progress(results[-1])
    return results
