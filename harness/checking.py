"""``check()``: the Python front end over the one case generator."""
from __future__ import annotations

import time
from collections.abc import Iterable

from mha_harness.conformance.casekit import all_cases
from mha_harness.conformance.isolation import Target, run_isolated
from mha_harness.conformance.report import BackendInfo, Report, backend_info, entry_info
from mha_harness.conformance.runner import run_backend, run_case, select_cases
from mha_harness.contract.api import AttentionBackend
from mha_harness.registry import (
    Registry,
    availability_reason,
    backends_from_object,
    backends_from_spec,
    load_registry,
    parse_spec,
)


def resolve_targets(backends, registry: Registry | None = None) -> tuple[list[Target], list[BackendInfo]]:
    """Turn names, ``module:object`` specs, instances or classes into check targets.

    Returns (targets, descriptions of the backends that are not available here, for the report)."""
    if isinstance(backends, (str, AttentionBackend)) or (isinstance(backends, type)):
        backends = [backends]
    targets, unavailable = [], []

    def add(backend, spec, source):
        reason = availability_reason(backend)
        if reason is None:
            targets.append(Target(backend, spec, source))
        else:
            unavailable.append(backend_info(backend, source, reason))

    for item in backends:
        if isinstance(item, str) and ":" in item:
            parse_spec(item)
            for b in backends_from_spec(item):
                add(b, item, f"spec {item}")
        elif isinstance(item, str):
            registry = registry or load_registry()
            entry = registry.get(item)
            if entry.backend is not None and entry.available:
                targets.append(Target(entry.backend, entry.spec, entry.source))
            else:
                unavailable.append(entry_info(entry))
        else:
            for b in backends_from_object(item):
                add(b, None, "python object")
    return targets, unavailable


def check(backends, *, cases: Iterable[str] | None = None, isolate: bool = False, timeout: float = 120.0,
          jobs: int | None = None, include_slow: bool = True, registry: Registry | None = None,
          progress=None, on_backend_done=None) -> Report:
    """Run the conformance cases on one or more backends and return a :class:`Report`.

    ``backends``: a backend instance or class, a registered name, a ``module:object`` spec, or a list
    of these. ``isolate=True`` runs each backend in its own worker process with a per-case ``timeout``.
    """
    start = time.perf_counter()
    chosen = select_cases(cases, include_slow)
    targets, unavailable = resolve_targets(backends, registry)
    report = Report()
    for t in targets:
        report.backends[t.name] = backend_info(t.backend, t.source, None)
    for info in unavailable:
        report.backends[info.name] = info
    if isolate:
        by_backend = run_isolated(targets, chosen, timeout=timeout, jobs=jobs, progress=progress,
                                  on_backend_done=on_backend_done)
        for t in targets:
            report.results += by_backend.get(t.name, [])
    else:
        for t in targets:
            results = run_backend(t.backend, chosen, progress)
            report.results += results
            if on_backend_done:
                on_backend_done(t.name, results)
    report.seconds = time.perf_counter() - start
    return report


def repro(backend, case: str, **params) -> None:
    """Rerun one case variant in this process and raise its failure (the one-line repro in reports)."""
    from mha_harness.conformance.casekit import CaseFailure
    targets, unavailable = resolve_targets(backend)
    if not targets:
        raise ValueError(f"backend: {backend!r} is not available here")
    result = run_case(targets[0].backend, all_cases()[case], params)
    print(f"{result.status}: {result.message}")
    if result.status not in ("passed", "skipped", "expected-divergence"):
        raise CaseFailure(result.message)
