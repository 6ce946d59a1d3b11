"""``check()``: the Python front end over the one case generator."""
from __future__ import annotations

import importlib
import inspect
import sys
import time
from collections.abc import Iterable

from mha_harness.conformance.casekit import Case, all_cases, case_plugin_errors
from mha_harness.conformance.isolation import Target, run_isolated
from mha_harness.conformance.report import BackendInfo, Report, backend_info, entry_info
from mha_harness.conformance.runner import run_backend, run_case, select_cases
from mha_harness.contract.api import AttentionBackend
from mha_harness.registry import (
    BackendEntry,
    Registry,
    availability_of,
    backends_from_object,
    backends_from_spec,
    entries_for_spec,
    load_registry,
    parse_spec,
)
from mha_harness.util import integrity
from mha_harness.util.guard import PluginFault, call_guarded, plugin_timeout
from mha_harness.util.main_guard import refuse_unguarded_main
from mha_harness.util.options import did_you_mean

_ACCEPTED_BACKENDS = ("a registered backend name, a 'module:object' spec, an AttentionBackend instance or "
                      "subclass, a factory returning backends, or a list of these")


def _backend_items(backends) -> list:
    """``backends`` as a list of single items; anything else is a TypeError naming the parameter."""
    if isinstance(backends, (str, AttentionBackend, type)) or callable(backends):
        return [backends]
    if isinstance(backends, (list, tuple, set, frozenset)) or hasattr(backends, "__next__"):
        return list(backends)
    raise TypeError(f"backends: got {type(backends).__name__} {backends!r:.60}; accepted: {_ACCEPTED_BACKENDS}")


#: why a slow case is not in a run with ``include_slow=False`` (``--quick``)
QUICK_LEAVES_OUT = "slow, T = 8192: left out by --quick (include_slow=False)"
#: seconds per case before an isolated worker is killed, when check() is given no timeout
DEFAULT_CASE_TIMEOUT_S = 120.0


def importable_name(obj) -> str | None:
    """``module:qualname`` of a class or function, or of an instance's class, that another process can import (its
    module is not ``__main__`` and it is not defined inside a function); None otherwise. An instance's repro line
    names its class, which rebuilds the same backend when the class needs no arguments."""
    named = obj if isinstance(obj, type) or inspect.isfunction(obj) else type(obj)
    module = sys.modules.get(getattr(named, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return None
    qualname = getattr(named, "__qualname__", "")
    found = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not named:  # made by type() or a factory under another name: the name the module holds it by
        qualname = next((k for k, v in vars(module).items() if v is named), "")
    spec = f"{module.__name__}:{qualname}"
    try:
        parse_spec(spec)
    except ValueError:
        return None
    return spec


def target_of(entry: BackendEntry, importable_as: str | None = None) -> Target:
    """The target for a registry entry: a worker process rebuilds it from its ``module:object`` spec (a class made
    with ``type()`` under another name, or one holding a module, need not pickle), an object given as such is
    pickled."""
    return Target(entry.backend, entry.spec if entry.spec != "python object" else None, entry.source,
                  backends_from_spec, importable_as)


def resolve_targets(backends, registry: Registry | None = None) -> tuple[list[Target], list[BackendInfo]]:
    """Turn names, ``module:object`` specs, instances or classes into check targets.

    Returns (targets, descriptions of the backends that are not available here, for the report). A spec or
    object whose plugin code fails (any exception, or a hang) is described as a load error, never raised."""
    targets, unavailable = [], []

    def add_entry(entry, importable_as=None):
        if entry.backend is not None and entry.available:
            targets.append(target_of(entry, importable_as))
        else:
            unavailable.append(entry_info(entry))

    for item in _backend_items(backends):
        if isinstance(item, str) and ":" in item:
            parse_spec(item)
            for entry in entries_for_spec(item, f"spec {item}"):
                add_entry(entry)
        elif isinstance(item, str):
            registry = registry or load_registry()
            add_entry(registry.get(item))
        elif isinstance(item, AttentionBackend) or callable(item):
            try:
                found = call_guarded(lambda i=item: backends_from_object(i), "constructing the backend",
                                     plugin_timeout())
            except PluginFault as fault:
                name = getattr(item, "name", None) or getattr(item, "__name__", None) or repr(item)
                unavailable.append(BackendInfo(str(name), source="python object", available=False,
                                               reason=f"failed to load: {fault}", load_error=True))
                continue
            for b in found:
                reason, error = availability_of(b)
                add_entry(BackendEntry(b.name, "python object", "python object", b, error=error, reason=reason),
                          importable_name(item))
        else:
            raise TypeError(f"backends: got an item of type {type(item).__name__} ({item!r:.60}); "
                            f"accepted: {_ACCEPTED_BACKENDS}")
    return targets, unavailable


def _check_arguments(cases, timeout, jobs, isolate) -> list[str] | None:
    """Validate check()'s options; each mistake is an error naming the parameter and the accepted values."""
    import math
    if isinstance(cases, str):
        cases = [cases]
    if cases is not None:
        if not isinstance(cases, (list, tuple, set, frozenset)) or not all(isinstance(c, str) for c in cases):
            raise TypeError(f"cases: got {cases!r:.80}; accepted: None (every case), a case name or a list of names")
        cases = list(cases)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout: got {timeout!r}; accepted: None (DEFAULT_CASE_TIMEOUT_S with isolate=True) or a "
                         "finite number of seconds > 0")
    if not isinstance(isolate, bool):
        raise TypeError(f"isolate: got {isolate!r}; accepted: True or False")
    if timeout is not None and not isolate:
        raise ValueError(f"timeout: got {timeout!r} with isolate=False; accepted: None, or isolate=True (a per-case "
                         "timeout needs a worker process that can be killed; in this process nothing can stop a "
                         "plugin that hangs)")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs: got {jobs!r}; accepted: None (one per CPU) or an integer >= 1")
    return cases


def case_names() -> list[str]:
    """The name of every registered case: the built-in ones and those of the installed case plugins that loaded
    (entry-point group ``mha_harness.cases``). A backend's divergence for a case plugin's case names a case that
    exists only where that plugin is installed: declare it when its name is here."""
    return list(all_cases())


def _declaration_errors(targets: list[Target]) -> tuple[list[Target], list[BackendInfo]]:
    """Refuse, at load, backends whose divergence declarations name unknown cases or ``when`` keys."""
    from mha_harness.conformance.runner import divergence_problems
    kept, refused = [], []
    for t in targets:
        problems = divergence_problems(t.backend)
        if problems:
            info = backend_info(t.backend, t.source, "declared divergences refused: " + "; ".join(problems))
            info.load_error = True
            refused.append(info)
        else:
            kept.append(t)
    return kept, refused


def check(backends, *, cases: Iterable[str] | None = None, isolate: bool = False, timeout: float | None = None,
          jobs: int | None = None, include_slow: bool = True, registry: Registry | None = None,
          progress=None, on_backend_done=None) -> Report:
    """Run the conformance cases on one or more backends and return a :class:`Report`.

    ``backends``: a backend instance or class, a registered name, a ``module:object`` spec, or a list
    of these. ``isolate=True`` runs each backend's plugin code in its own worker process with a per-case
    ``timeout`` (default DEFAULT_CASE_TIMEOUT_S, 120 s), out of reach of the verdict, and a plugin that crashes, hangs
    or exits is reported as that backend's while the others go on (a script that calls it needs an ``if __name__ ==
    "__main__":`` guard: each worker imports the script again); ``isolate=False`` (the default: a backend defined in
    a notebook runs as it is) runs it in this process, where a plugin that patches NumPy or the harness can change
    the verdict, one that hangs hangs the call (``timeout`` is refused: nothing could enforce it) and one that
    crashes the interpreter ends it (use it only for code you trust; a plugin's SystemExit is that case's error).
    ``progress(result)`` is called as each variant finishes, and again for a variant whose status changes once its
    backend's run is complete (a pass under a precision declaration that no variant needed becomes an unexpected
    pass); ``on_backend_done(name, results)`` as each backend finishes.
    """
    start = time.perf_counter()
    cases = _check_arguments(cases, timeout, jobs, isolate)
    if isolate:  # before any worker starts: a script without its main guard would run again in each of them
        refuse_unguarded_main("mha_harness.check(isolate=True)")
    chosen = select_cases(cases, include_slow)
    targets, unavailable = resolve_targets(backends, registry)
    targets, refused = _declaration_errors(targets)
    report = Report(left_out={c.name: QUICK_LEAVES_OUT for c in select_cases(cases) if c not in chosen})
    for t in targets:
        report.backends[t.name] = backend_info(t.backend, t.source, None)
    for info in unavailable + refused:
        report.backends[info.name] = info
    if isolate:
        by_backend = run_isolated(targets, chosen, timeout=timeout or DEFAULT_CASE_TIMEOUT_S, jobs=jobs,
                                  progress=progress,
                                  on_backend_done=on_backend_done)
        for t in targets:
            report.results += by_backend.get(t.name, [])
    else:
        for t in targets:
            results = run_backend(t.backend, chosen, progress, spec=t.repro_spec)
            report.results += results
            if on_backend_done:
                on_backend_done(t.name, results)
    report.tampered = integrity.changes()
    report.case_plugin_errors = case_plugin_errors()
    report.seconds = time.perf_counter() - start
    return report


def _case_named(case) -> Case:
    """The case called ``case``; a misspelt name is a ValueError naming the parameter and the closest names."""
    cases = all_cases()
    if not isinstance(case, str):
        raise TypeError(f"case: got {type(case).__name__} {case!r:.60}; accepted: a case name such as "
                        f"{next(iter(cases))!r}")
    if case not in cases:
        raise ValueError(f"case: got {case!r}; {did_you_mean(case, cases)}accepted: one of {', '.join(cases)}")
    return cases[case]


def search(backends, *, max_examples: int | None = None, seed: int | None = None, time_budget: float | None = None,
           quick: bool = False, results=None, isolate: bool = False, timeout: float | None = None,
           dtypes: Iterable[str] | None = None, gradients: bool = True, progress=None) -> list:
    """The property-based search of ``mha-harness search`` ([search.md](docs/search.md)) from Python: for each of
    ``backends`` (as :func:`check` takes them) draw layers and calls from what it declares, check each against the
    float64 reference and shrink the first failure to a minimal example. Returns one
    :class:`~mha_harness.conformance.search.SearchOutcome` per backend: ``passed``, ``examples``, ``seconds``,
    ``example`` (the shrunk failing example, a dict; None when it passed), ``message``, ``repro`` and ``saved``
    (``<results>/search/<backend>/<id>.json``, which :func:`check` then replays; nothing is saved when ``results``
    is None, the default). ``max_examples`` (200, 50 with ``quick``) and ``time_budget`` (seconds) bound the
    generation; ``seed`` makes it repeatable; ``dtypes`` and ``gradients=False`` narrow what is drawn. ``isolate``
    and ``timeout`` as in :func:`check` (60 s per example when isolated). ``progress(line)`` gets the lines the
    command prints."""
    from pathlib import Path

    from mha_harness.conformance.search import DEFAULT_MAX_EXAMPLES, QUICK_MAX_EXAMPLES, run_search
    from mha_harness.conformance.strategies import SearchSpace
    _check_arguments(None, timeout, None, isolate)
    if max_examples is not None and (isinstance(max_examples, bool) or not isinstance(max_examples, int)
                                     or max_examples < 1):
        raise ValueError(f"max_examples: got {max_examples!r}; accepted: None or an integer >= 1")
    if isolate:
        refuse_unguarded_main("mha_harness.search(isolate=True)")
    targets, unavailable = resolve_targets(backends)
    if unavailable:
        raise ValueError("backends: " + "; ".join(f"{info.name} is not available here: {info.reason}"
                                                  for info in unavailable))
    chosen = tuple(dtypes) if dtypes is not None else None
    for target in targets:  # a dtype no backend declares is refused before anything runs
        try:
            SearchSpace.for_backend(target.backend, dtypes=chosen)
        except ValueError as exc:
            raise ValueError(str(exc).replace("--dtype:", "dtypes:", 1)) from None
    return run_search(targets, progress=progress or (lambda line: None),
                      max_examples=max_examples or (QUICK_MAX_EXAMPLES if quick else DEFAULT_MAX_EXAMPLES),
                      seed=seed, time_budget=time_budget, quick=quick,
                      results=Path(results) if results is not None else Path("results"), save=results is not None,
                      isolate=isolate, timeout=timeout or 60.0, dtypes=chosen, gradients=gradients)


def repro(backend, case: str, *, backend_name: str | None = None, **params) -> None:
    """Rerun one case variant in this process and raise its failure (the one-line repro in reports).

    ``backend``: a registered name or a ``module:object`` spec; ``backend_name`` picks one backend when the spec
    yields several. Prints ``status: message``; raises :class:`CaseFailure` unless the variant holds. Run as the
    one-line command (``python -c '...'``), a failure exits with status 1 after that line, without a traceback."""
    from mha_harness.conformance.casekit import CaseFailure
    from mha_harness.conformance.results import HOLDS
    chosen = _case_named(case)
    targets, unavailable = resolve_targets(backend)
    if backend_name is not None:
        targets = [t for t in targets if t.name == backend_name]
    if not targets:
        why = "; ".join(f"{i.name}: {i.reason}" for i in unavailable)
        raise ValueError(f"backend: got {backend!r}{f' (name {backend_name!r})' if backend_name else ''}, "
                         f"which is not available here ({why})")
    targets, refused = _declaration_errors(targets[:1])
    if refused:
        raise CaseFailure(refused[0].reason)
    result = run_case(targets[0].backend, chosen, params, spec=targets[0].repro_spec)
    print(f"{result.status}: {result.message}" if result.message else f"{result.status}")
    if result.status not in HOLDS:
        if _called_from_the_repro_line():  # its message is the whole story
            sys.stdout.flush()
            raise SystemExit(1)
        raise CaseFailure(result.message)


def _called_from_the_repro_line() -> bool:
    """True when :func:`repro` or :func:`replay` was called by the top level of ``python -c '...'`` itself (the
    one-line repro), not by other code running in a ``-c`` process (pytest-xdist's workers are ``python -c`` too)."""
    caller = sys._getframe(2)  # repro's or replay's caller
    return (sys.argv[:1] == ["-c"] and not sys.flags.interactive and caller.f_back is None
            and caller.f_code.co_filename == "<string>")


def replay(backend, example, *, name: str | None = None) -> float:
    """Rebuild a search ``example`` (the dict a search saved), run ``backend`` on it in this process and raise its
    failure; print what happened (the one-line repro that ``mha-harness search`` prints).

    ``backend``: a registered name, a ``module:object`` spec or an :class:`AttentionBackend`; ``name`` picks one
    backend when the spec yields several. Returns the output's error against the float64 reference. Prints
    ``passed: ...`` or ``failed: <message>``; run as the one-line command (``python -c '...'``), a failure exits
    with status 1 after that line, without a traceback (as :func:`repro`)."""
    import json

    from mha_harness.conformance.casekit import CaseFailure
    from mha_harness.conformance.search_examples import check_example
    targets, unavailable = resolve_targets(backend)
    found = [t.name for t in targets]
    if name is not None:
        targets = [t for t in targets if t.name == name]
    if not targets:
        if name is not None and found:
            raise ValueError(f"name: got {name!r}; accepted: {', '.join(found)}")
        why = "; ".join(f"{i.name}: {i.reason}" for i in unavailable)
        raise ValueError(f"backend: got {backend!r}{f' (name {name!r})' if name else ''}, "
                         f"which is not available here ({why})")
    chosen = targets[0].backend
    shapes = {k: example[k] for k in ("batch", "tq", "tk", "heads", "kv_heads", "d_head")}
    print(f"{chosen.name}: {json.dumps(shapes)} dtype {example['dtype']}")
    try:
        err = check_example(chosen, example)
    except CaseFailure as failure:
        print(f"failed: {failure}")
        if _called_from_the_repro_line():  # its message is the whole story
            sys.stdout.flush()
            raise SystemExit(1) from None
        raise
    print(f"passed: max output error {err:.3g}")
    return err


# The tripwire's snapshot (mha_harness.util.integrity): the core is loaded now and no plugin has been imported yet
# (the registry imports this module before it imports any plugin; so does the first use of mha_harness.check...).
# The rest of the public API is loaded first, so that the snapshot covers it.
for _module in ("contract.conventions", "contract.params", "contract.reference", "toolkit.function_backend",
                "toolkit.jax_setup", "toolkit.masks"):
    importlib.import_module(f"mha_harness.{_module}")
integrity.take_snapshot()
