"""pytest plugin (entry point ``pytest11``): the conformance cases as ordinary pytest tests.

    pytest --pyargs mha_harness.cases --mha-backend mypkg.attn:MyAttention
    pytest --pyargs mha_harness.cases --mha-backend numpy-tiled -k check_scores_scaled

Each case becomes a test named after it, parametrised over backends and variants with readable
ids (``check_scores_scaled_by_sqrt_d_head[torch-sdpa-math-cpu-float32]``). Skips carry the
reason; a declared divergence is an xfail; a failure shows the case's message and a repro.

The plugin acts only when asked. It adds its two options, and otherwise collects, parametrises and imports
nothing unless pytest is collecting mha_harness's own cases module (``mha_harness.cases.test_conformance``,
which carries the marker ``MHA_HARNESS_CASES = True``): a module-level ``Mock()`` or lazy proxy named
``check_...`` in another project is never looked at; the cases and backends are imported only then.

In a test file of your own, the scikit-learn style (like ``parametrize_with_checks``)::

    from mha_harness.pytest_plugin import parametrize_with_cases

    @parametrize_with_cases(MyAttention())
    def test_my_attention(backend, case):
        case(backend)
"""
from __future__ import annotations

import sys
import types

import pytest

CASES_MARKER = "MHA_HARNESS_CASES"


def pytest_addoption(parser):
    group = parser.getgroup("mha-harness")
    group.addoption("--mha-backend", action="append", default=[], metavar="NAME_OR_MODULE:OBJECT",
                    help="attention backend(s) for the mha-harness conformance cases (pytest --pyargs "
                         "mha_harness.cases): a registered name or 'package.module:object' (default: every "
                         "available registered backend)")
    group.addoption("--mha-include-slow", action="store_true", help="also run the slow (T = 8192) cases")
    group.addoption("--mha-search", action="store_true",
                    help="also run the property-based search (hypothesis) on each backend: one test per backend")
    group.addoption("--mha-search-examples", type=int, default=200, help="examples per backend for --mha-search")
    group.addoption("--mha-search-seed", type=int, default=0, help="hypothesis seed for --mha-search (default 0)")


def _is_cases_module(module) -> bool:
    """True only for mha_harness's own cases module: a real module object carrying the marker set to True."""
    return type(module) is types.ModuleType and module.__dict__.get(CASES_MARKER) is True


def _case_name(function) -> str | None:
    """The case a collected function runs: only plain functions the cases module made (no Mock, no proxy)."""
    if type(function) is not types.FunctionType:
        return None
    name = function.__dict__.get("_mha_case")
    return name if isinstance(name, str) else None


def _resolve_targets(specs) -> list:
    from mha_harness.checking import resolve_targets
    from mha_harness.registry import load_registry
    if not specs:
        registry = load_registry()
        opted_out = {e.name for e in registry.opted_out()}  # opt-in backends run only when named
        specs = [e.name for e in registry.available() if e.name not in opted_out]
    try:
        targets, unavailable = resolve_targets(specs)
    except ValueError as exc:  # a malformed spec or an unknown name (RegistryError is one): the message, no traceback
        several = any("," in str(s) for s in specs)
        hint = ("\none backend per option: repeat --mha-backend for several, e.g. --mha-backend "
                "my_pkg.attn:MyAttention --mha-backend jax-dpa" if several else "")
        raise pytest.Collector.CollectError(f"--mha-backend: {exc}{hint}") from None
    failed = [info for info in unavailable if info.load_error]
    if failed:  # a collection error naming the option, the spec and the error; never an empty parameter set
        raise pytest.Collector.CollectError(
            "\n".join(f"--mha-backend {info.name}: {info.reason}" for info in failed)
            + ("\nthe module of a 'module:object' spec must be importable from this pytest process: run pytest from "
               "the folder that holds it as 'python -m pytest ...' (which puts that folder on sys.path), set "
               "PYTHONPATH, or install it" if any(_spec_module_not_found(info) for info in failed) else ""))
    return targets


def _spec_module_not_found(info) -> bool:
    """True when a spec failed because its own module (or a package above it) is not importable from here, not
    because of an import inside the plugin (a dependency it lacks): only then does the sys.path advice apply."""
    module = str(info.name).split(":")[0]
    parts = module.split(".")
    return any(f"No module named '{'.'.join(parts[:i])}'" in str(info.reason) for i in range(1, len(parts) + 1))


def _targets(config):
    cached = getattr(config, "_mha_targets", None)
    if cached is None:
        targets = _resolve_targets(config.getoption("--mha-backend"))
        cached = config._mha_targets = [t.backend for t in targets]
        config._mha_target_of = {t.backend.name: t for t in targets}  # the search rebuilds .spec; repros name it
    return cached


def _is_search(function) -> bool:
    return type(function) is types.FunctionType and function.__dict__.get("_mha_search") is True


def pytest_pycollect_makeitem(collector, name, obj):
    """Collect the ``check_*`` functions of mha_harness's cases module as tests; return None (pytest's own
    collection) everywhere else."""
    if not isinstance(collector, pytest.Module) or not _is_cases_module(collector.obj):
        return None
    if name.startswith("check_") and _case_name(obj) == name:
        return list(collector._genfunctions(name, obj))
    if _is_search(obj):  # the search test exists only when --mha-search asks for it
        return list(collector._genfunctions(name, obj)) if collector.config.getoption("--mha-search") else []
    return None


#: the plugin's options that act only on mha_harness's own cases module
CASE_OPTIONS = ("--mha-backend", "--mha-include-slow", "--mha-search")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """A run given one of :data:`CASE_OPTIONS` that collected none of mha_harness's cases gets a warning saying the
    option did nothing (an outside user's ``pytest --mha-backend mine`` in their own project silently ran only
    their own tests). Before ``-k`` deselects: a run whose cases were all deselected was still asked for them."""
    asked = [option for option in CASE_OPTIONS if config.getoption(option)]
    if not asked or any(_is_cases_module(getattr(item, "module", None)) for item in items):
        return
    import warnings
    if any(_is_decorated_case(item) for item in items):
        # parametrize_with_cases' tests: --mha-include-slow runs their slow cases; the other two cannot act on them
        idle = [option for option in asked if option != "--mha-include-slow"]
        if idle:
            warnings.warn(pytest.PytestConfigWarning(
                f"{', '.join(idle)} given: {'these act' if len(idle) > 1 else 'it acts'} only on 'pytest --pyargs "
                "mha_harness.cases'; parametrize_with_cases' tests take their backends from the decorator's "
                "argument, and the search runs from a test of your own: outcomes = mha_harness.search(YourBackend(), "
                "quick=True, seed=0); assert all(o.passed for o in outcomes), [o.message for o in outcomes]"),
                stacklevel=1)
        return
    warnings.warn(pytest.PytestConfigWarning(
        f"{', '.join(asked)} given, but no mha-harness case was collected: these options act only on "
        "mha_harness's own cases module and (--mha-include-slow) on tests made by parametrize_with_cases; run "
        f"'pytest --pyargs mha_harness.cases {' '.join(asked)} ...' (with your own paths too, if you like), or in a "
        "test file of your own use mha_harness.pytest_plugin.parametrize_with_cases(YourBackend())"), stacklevel=1)


def _is_decorated_case(item) -> bool:
    """Whether a collected test is one that :func:`parametrize_with_cases` made (its ``case`` parameter a case
    variant), without importing the harness for a run that has none."""
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("case") if callspec is not None else None
    return type(case).__module__ == "mha_harness.conformance.as_pytest" and type(case).__name__ == "CaseVariant"


#: the user property a failed case variant's report carries its diagnosis under: (backend, case, diagnosis)
DIAGNOSIS_PROPERTY = "mha_harness_diagnosis"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed case variant's report carries the known mistake its failure matched (a user property, which
    pytest-xdist sends to the controller too), for the summary; nothing for any other test."""
    outcome = yield
    as_pytest = sys.modules.get("mha_harness.conformance.as_pytest")
    if call.when != "call" or as_pytest is None or not as_pytest.LAST_DIAGNOSIS:
        return
    found = as_pytest.LAST_DIAGNOSIS.pop()
    report = outcome.get_result()
    if report.failed:
        report.user_properties.append((DIAGNOSIS_PROPERTY, found))


def pytest_terminal_summary(terminalreporter):
    """After a run with failed case variants: per backend, the known mistakes their failures matched, the most
    often matched first (the line ``mha-harness check`` prints under a FAIL): the first failure pytest shows can be
    a case whose message has numbers only."""
    by_backend: dict[str, list] = {}
    for report in terminalreporter.stats.get("failed", []):
        for key, value in getattr(report, "user_properties", ()):
            if key == DIAGNOSIS_PROPERTY:
                backend, case, diagnosis = value
                by_backend.setdefault(backend, []).append((case, diagnosis))
    if not by_backend:
        return
    from mha_harness.conformance.report import diagnoses_line
    terminalreporter.section("mha-harness diagnoses")
    for backend, failures in by_backend.items():
        lines = diagnoses_line(failures).splitlines()
        for i, line in enumerate(lines):
            terminalreporter.write_line(f"{backend}: {line}" if i == 0 else f"{' ' * len(backend)}  {line}")


def pytest_generate_tests(metafunc):
    if not _is_cases_module(metafunc.module):
        return
    if _is_search(metafunc.function):
        backends = _targets(metafunc.config)
        metafunc.parametrize("mha_backend", backends, ids=[b.name for b in backends])
        return
    case_name = _case_name(metafunc.function)
    if case_name is None:
        return
    from mha_harness.conformance.casekit import all_cases, variant_id
    case = all_cases()[case_name]
    params, ids = [], []
    for backend in _targets(metafunc.config):
        variants = case.variants_for(backend) or [{"unsupported": True}]
        for variant in variants:
            params.append((backend, variant))
            ids.append(variant_id(backend.name, {k: v for k, v in variant.items() if k != "unsupported"}))
    if case.slow and not metafunc.config.getoption("--mha-include-slow"):
        marks = [pytest.mark.skip(reason="slow case: pass --mha-include-slow")]
        params = [pytest.param(*p, marks=marks) for p in params]
    metafunc.parametrize(("mha_backend", "mha_params"), params, ids=ids)


def parametrize_with_cases(backends, *, cases=None, include_slow: bool = False):
    """Decorator for a test of your own: one test per (backend, case, variant), ids like
    ``test_mine[check_scores_scaled_by_sqrt_d_head-my-mha-float32]``. The test receives ``backend`` and ``case``; its
    body is ``case(backend)``, which skips (reported at your test's line), xfails (a declared divergence) or fails
    exactly as ``mha-harness check`` would.

    ``backends``: a backend instance or class, a registered name, a ``module:object`` spec, or a list of these.
    ``cases``: case names (None, the default: every case). The slow T = 8192 cases are collected and skipped with
    the reason unless ``include_slow=True`` or pytest's ``--mha-include-slow``, so the test report shows what was
    left out.
    """
    from mha_harness.conformance.as_pytest import CaseVariant
    from mha_harness.conformance.runner import plan, select_cases
    chosen = select_cases(cases, include_slow=True)
    # decided when the test runs, from the command line too: --mha-include-slow runs it as on the --pyargs route
    slow = [pytest.mark.skipif("not config.getoption('--mha-include-slow', default=False)",
                               reason="slow case (T = 8192): --mha-include-slow or parametrize_with_cases(..., "
                                      "include_slow=True) runs it")]
    params = []
    for target in _resolve_targets(backends if isinstance(backends, (list, tuple)) else [backends]):
        backend = target.backend
        for case, variant in plan(backend, chosen):
            bound = CaseVariant(case.name, variant, target.repro_spec)  # a repro names an unregistered one's spec
            marks = slow if case.slow and not include_slow else ()
            params.append(pytest.param(backend, bound, id=bound.test_id(backend), marks=marks))
    return pytest.mark.parametrize(("backend", "case"), params)
