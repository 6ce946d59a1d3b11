"""The README's opening counts, the shared conformance cases and the mutant zoo, are the registry's: a case or a mutant
added without the README following fails here, not in a reader's trust (they had read 27 and 60 against 30 and 96)."""
from __future__ import annotations

import re

from tests.conftest import ROOT


def test_readme_counts_the_built_in_cases_and_mutants_there_are():
    from mha_harness.conformance.casekit import BUILTIN_CASES, all_cases
    from mha_harness.implementations.mutants import mutant_backends
    text = (ROOT / "README.md").read_text()
    cases = re.search(r"\*\*Is my attention correct\?\*\* (\d+) shared conformance cases", text)
    mutants = re.search(r"A zoo of (\d+) deliberately broken backends", text)
    assert cases and mutants, "the README's opening no longer states the counts this test reads"
    built_in = [c for c in all_cases().values() if c.func.__module__.startswith(BUILTIN_CASES + ".")]
    assert int(cases.group(1)) == len(built_in)
    assert int(mutants.group(1)) == len(mutant_backends())
