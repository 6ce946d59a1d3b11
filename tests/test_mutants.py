"""The mutant zoo proves every case bites: each mutant is caught by a case naming its bug, and every
case fails on at least one mutant."""
from __future__ import annotations

import functools

import pytest

import mha_harness
from mha_harness.conformance.casekit import all_cases
from mha_harness.implementations.mutants import MUTANTS, mutant_backends

BACKENDS = {b.name: b for b in mutant_backends()}


@functools.cache
def report_for(name: str):
    return mha_harness.check(BACKENDS[name], include_slow=True)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_is_caught_with_a_message_naming_its_bug(mutant):
    failures = report_for(mutant.name).failures()
    assert failures, f"{mutant.name} ({mutant.bug}) passed every case"
    named = [f for f in failures if mutant.message_mentions.lower() in f.message.lower()]
    assert named, f"{mutant.name}: no failure message mentions {mutant.message_mentions!r}: " \
                  f"{[f.message[:100] for f in failures[:3]]}"


@pytest.mark.parametrize("case_name", list(all_cases()))
def test_every_case_fails_on_at_least_one_mutant(case_name):
    killers = [m.name for m in MUTANTS if any(f.case == case_name for f in report_for(m.name).failures())]
    assert killers, f"{case_name} cannot fail: no mutant is caught by it"


def test_mutation_score_counts_every_mutant():
    from mha_harness.conformance.mutation import mutation_score
    score = mutation_score(mutant_backends(), cases=["check_scores_scaled_by_sqrt_d_head"])
    assert score["total"] == len(MUTANTS)
    caught = {row["name"] for row in score["mutants"] if row["caught_by"]}
    assert {"mutant-scale-sqrt-d-model", "mutant-no-scale"} <= caught


def test_mutants_are_not_registered_by_default():
    names = mha_harness.load_registry().names()
    assert not [n for n in names if n.startswith("mutant-")]
