"""pytest plugin (entry point ``pytest11``): the conformance cases as ordinary pytest tests.

    pytest --pyargs mha_harness.cases --mha-backend mypkg.attn:MyAttention
    pytest --pyargs mha_harness.cases --mha-backend numpy-tiled -k check_scores_scaled

Each case becomes a test named after it, parametrised over backends and variants with readable
ids (``check_scores_scaled_by_sqrt_d_head[torch-sdpa-math-cpu-float32]``). Skips carry the
reason; a declared divergence is an xfail; a failure shows the case's message and a repro.
The plugin only adds the ``--mha-backend`` option and acts on the functions of
``cases/test_conformance.py``; it does nothing in other projects' runs.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("mha-harness")
    group.addoption("--mha-backend", action="append", default=[], metavar="NAME_OR_MODULE:OBJECT",
                    help="attention backend(s) for the mha-harness conformance cases: a registered name or "
                         "'package.module:object' (default: every available registered backend)")
    group.addoption("--mha-include-slow", action="store_true", help="also run the slow (T = 8192) cases")
    group.addoption("--mha-search", action="store_true",
                    help="also run the property-based search (hypothesis) on each backend: one test per backend")
    group.addoption("--mha-search-examples", type=int, default=200, help="examples per backend for --mha-search")
    group.addoption("--mha-search-seed", type=int, default=0, help="hypothesis seed for --mha-search (default 0)")


def _targets(config):
    cached = getattr(config, "_mha_targets", None)
    if cached is None:
        from mha_harness.checking import resolve_targets
        from mha_harness.registry import load_registry
        specs = config.getoption("--mha-backend")
        if specs:
            targets, _ = resolve_targets(specs)
        else:
            targets, _ = resolve_targets([e.name for e in load_registry().available()])
        cached = config._mha_targets = [t.backend for t in targets]
        config._mha_specs = {t.backend.name: t.spec for t in targets}
    return cached


def pytest_pycollect_makeitem(collector, name, obj):
    """Collect the ``check_*`` functions that cases/test_conformance.py exposes, as tests."""
    if getattr(obj, "_mha_case", None) and name.startswith("check_"):
        return list(collector._genfunctions(name, obj))
    if getattr(obj, "_mha_search", False):  # the search test exists only when --mha-search asks for it
        return list(collector._genfunctions(name, obj)) if collector.config.getoption("--mha-search") else []
    return None


def pytest_generate_tests(metafunc):
    if getattr(metafunc.function, "_mha_search", False):
        backends = _targets(metafunc.config)
        metafunc.parametrize("mha_backend", backends, ids=[b.name for b in backends])
        return
    case_name = getattr(metafunc.function, "_mha_case", None)
    if not case_name:
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


def run_as_test(case_name: str, backend, params: dict) -> None:
    """Run one variant and translate its status into pytest's outcomes."""
    from mha_harness.conformance.casekit import all_cases
    from mha_harness.conformance.runner import run_case
    result = run_case(backend, all_cases()[case_name], params)
    if result.status == "skipped":
        pytest.skip(result.message)
    if result.status == "expected-divergence":
        pytest.xfail(result.message)
    if result.status != "passed":
        pytest.fail(f"{result.status}: {result.message}\nrepro: {result.repro}", pytrace=False)


def run_search_as_test(backend, config) -> None:
    """Search ``backend`` in this process (``--mha-search``); fail with the shrunk example and its repro."""
    from mha_harness.conformance.isolation import Target
    from mha_harness.conformance.search import search_backend
    from mha_harness.conformance.search_examples import search_dir
    spec = getattr(config, "_mha_specs", {}).get(backend.name)
    outcome = search_backend(Target(backend, spec), max_examples=config.getoption("--mha-search-examples"),
                             seed=config.getoption("--mha-search-seed"), results=search_dir().parent, isolate=False)
    if not outcome.passed:
        pytest.fail("\n".join(outcome.lines()), pytrace=False)
