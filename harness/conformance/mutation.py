"""The mutation score: how many deliberately broken backends the conformance cases catch."""
from __future__ import annotations

from collections.abc import Iterable

from mha_harness.conformance.report import Report
from mha_harness.conformance.runner import run_backend, select_cases
from mha_harness.contract.api import AttentionBackend


def mutation_score(mutants: Iterable[AttentionBackend], cases=None, *, include_slow: bool = False,
                   progress=None) -> dict:
    """Run the cases (``cases``: those names only, e.g. a case author's own; all when None) on each of ``mutants``
    (deliberately broken backends, each carrying a ``mutant`` record with its ``bug`` and the words
    ``message_mentions`` a catching message must contain; the CLI passes
    ``mha_harness.implementations.mutants.mutant_backends()``). A mutant is caught when at least one case fails with a
    message naming its broken property. ``progress(done, total, caught)`` is called after each mutant."""
    chosen = select_cases(cases, include_slow)
    mutants = list(mutants)
    rows = []
    for backend in mutants:
        report = Report(results=run_backend(backend, chosen))
        mention = backend.mutant.message_mentions.lower()
        caught_by = sorted({r.case for r in report.failures() if mention in r.message.lower()})
        rows.append({"name": backend.name, "bug": backend.mutant.bug, "caught_by": caught_by,
                     "failures": len(report.failures())})
        if progress is not None:
            progress(len(rows), len(mutants), sum(bool(r["caught_by"]) for r in rows))
    return {"caught": sum(bool(r["caught_by"]) for r in rows), "total": len(rows), "mutants": rows,
            "cases": list(cases) if cases else None}
