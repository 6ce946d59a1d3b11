"""The mutation score: how many deliberately broken backends the conformance cases catch."""
from __future__ import annotations

from collections.abc import Iterable

from mha_harness.conformance.report import Report
from mha_harness.conformance.runner import run_backend, select_cases
from mha_harness.contract.api import AttentionBackend


def mutation_score(mutants: Iterable[AttentionBackend], cases=None, *, include_slow: bool = False) -> dict:
    """Run the cases on each of ``mutants`` (deliberately broken backends, each carrying a ``mutant`` record with its
    ``bug`` and the words ``message_mentions`` a catching message must contain; the CLI passes
    ``mha_harness.implementations.mutants.mutant_backends()``). A mutant is caught when at least one case fails with a
    message naming its broken property."""
    chosen = select_cases(cases, include_slow)
    rows = []
    for backend in mutants:
        report = Report(results=run_backend(backend, chosen))
        mention = backend.mutant.message_mentions.lower()
        caught_by = sorted({r.case for r in report.failures() if mention in r.message.lower()})
        rows.append({"name": backend.name, "bug": backend.mutant.bug, "caught_by": caught_by,
                     "failures": len(report.failures())})
    return {"caught": sum(bool(r["caught_by"]) for r in rows), "total": len(rows), "mutants": rows}
