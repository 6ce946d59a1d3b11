"""One case variant as a pytest test: skipped -> skip with the reason, a declared divergence -> xfail, anything that
fails the run -> a failure showing the case's message and its repro. pytest is imported only when a test runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mha_harness.conformance.casekit import all_cases, variant_id
from mha_harness.conformance.results import EXPECTED_DIVERGENCE, FAILED, PASSED, SKIPPED
from mha_harness.conformance.runner import run_case
from mha_harness.contract.api import AttentionBackend

#: the diagnosis of the failure the current test raised, as (backend, case, diagnosis): read and cleared by the
#: pytest plugin's report hook, which carries it to the run's "mha-harness diagnoses" summary
LAST_DIAGNOSIS: list[tuple[str, str, str]] = []


def run_as_test(case_name: str, backend: AttentionBackend, params: dict, spec: str | None = None) -> None:
    """Run one variant in this process and translate its status into pytest's outcomes. ``spec``: the
    ``module:object`` the backend came from, which its repro line must name (it is not a registered name)."""
    import pytest
    result = run_case(backend, all_cases()[case_name], params, spec=spec)
    diagnosis = result.extra.get("diagnosis") if result.status == FAILED else None
    LAST_DIAGNOSIS[:] = [(result.backend, result.case, diagnosis)] if diagnosis else []
    if result.status == SKIPPED:
        skip = pytest.skip.Exception(result.message)
        skip._use_item_location = True  # pytest reports the skip at the test (the user's), not at this line
        raise skip
    if result.status == EXPECTED_DIVERGENCE:
        pytest.xfail(result.message)
    if result.status != PASSED:
        pytest.fail(f"{result.status}: {result.message}\nrepro: {result.repro}", pytrace=False)


@dataclass(frozen=True)
class CaseVariant:
    """A conformance case bound to one variant's parameters; ``variant(backend)`` runs it as a pytest test."""

    case: str
    params: dict[str, Any] = field(default_factory=dict)
    #: the ``module:object`` the backend came from when it is not a registered name: its repro line names it
    spec: str | None = None

    def __call__(self, backend: AttentionBackend) -> None:
        run_as_test(self.case, backend, self.params, spec=self.spec)

    def test_id(self, backend: AttentionBackend) -> str:
        """``check_<property>-<backend>-<variant>``: the case's name, then the variant id the plugin gives the same
        test (``check_<property>[<backend>-<variant>]``); flat, since pytest puts it inside the test's brackets."""
        shown = {k: v for k, v in self.params.items() if k != "unsupported"}
        return f"{self.case}-{variant_id(backend.name, shown)}"


def run_search_as_test(backend: AttentionBackend, config) -> None:
    """Search ``backend`` in this process (``--mha-search``); fail with the shrunk example and its repro."""
    import pytest

    from mha_harness.conformance.isolation import Target
    from mha_harness.conformance.search import search_backend
    from mha_harness.conformance.search_examples import search_dir
    target = getattr(config, "_mha_target_of", {}).get(backend.name)
    outcome = search_backend(Target(backend, target.spec if target else None),
                             max_examples=config.getoption("--mha-search-examples"),
                             seed=config.getoption("--mha-search-seed"), results=search_dir().parent, isolate=False)
    if not outcome.passed:
        pytest.fail("\n".join(outcome.lines()), pytrace=False)
