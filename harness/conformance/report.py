"""The conformance report: per-case results, the policy (divergence) table, the mutation score,
written as versioned JSON and a markdown matrix of backends x cases."""
from __future__ import annotations

import platform
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from mha_harness.conformance.results import (
    BAD,
    EXPECTED_DIVERGENCE,
    FAILED,
    PASSED,
    SKIPPED,
    STATUSES,
    UNEXPECTED_PASS,
    CaseResult,
)
from mha_harness.util.atomic import write_json_atomic, write_text_atomic

SCHEMA_VERSION = "1.0"
_SYMBOL = {PASSED: "pass", FAILED: "FAIL", SKIPPED: "skip", EXPECTED_DIVERGENCE: "diverges",
           UNEXPECTED_PASS: "UNEXPECTED PASS", "error": "ERROR", "timeout": "TIMEOUT", "crashed": "CRASHED"}


@dataclass
class BackendInfo:
    name: str
    source: str = ""
    available: bool = True
    reason: str | None = None
    load_error: bool = False  # the plugin failed to import or construct: a failure, not mere unavailability
    capabilities: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    mask_polarity: str = ""
    native_causal: str = ""
    divergences: list = field(default_factory=list)


@dataclass
class Report:
    """Results of one conformance run; ``ok`` is False when any result is failed, error, timeout,
    crashed or an unexpected pass."""

    results: list[CaseResult] = field(default_factory=list)
    backends: dict[str, BackendInfo] = field(default_factory=dict)
    mutation: dict | None = None
    seconds: float = 0.0
    complete: bool = True

    @property
    def ok(self) -> bool:
        return not any(r.status in BAD for r in self.results) and not any(
            info.load_error for info in self.backends.values())

    def counts(self, backend: str | None = None) -> Counter:
        return Counter(r.status for r in self.results if backend is None or r.backend == backend)

    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in BAD]

    def for_backend(self, name: str) -> list[CaseResult]:
        return [r for r in self.results if r.backend == name]

    def cell(self, backend: str, case: str) -> str:
        """One status for a (backend, case) cell: the worst of its variants."""
        statuses = {r.status for r in self.results if r.backend == backend and r.case == case}
        for status in ("crashed", "timeout", "error", UNEXPECTED_PASS, FAILED, EXPECTED_DIVERGENCE, PASSED, SKIPPED):
            if status in statuses:
                return status
        return ""

    # --- the three policies backends legitimately differ on -----------------------------
    def policies(self) -> dict[str, dict[str, str]]:
        table = {}
        for name, info in self.backends.items():
            rows = self.for_backend(name)
            masked = [r for r in rows if r.case == "check_fully_masked_rows_output_zeros"]
            fully = masked[0].observed or masked[0].status if masked else "not run"
            if masked and masked[0].status == SKIPPED:
                fully = "not applicable (no masks)"
            verified = sorted({r.params.get("alignment") for r in rows
                               if r.case == "check_causal_output_matches_reference"
                               and r.params.get("seq") != r.params.get("tk") and r.status in (PASSED,)})
            if not info.capabilities.get("causal_alignments"):
                alignment = "no causal mask"
            elif verified:
                alignment = " and ".join(verified) + " (verified with Tq != Tk)"
            else:
                alignment = ", ".join(info.capabilities.get("causal_alignments", [])) + " (declared; not verified)"
            table[name] = {"fully_masked_rows": fully, "causal_alignment": alignment,
                           "native_causal": info.native_causal, "mask_polarity": info.mask_polarity}
        return table

    def to_json(self) -> dict:
        return {
            "schema": "mha-harness/conformance", "schema_version": SCHEMA_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "processor": platform.processor() or platform.machine()},
            "seconds": round(self.seconds, 2), "ok": self.ok, "complete": self.complete,
            "summary": {name: dict(self.counts(name)) for name in self.backends},
            "backends": {name: vars(info) for name, info in self.backends.items()},
            "policies": self.policies(), "mutation": self.mutation,
            "results": [r.to_dict() for r in self.results],
        }

    def to_markdown(self) -> str:
        names = [n for n, info in self.backends.items() if info.available]
        cases = list(dict.fromkeys(r.case for r in self.results))
        lines = ["# mha-harness conformance report", "",
                 f"Run took {self.seconds:.1f} s. Overall: **{'OK' if self.ok else 'FAILED'}**"
                 + ("" if self.complete else " (INCOMPLETE: the run was interrupted)") + ".", "",
                 "| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for case in cases:
            lines.append(f"| {case} | " + " | ".join(_SYMBOL.get(self.cell(n, case), "") for n in names) + " |")
        lines += ["", "## Totals", "", "| backend | " + " | ".join(STATUSES) + " |", "|---|" + "---|" * len(STATUSES)]
        for n in names:
            c = self.counts(n)
            lines.append(f"| {n} | " + " | ".join(str(c.get(s, 0)) for s in STATUSES) + " |")
        lines += ["", "## Policies that backends legitimately differ on", "",
                  "The harness pins: fully masked rows output zeros; both causal alignments; "
                  "attn_mask True = may attend, key_padding_mask True = ignore.", "",
                  "| backend | fully masked rows | causal alignments verified | its own causal flag | "
                  "mask polarity at its own API |",
                  "|---|---|---|---|---|"]
        for n, row in self.policies().items():
            if self.backends[n].available:
                lines.append(f"| {n} | {row['fully_masked_rows']} | {row['causal_alignment']} | {row['native_causal']} "
                             f"| {row['mask_polarity']} |")
        divergent = [(n, d) for n, info in self.backends.items() for d in info.divergences]
        if divergent:
            lines += ["", "## Declared divergences", "", "| backend | case | when | observed | reason |",
                      "|---|---|---|---|---|"]
            for n, d in divergent:
                lines.append(f"| {n} | {d['case']} | {d.get('when') or 'always'} | {d['observed']} | {d['reason']} |")
        unavailable = [(n, i) for n, i in self.backends.items() if not i.available]
        if unavailable:
            lines += ["", "## Not run here", ""] + [
                f"- **{n}**: {'**failed to load** ' if i.load_error else ''}{i.reason}" for n, i in unavailable]
        if self.mutation:
            m = self.mutation
            lines += ["", "## Mutation score", "",
                      f"{m['caught']} of {m['total']} mutants caught "
                      f"({100.0 * m['caught'] / max(1, m['total']):.0f}%).", "",
                      "| mutant | bug | caught by |", "|---|---|---|"]
            for row in m["mutants"]:
                lines.append(f"| {row['name']} | {row['bug']} | {', '.join(row['caught_by']) or '**NOT CAUGHT**'} |")
        bad = self.failures()
        if bad:
            lines += ["", "## Failures", ""]
            for r in bad:
                lines.append(f"- `{r.case}[{r.variant}]` **{r.status}**: {r.message}  \n  repro: `{r.repro}`")
        return "\n".join(lines) + "\n"

    def write(self, directory: str | Path) -> dict[str, Path]:
        directory = Path(directory)
        return {"json": write_json_atomic(directory / "conformance.json", self.to_json()),
                "markdown": write_text_atomic(directory / "conformance.md", self.to_markdown())}

    def summary_lines(self) -> list[str]:
        out = []
        for name, info in self.backends.items():
            if not info.available:
                label = "ERROR" if info.load_error else "not run"
                out.append(f"  {name:<28} {label}: {info.reason}")
                continue
            c = self.counts(name)
            bad = sum(c.get(s, 0) for s in BAD)
            text = ", ".join(f"{c[s]} {s}" for s in STATUSES if c.get(s))
            out.append(f"  {name:<28} {'OK  ' if not bad else 'FAIL'} {text}")
        return out


def backend_info(backend, source: str, reason: str | None) -> BackendInfo:
    """Describe a loaded backend for the report; ``reason`` says why it is unavailable (None: available)."""
    try:
        versions = backend.versions() if reason is None else {}
    except Exception:  # noqa: BLE001 - a plugin's versions() must not lose the report
        versions = {}
    return BackendInfo(backend.name, source=source, available=reason is None, reason=reason,
                       capabilities=backend.capabilities.to_dict(), versions=versions,
                       mask_polarity=backend.native_mask_polarity, native_causal=backend.native_causal,
                       divergences=[{"case": d.case, "when": {k: list(v) if isinstance(v, tuple) else v
                                                              for k, v in d.when.items()},
                                     "observed": d.observed, "reason": d.reason} for d in backend.divergences])


def entry_info(entry) -> BackendInfo:
    """Describe a registry entry; one whose plugin failed to load is a load error."""
    if entry.backend is None:
        return BackendInfo(entry.name, source=entry.source, available=False, reason=entry.error, load_error=True)
    return backend_info(entry.backend, entry.source, entry.reason_unavailable)
