"""Running one case variant: case, reference, tolerance and comparison here; plugin calls through a proxy.

One variant -> one :class:`CaseResult`. A failure the backend declared is verified, not trusted: the case is
rerun under the declared behaviour (:func:`mha_harness.conformance.casekit.verifying`) and only passing there
makes it an expected divergence.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterable

from mha_harness.conformance.casekit import (
    FORM_SKIP,
    Case,
    CaseFailure,
    CaseSkipped,
    FormRefusal,
    FormSkipped,
    Measurement,
    all_cases,
    case_plugin_errors,
    comparisons_recorded,
    form_skip_reason,
    variant_id,
    verifying,
)
from mha_harness.conformance.diagnosing import undiagnosed
from mha_harness.conformance.proxy import WorkerLost, as_proxy, fault_message
from mha_harness.conformance.results import CaseResult, Status, repro_command
from mha_harness.contract.api import AttentionBackend, Divergence, Unsupported, supported
from mha_harness.contract.reference import scores_as_declared


def select_cases(names: Iterable[str] | None = None, include_slow: bool = True) -> list[Case]:
    """Cases by name (all when None); an unknown name is a ValueError listing the accepted names, and the case
    plugins that failed to load (the name may be one of theirs)."""
    cases = all_cases()
    if names:
        unknown = [n for n in names if n not in cases]
        if unknown:
            raise ValueError(f"case: got {', '.join(map(repr, unknown))}; accepted: {', '.join(cases)}"
                             + _unloaded_plugins())
        chosen = [cases[n] for n in names]
    else:
        chosen = list(cases.values())
    return [c for c in chosen if include_slow or not c.slow]


def _unloaded_plugins() -> str:
    """"; case plugins that failed to load: ..." naming each with its reason, or "" when every one loaded."""
    errors = case_plugin_errors()
    return ("; case plugins that failed to load (their cases are unknown): "
            + "; ".join(f"{name}: {why}" for name, why in errors.items())) if errors else ""


def plan(backend: AttentionBackend, cases: list[Case]) -> list[tuple[Case, dict]]:
    """Every (case, variant parameters) to run for this backend, in a stable order."""
    out = []
    for case in cases:
        variants = case.variants_for(backend)
        if not variants:
            out.append((case, {"unsupported": True}))
        out += [(case, v) for v in variants]
    return out


def case_parameters(case: Case) -> set[str]:
    """The parameter names a case takes (the keys a divergence's ``when`` may use)."""
    return {name for name, p in inspect.signature(case.func).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "backend"}


def divergence_problems(backend: AttentionBackend) -> list[str]:
    """What is wrong with a backend's declarations: unknown case names, unknown ``when`` keys, a behaviour the
    case cannot show. Empty when every declaration can be checked."""
    cases = all_cases()
    problems = []
    try:
        declared = tuple(backend.divergences)
    except Exception as exc:  # noqa: BLE001 - a plugin's property: its fault, reported
        return [f"divergences could not be read ({type(exc).__name__}: {exc})"]
    for d in declared:
        if not isinstance(d, Divergence):
            problems.append(f"divergences: got {type(d).__name__}; accepted: mha_harness.Divergence")
            continue
        if d.case not in cases:
            problems.append(f"divergence for unknown case {d.case!r}; accepted: {', '.join(cases)}"
                            + _unloaded_plugins() + "; a case plugin's case is known only where that plugin is "
                            "installed: declare the divergence when `name in mha_harness.case_names()`")
            continue
        accepted = case_parameters(cases[d.case])
        unknown = sorted(set(d.when) - accepted)
        if unknown:
            problems.append(f"divergence for {d.case}: unknown 'when' key(s) {', '.join(map(repr, unknown))}; "
                            f"accepted: {', '.join(sorted(accepted))}")
        if d.behaviour == "masked_poison" and "poison" not in accepted:
            problems.append(f"divergence for {d.case}: masked_poison needs a case with a 'poison' parameter")
    return problems


def unsupported_reason(backend, params: dict) -> str:
    """The skip reason of a variant marked ``unsupported``: the variant generator's reason (a string, said after
    the backend's name), or, for ``True`` (a case with no variant the backend can run), that in general words."""
    why = params["unsupported"]
    return f"{backend.name} {why}" if isinstance(why, str) else \
        f"{backend.name} declares no parameters this case can run with"


def _said_of(backend, skip: Exception) -> str:
    """A skip's reason; one that says what the backend declares ("declares inputs='kv_cache': ...") is said after
    its name, as :func:`unsupported_reason`'s are, so one reason reads alike from either place."""
    text = str(skip)
    return f"{backend.name} {text}" if text.startswith("declares ") else text


def _unsupported_skip(backend, params: dict) -> tuple[str, str | None]:
    """(reason, observed) of a variant marked ``unsupported``: a :class:`FormRefusal` is a skip for the form."""
    return unsupported_reason(backend, params), FORM_SKIP if isinstance(params["unsupported"], FormRefusal) else None


def declared_skip(backend, case: Case, params: dict) -> tuple[str, str | None] | None:
    """(reason, observed) when the variant skips on the backend's declarations alone (no plugin call is needed:
    a capability not declared, no runnable parameters, a case not defined for its input form); else None."""
    reason = supported(backend, case.requires)  # a missing capability is named before "no parameters"
    if reason:
        return reason, None
    if params.get("unsupported"):
        return _unsupported_skip(backend, params)
    reason = form_skip_reason(case.name, case.forms, backend, params.get("form") or backend.capabilities.inputs)
    return (reason, FORM_SKIP) if reason else None


def _execute(backend, case: Case, params: dict) -> tuple[Status, str, float | None, str | None, str]:
    """Run the case once: (status, message, max_error, observed, diagnosis: the known mistake a failed output
    matches, else the lower precision its error's size suggests, or ""). Plugin faults become errors, never raise;
    :class:`~mha_harness.conformance.isolation.WorkerLost` (a lost worker) propagates."""
    try:
        reason = supported(backend, case.requires)
        if reason:
            raise CaseSkipped(reason)
        if params.get("unsupported"):
            reason, observed = _unsupported_skip(backend, params)
            return Status.SKIPPED, reason, None, observed, ""
        measurement = case.func(backend, **{k: v for k, v in params.items() if k != "unsupported"})
        if isinstance(measurement, Measurement):
            return Status.PASSED, "", measurement.max_error, measurement.observed, ""
        return Status.PASSED, "", None, None, ""
    except FormSkipped as skip:
        return Status.SKIPPED, _said_of(backend, skip), None, FORM_SKIP, ""
    except (CaseSkipped, Unsupported) as skip:
        return Status.SKIPPED, _said_of(backend, skip), None, None, ""
    except CaseFailure as failure:
        # a guess of a lower precision from the error's size is the summary's diagnosis where no mistake is named
        return Status.FAILED, str(failure), failure.max_error, failure.observed, failure.diagnosis or failure.precision
    except Exception as exc:  # noqa: BLE001 - the backend's fault (a PluginError from a worker), reported not raised
        return Status.ERROR, fault_message(exc), None, None, ""


def _record_closest(result: CaseResult, comparisons: list, prefix: str = "") -> None:
    """Record the comparison closest to its bound, (error, bound), in ``result.extra`` as ``{prefix}bound`` and
    ``{prefix}error_to_bound``; nothing when the variant compared nothing."""
    if comparisons:
        error, bound = max(comparisons, key=lambda c: c[0] / c[1])
        result.extra[f"{prefix}bound"] = bound
        result.extra[f"{prefix}error_to_bound"] = round(error / bound, 4)


def _verify(backend, case: Case, params: dict, declared: list[Divergence], result: CaseResult) -> None:
    """The strict run failed and ``declared`` match the variant: rerun under all their behaviours at once; only a
    pass there is expected."""
    behaviours = tuple(dict.fromkeys(d.behaviour for d in declared))
    observed = "; ".join(dict.fromkeys(d.observed for d in declared))
    reasons = "; ".join(dict.fromkeys(d.reason for d in declared))
    with verifying(*behaviours), comparisons_recorded() as under:  # the bounds the declaration gives, apart
        status, message, max_error, seen, diagnosis = _execute(backend, case, params)
    _record_closest(result, under, "declared_")  # a pass's says how near it came to the declared bound
    if status == Status.PASSED and "masked_poison" in behaviours and params.get("poison") not in (None, "random"):
        finite = {**params, "poison": "random"}
        with verifying(*(b for b in behaviours if b != "masked_poison")):
            status, message, max_error, _, diagnosis = _execute(backend, case, finite)
        if status == Status.FAILED:
            message = f"the finite-value variant ({variant_id(backend.name, finite)}) fails too: {message}"
    if status == Status.PASSED:
        result.status = Status.EXPECTED_DIVERGENCE
        within = ""
        if "declared_bound" in result.extra:  # how near the verifying run came to the bound the declaration gives
            within = (f" within the declared bound {result.extra['declared_bound']:.3g} (error "
                      f"{result.extra['declared_error_to_bound']:.2f} of it)")
        result.message = (f"declared divergence, verified{within}: {observed} ({reasons}); "
                          f"the strict case said: {result.message}")
        result.observed = result.observed or seen or observed  # the verifying run may say how it held
    elif status == Status.FAILED:
        result.message = f"{FAILS_UNDER_DECLARATION} ({observed}): {message}"
        result.max_error = max_error
        _diagnosed(result, diagnosis)
    else:
        result.status, result.message = status, f"while verifying the declared {observed}: {message}"


def run_case(backend, case: Case, params: dict, *, spec: str | None = None,
             timeout: float | None = None) -> CaseResult:
    """Run one variant; never raises for the backend's faults (they become failed/error/timeout/crashed)."""
    proxy = as_proxy(backend)
    vid = variant_id(proxy.name, {k: v for k, v in params.items() if k != "unsupported"})
    result = CaseResult(proxy.name, case.name, vid, dict(params), Status.PASSED,
                        repro=repro_command(proxy.name, case.name, params, spec))
    start = time.perf_counter()
    proxy.transport.begin_case(timeout)
    try:
        with scores_as_declared(proxy.capabilities), comparisons_recorded() as compared:
            _run_and_verify(proxy, case, params, result)  # the references: as this backend declares its scores
        _record_closest(result, compared)  # a failure's: its worst comparison
    except WorkerLost as lost:
        result.status, result.message = lost.status, str(lost)
    finally:
        proxy.transport.end_case()
    result.seconds = round(time.perf_counter() - start, 4)
    return result


def _run_and_verify(proxy, case: Case, params: dict, result: CaseResult) -> None:
    """Run the variant strictly into ``result``; a failure a declaration matches is rerun under it. The strict run
    of a variant a declaration matches names no mistake (:func:`~mha_harness.conformance.diagnosing.undiagnosed`):
    the verifying run decides its verdict and names the mistake where it fails too."""
    declared = [d for d in proxy.divergences if d.matches(case.name, params)]
    with undiagnosed() if declared else contextlib.nullcontext():
        result.status, result.message, result.max_error, result.observed, diagnosis = _execute(proxy, case, params)
    _diagnosed(result, diagnosis)
    if declared and result.status == Status.FAILED:
        _verify(proxy, case, params, declared, result)
        if result.status != Status.FAILED:  # a verified divergence (or an error while verifying) is no mistake
            result.extra.pop("diagnosis", None)
    elif declared and result.status == Status.PASSED:
        # a declaration of the variant's own behaviour that did not happen is an unexpected pass; precision ones are
        # settled over the whole run (settle_precision_declarations)
        d = next((d for d in declared if not d.behaviour.startswith("precision:")), declared[0])
        if d.behaviour.startswith("precision:"):
            result.observed = PRECISION_NOT_NEEDED
            result.message = (f"passed at the strict tolerance: the declared divergence, {d.observed} ({d.reason}), "
                              "was not needed by this variant")
        else:
            result.status, result.message = Status.UNEXPECTED_PASS, _did_not_happen(proxy.name, d)


def _diagnosed(result: CaseResult, diagnosis: str) -> None:
    """Keep the known mistake a failed output matches in ``result.extra["diagnosis"]`` (the summary names it),
    or drop an earlier one when this run of the variant had none."""
    if diagnosis:
        result.extra["diagnosis"] = diagnosis
    else:
        result.extra.pop("diagnosis", None)


#: ``observed`` of a variant that passed strictly although a ``precision:`` declaration matches it
PRECISION_NOT_NEEDED = "declared precision not needed"


def _did_not_happen(backend: str, d: Divergence) -> str:
    """The message of an unexpected pass. A bug elsewhere in the layer can change the declared behaviour too (a mask
    applied after the softmax outputs zeros for fully masked rows), so it says to fix other failures first."""
    return (f"declared divergence did not happen: {backend} was declared to give '{d.observed}' ({d.reason}) "
            "but passed; remove or narrow the declaration, unless other cases of this backend fail: a bug they point "
            "to can change this behaviour too (fix those first, then check again)")


def settle_precision_declarations(backend, results: list[CaseResult], progress=None) -> None:
    """A ``precision:`` declaration must be needed by at least one variant it matches in the run; the others may
    pass at the strict tolerance, since a result at a lower precision can be exact (one key: the softmax weight is
    exactly 1). A declaration that no variant needed is stale: its strict passes become unexpected passes, handed to
    ``progress`` (each was reported to it as passed when it ran)."""
    declarations = as_proxy(backend).divergences
    matching = {id(r): [d for d in declarations if d.matches(r.case, r.params)] for r in results}
    # a diverged variant was verified under every declaration it matches at once (runner._verify)
    needed = {id(d) for r in results if r.status in (Status.EXPECTED_DIVERGENCE, Status.FAILED)
              for d in matching[id(r)]}
    for r in results:
        stale = [d for d in matching[id(r)] if d.behaviour.startswith("precision:") and id(d) not in needed]
        if r.observed == PRECISION_NOT_NEEDED and r.status == Status.PASSED and stale:
            r.status, r.message = Status.UNEXPECTED_PASS, _did_not_happen(r.backend, stale[0]) + (
                "; no variant it matches needed it")
            if progress:
                progress(r)


#: how a variant that a declaration matches and that failed under it begins its message (:func:`_verify`)
FAILS_UNDER_DECLARATION = "fails even under its declared divergence"


def under_declaration(message: str) -> str:
    """The start of a message that :func:`_verify` wrote for a variant failing even under its declared divergence,
    ``"fails even under its declared divergence (<observed>): "``, or "" for any other message: a shortened line of
    the failure keeps it, since it is what makes the variant a failure although a declaration covers it."""
    if not message.startswith(FAILS_UNDER_DECLARATION + " ("):
        return ""
    end = message.find("): ", len(FAILS_UNDER_DECLARATION))
    return message[:end + 3] if end >= 0 else ""


def point_to_undeclared_failures(results: list[CaseResult]) -> None:
    """A variant that fails even under its declared divergence, in a case whose variants that no declaration covers
    fail too, says so: a bug there (a backward with the wrong scale) breaks the declared variant as well, and its
    message otherwise points at the declaration (an outside user's muP backward read "fails even under its declared
    divergence (fully masked rows output the uniform average of V)" first)."""
    undeclared: dict[tuple[str, str], list[CaseResult]] = {}
    for r in results:
        if r.status == Status.FAILED and not r.message.startswith(FAILS_UNDER_DECLARATION):
            undeclared.setdefault((r.backend, r.case), []).append(r)
    for r in results:
        others = undeclared.get((r.backend, r.case))
        if r.status == Status.FAILED and r.message.startswith(FAILS_UNDER_DECLARATION) and others:
            r.message = (f"{r.message} (this case fails on {len(others)} variant(s) that no declaration covers too, "
                         f"e.g. {others[0].variant}: the bug there can break this variant as well, so fix those "
                         "first)")


def lost_result(backend: str, case: Case, params: dict, status: Status, message: str,
                spec: str | None = None) -> CaseResult:
    """A variant that got no verdict (not run, or its worker was lost)."""
    return CaseResult(backend, case.name, variant_id(backend, {k: v for k, v in params.items() if k != "unsupported"}),
                      dict(params), status, message, repro=repro_command(backend, case.name, params, spec))


def run_backend(backend: AttentionBackend, cases: list[Case], progress=None,
                spec: str | None = None) -> list[CaseResult]:
    """Every planned variant in this process (``isolate=False``: the plugin can reach the verdict)."""
    proxy = as_proxy(backend)
    results = []
    for case, params in plan(backend, cases):
        results.append(run_case(proxy, case, params, spec=spec))
        if progress:
            progress(results[-1])
    settle_precision_declarations(backend, results, progress)
    point_to_undeclared_failures(results)
    return results
