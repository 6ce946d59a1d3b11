"""What a divergence's ``when`` can match, per case: the parameter keys of its variants and its named variants.

    python -m mha_harness.cases._catalogue      # prints the table "Case parameters and named variants" of docs/cases.md

Computed from the variant generators on a backend that declares everything (every dtype, gradients, both causal
alignments, every mask), so the table cannot drift from the code. ``form`` (the input form) is in every variant.
"""
from __future__ import annotations

from mha_harness.conformance.casekit import all_cases
from mha_harness.contract.api import DTYPES, AttentionBackend, Capabilities
from mha_harness.contract.conventions import ALIBI_KINDS, QK_NORMS, ROTARY_KINDS, ROTARY_SCALING_KINDS


class _DeclaresEverything(AttentionBackend):
    name = "any"
    capabilities = Capabilities(gradients=True, dtypes=DTYPES, qk_norms=QK_NORMS, rotary=ROTARY_KINDS,
                                partial_rotary=True, rotary_scalings=ROTARY_SCALING_KINDS, sliding_window=True,
                                alibi=ALIBI_KINDS)


def case_parameters() -> dict[str, dict]:
    """case name -> {"keys": sorted parameter keys, "variants": named variants in order, "forms": forms}."""
    backend = _DeclaresEverything()
    out = {}
    for name, case in all_cases().items():
        variants = case.variants(backend)
        keys = sorted({k for v in variants for k in v} | {"form"})
        named = list(dict.fromkeys(v["variant"] for v in variants if "variant" in v))
        out[name] = {"keys": keys, "variants": named, "forms": list(case.forms)}
    return out


def markdown_table() -> str:
    lines = ["| case | `when` keys | named variants (`variant`) | input forms |", "|---|---|---|---|"]
    for name, row in case_parameters().items():
        keys = ", ".join(f"`{k}`" for k in row["keys"])
        named = ", ".join(f"`{v}`" for v in row["variants"]) or "–"
        lines.append(f"| `{name}` | {keys} | {named} | {', '.join(row['forms'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
