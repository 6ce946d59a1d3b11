"""The mutant zoo: deliberately broken backends, each with exactly one known bug.

Never registered by default. The test suite runs every conformance case against every mutant
and asserts each is caught by a case whose failure message names the broken property; the
conformance report prints the mutation score. Each mutant is numpy-naive with one step replaced.
"""
from mha_harness.implementations.mutants.zoo import MUTANTS, Mutant, mutant_backends  # noqa: F401
