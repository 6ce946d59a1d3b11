"""The causal output case's long_square variant: a layer that processes its queries in chunks and builds each chunk's
causal mask from chunk-relative indices is right on every call of up to one chunk (an outside user's 256-query layer
passed `check --quick`); at 300 queries it fails, named."""
from __future__ import annotations

from mha_harness.cases._fixtures import CAUSAL_LONG, causal_output_variants
from mha_harness.contract.api import Capabilities
from mha_harness.implementations.mutants import mutant_backends
from mha_harness.implementations.numpy_naive import NumpyNaive


def test_long_square_runs_past_a_256_query_chunk_where_max_seq_len_allows():
    long = [v for v in causal_output_variants(NumpyNaive()) if v["variant"] == "long_square"]
    assert len(long) == 1 and long[0]["seq"] == long[0]["tk"] == CAUSAL_LONG > 256

    class Short(NumpyNaive):
        capabilities = Capabilities(max_seq_len=CAUSAL_LONG - 1)
    assert not [v for v in causal_output_variants(Short()) if v["variant"] == "long_square"]


def test_a_causal_mask_from_chunk_relative_query_indices_fails_only_long_square_named():
    import mha_harness
    mutant = next(b for b in mutant_backends() if b.name == "mutant-causal-chunk-relative-queries")
    report = mha_harness.check([mutant], cases=["check_causal_output_matches_reference"], isolate=False)
    failed = report.failures()
    assert [f.params["variant"] for f in failed] == ["long_square"], [f.params for f in failed]
    assert "a causal mask built per chunk of 256 queries from the chunk-relative query index" in failed[0].message
