"""The mutation score: how many deliberately broken backends the conformance cases catch."""
from __future__ import annotations

from mha_harness.checking import check


def mutation_score(cases=None, *, include_slow: bool = False) -> dict:
    """Run the cases on every mutant in mha_harness.implementations.mutants; a mutant is caught when at least one case
    fails with a message naming its broken property."""
    from mha_harness.implementations.mutants import mutant_backends
    rows = []
    for backend in mutant_backends():
        report = check(backend, cases=cases, include_slow=include_slow)
        mention = backend.mutant.message_mentions.lower()
        caught_by = sorted({r.case for r in report.failures() if mention in r.message.lower()})
        rows.append({"name": backend.name, "bug": backend.mutant.bug, "caught_by": caught_by,
                     "failures": len(report.failures())})
    return {"caught": sum(bool(r["caught_by"]) for r in rows), "total": len(rows), "mutants": rows}
