"""The conformance report: per-case results, the policy (divergence) table, the mutation score,
written as versioned JSON and a markdown matrix of backends x cases.

Everything a plugin controls (its name, messages, declared divergences, versions) goes into the markdown
escaped (:mod:`mha_harness.util.markdown`): it cannot forge a section or inject HTML. Writing into a
results folder takes a lock and merges by backend, so concurrent runs into one folder keep each
other's backends (see :meth:`Report.write`)."""
from __future__ import annotations

import json
import platform
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from mha_harness.conformance.casekit import FORM_SKIP
from mha_harness.conformance.results import ABANDONED, BAD, SEVERITY, STATUSES, CaseResult, Status
from mha_harness.contract.api import Divergence
from mha_harness.contract.score_scale import score_scale_label
from mha_harness.util.atomic import results_lock, write_json_atomic, write_text_atomic
from mha_harness.util.markdown import md_code, md_text
from mha_harness.util.text import clipped

SCHEMA_VERSION = "1.3"
_SYMBOL = {Status.PASSED: "pass", Status.FAILED: "FAIL", Status.SKIPPED: "skip", Status.EXPECTED_DIVERGENCE: "diverges",
           Status.UNEXPECTED_PASS: "UNEXPECTED PASS", Status.ERROR: "ERROR", Status.TIMEOUT: "TIMEOUT",
           Status.CRASHED: "CRASHED"}
#: statuses that count as "this case ran and held"
_RAN = (Status.PASSED, Status.EXPECTED_DIVERGENCE)
CAUSAL_CASES = ("check_causal_output_matches_reference", "check_causal_mask_blocks_future_keys")
FULLY_MASKED_CASE = "check_fully_masked_rows_output_zeros"


def _unanswered(rows: list[CaseResult]) -> str:
    """How many of ``rows`` ended without an answer to judge (an error, a timeout, a crash), by status; "" if none:
    those are not mask failures, and the policy table must not count them as such."""
    counts = {label: sum(r.status == s for r in rows)
              for s, label in ((Status.ERROR, "errored"), (Status.TIMEOUT, "timed out"), (Status.CRASHED, "crashed"))}
    if not any(counts.values()):
        return ""
    detail = ", ".join(f"{n} {label}" for label, n in counts.items() if n)
    return f"; {sum(counts.values())} without an answer to judge ({detail}): not a mask verdict"


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


def diagnoses_line(failures) -> str:
    """One backend's failed variants, as (case, diagnosis or None), summed into the lines under its failing cases:
    the known mistakes they match, the most often matched first, one per line and each whole (its fix is at its
    end), with the cases it was found in ("diagnosed: ...", later ones aligned under the first); "" when none
    matched one. Shared by the check summary and the pytest plugin's, which indent each line."""
    found: dict[str, dict[str, int]] = {}
    for case, diagnosis in failures:
        if diagnosis:
            cases = found.setdefault(diagnosis, {})
            cases[case] = cases.get(case, 0) + 1
    if not found:
        return ""
    ranked = sorted(found.items(), key=lambda item: -sum(item[1].values()))
    # bracketed: a " - " separator read as the minus of a diagnosis's formula (dS = P * (dP - ...)
    shown = [f"{clipped(text, DIAGNOSIS_CHARS)} [in {sum(cases.values())} variant(s) of {', '.join(cases)}]"
             for text, cases in ranked[:DIAGNOSES_SHOWN]]
    more = len(ranked) - DIAGNOSES_SHOWN
    if more > 0:
        shown.append(f"{more} more in the failures above")
    return DIAGNOSED + f"\n{' ' * len(DIAGNOSED)}".join(shown)


#: how the summary's lines of diagnoses begin
DIAGNOSED = "diagnosed: "

#: a declaration verified on at most this many variants names them in the report's table
NAMED_VERIFIED = 3


def verified_on(variants: list[str]) -> str:
    """The declarations table's "verified on" cell: how many variants, named when they are few (which variant
    verified a declaration says whether its behaviour could show there)."""
    named = f": {', '.join(variants)}" if len(variants) <= NAMED_VERIFIED else f" (the first: {variants[0]})"
    return f"{len(variants)} variant(s){named}"


@dataclass
class Report:
    """Results of one conformance run; ``ok`` is True only when the run completed, no backend failed to
    load, every available backend has at least one case that ran and held (not only skips), and no result is
    failed, error, timeout, crashed or an unexpected pass. A plugin therefore cannot make a run look fine by
    vanishing or by declaring nothing a case can run with."""

    results: list[CaseResult] = field(default_factory=list)
    backends: dict[str, BackendInfo] = field(default_factory=dict)
    mutation: dict | None = None
    seconds: float = 0.0
    complete: bool = True

    #: backends kept from an earlier run's file in the same results folder (see :meth:`write`)
    earlier: list = field(default_factory=list)
    #: NumPy or harness functions replaced in the harness's process during the run (mha_harness.util.integrity)
    tampered: list = field(default_factory=list)
    #: case plugin module -> why it could not be imported (its cases did not run)
    case_plugin_errors: dict = field(default_factory=dict)
    #: case -> why this run left it out (--quick leaves out the slow cases): listed, so a reader knows it did not run
    left_out: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.complete and not any(r.status in BAD for r in self.results)
                and not any(info.load_error for info in self.backends.values()) and not self.missing_results()
                and not self.nothing_ran() and not self.tampered and not self.case_plugin_errors)

    def missing_results(self) -> list[str]:
        """Available backends with no result at all (their worker vanished, or nothing was run)."""
        have = {r.backend for r in self.results}
        return [n for n, info in self.backends.items() if info.available and n not in have]

    def nothing_ran(self) -> list[str]:
        """Available backends whose every result is a skip (no case gave a verdict): never OK."""
        ran = {r.backend for r in self.results if r.status != Status.SKIPPED}
        have = {r.backend for r in self.results}
        return [n for n, info in self.backends.items() if info.available and n in have and n not in ran]

    def grid_never_ran(self, backend: str) -> str:
        """Why ``backend``'s output was never compared with the reference on the grid, when the grid case was in
        the run and every variant of it skipped (the first reason); "" otherwise. A backend that refuses every
        grid call can pass the few cases that do not compare outputs, which is no verdict on its attention."""
        grid = [r for r in self.for_backend(backend) if r.case == GRID_CASE]
        if grid and all(r.status == Status.SKIPPED for r in grid):
            return grid[0].message
        return ""

    def counts(self, backend: str | None = None) -> Counter:
        return Counter(r.status for r in self.results if backend is None or r.backend == backend)

    def form_skips(self, backend: str) -> int:
        """How many of the backend's results were skipped because the case is not defined for its input form."""
        return sum(1 for r in self.for_backend(backend) if r.status == Status.SKIPPED and r.observed == FORM_SKIP)

    def form_of(self, backend: str) -> str:
        """The input form the backend's cases ran in (``Capabilities.inputs``)."""
        forms = {r.params.get("form") for r in self.for_backend(backend)} - {None}
        return ", ".join(sorted(forms)) or self.backends[backend].capabilities.get("inputs", "")

    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in BAD]

    def for_backend(self, name: str) -> list[CaseResult]:
        return [r for r in self.results if r.backend == name]

    def cell(self, backend: str, case: str) -> str:
        """One status for a (backend, case) cell: the worst of its variants."""
        statuses = {r.status for r in self.results if r.backend == backend and r.case == case}
        return next((status for status in SEVERITY if status in statuses), "")

    # --- the policies backends legitimately differ on, from what ran -----------------------
    @staticmethod
    def _fully_masked(rows: list[CaseResult]) -> str:
        masked = [r for r in rows if r.case == FULLY_MASKED_CASE]
        if not masked:
            return "not run"
        r = masked[0]
        if r.status == Status.PASSED:
            return "zeros (verified)"
        if r.status == Status.EXPECTED_DIVERGENCE:
            return f"{r.observed} (declared, verified)"
        if r.status == Status.SKIPPED:
            return f"not run: {r.message}"
        return f"{r.status.value.upper()}: {r.observed or r.message[:80]}"

    @staticmethod
    def _alignments(rows: list[CaseResult], declared: list[str]) -> str:
        """Per declared alignment: verified when its causal cases ran and held; FAILS (only with NaN/inf poison in
        masked keys, when every failing variant held such poison; else with the mistake their failures match most
        often, which need not be the mask's); or the skip's reason."""
        if not declared:
            return "no causal mask declared"
        parts = []
        for alignment in declared:
            mine = [r for r in rows if r.case in CAUSAL_CASES and r.params.get("alignment") == alignment]
            if not mine:
                parts.append(f"{alignment} not run")
            elif bad := [r for r in mine if r.status in (Status.FAILED, Status.UNEXPECTED_PASS)]:
                unanswered = _unanswered(mine)
                if all(r.params.get("poison") in ("nan", "inf") for r in bad):  # the mask holds on finite keys
                    parts.append(f"{alignment} FAILS only with NaN/inf stored in masked keys ({len(bad)} of "
                                 f"{len(mine)} variants{unanswered}; a dense P @ V's 0 * NaN: "
                                 "masked_poison_divergences)")
                else:  # what their failures matched: a causal case also fails for a bug elsewhere (a wrong scale)
                    named = Counter(r.extra.get("diagnosis") for r in bad if r.extra.get("diagnosis"))
                    because = f"; their diagnosis: {clipped(named.most_common(1)[0][0], 120)}" if named else ""
                    parts.append(f"{alignment} FAILS ({len(bad)} of {len(mine)} variants{unanswered}{because})")
            elif any(r.status in BAD for r in mine):  # errors, timeouts, crashes: the mask was not tested there
                ran = sum(r.status in _RAN for r in mine)
                parts.append(f"{alignment} NOT VERIFIED ({ran} of {len(mine)} variants ran and held"
                             f"{_unanswered(mine)})")
            elif any(r.status in _RAN for r in mine):
                cross = any(r.status in _RAN and r.params.get("seq") != r.params.get("tk") for r in mine)
                diverges = any(r.status == Status.EXPECTED_DIVERGENCE for r in mine)
                parts.append(f"{alignment} verified" + (" (Tq != Tk too)" if cross else " (Tq == Tk only)")
                             + (" with declared divergences" if diverges else ""))
            else:
                parts.append(f"{alignment} skipped: {mine[0].message}")
        return "; ".join(parts)

    def policies(self) -> dict[str, dict[str, str]]:
        table = {}
        for name, info in self.backends.items():
            rows = self.for_backend(name)
            alignments = list(info.capabilities.get("causal_alignments", []))
            causal = self._alignments(rows, alignments)
            if info.capabilities.get("always_causal"):
                causal = f"always causal (every case ran {alignments[0]}); {causal}"
            table[name] = {"fully_masked_rows": self._fully_masked(rows), "causal_alignment": causal,
                           "native_causal": info.native_causal, "mask_polarity": info.mask_polarity,
                           "scores": _scores_policy(info.capabilities.get("logit_softcap"),
                                                     info.capabilities.get("score_scale"),
                                                     info.capabilities.get("qk_norms", ()),
                                                     info.capabilities.get("rotary", ()),
                                                     info.capabilities.get("sliding_window", False),
                                                     info.capabilities.get("alibi", ()))}
        return table

    def to_json(self) -> dict:
        return {
            "schema": "mha-harness/conformance", "schema_version": SCHEMA_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "processor": platform.processor() or platform.machine()},
            "seconds": round(self.seconds, 2), "ok": self.ok, "complete": self.complete,
            "summary": {name: {s.value: n for s, n in self.counts(name).items()} for name in self.backends},
            "input_forms": {name: {"form": self.form_of(name), "skipped_for_form": self.form_skips(name)}
                            for name in self.backends},
            "backends": {name: vars(info) for name, info in self.backends.items()},
            "missing_results": self.missing_results(), "nothing_ran": self.nothing_ran(), "tampered": self.tampered,
            "case_plugin_errors": dict(self.case_plugin_errors), "earlier_runs": list(self.earlier),
            "left_out": dict(self.left_out),
            "policies": self.policies(), "mutation": self.mutation,
            "results": [r.to_dict() for r in self.results],
        }

    def to_markdown(self) -> str:
        e = md_text
        names = [n for n, info in self.backends.items() if info.available]
        cases = list(dict.fromkeys(r.case for r in self.results))
        lines = ["# mha-harness conformance report", "",
                 f"Run took {self.seconds:.1f} s. Overall: **{'OK' if self.ok else 'FAILED'}**"
                 + ("" if self.complete else " (INCOMPLETE: the run was interrupted)") + ".", ""]
        if self.tampered:
            lines += ["**The harness's process was tampered with**: plugin code replaced "
                      + ", ".join(md_code(t) for t in self.tampered)
                      + "; no verdict of this run can be trusted.", ""]
        for module, reason in self.case_plugin_errors.items():
            lines += [f"**Case plugin {md_code(module)} was not loaded** (its cases did not run): {e(reason)}", ""]
        if self.earlier:
            lines += [f"Kept from earlier runs into this folder: {', '.join(e(n) for n in self.earlier)}.", ""]
        if self.left_out:
            left = "; ".join(f"{md_code(case)} ({e(why)})" for case, why in self.left_out.items())
            lines += [f"Not run in this run: {left}.", ""]
        lines += ["| case | " + " | ".join(e(n) for n in names) + " |", "|---|" + "---|" * len(names)]
        for case in cases:
            lines.append(f"| {e(case)} | " + " | ".join(_SYMBOL.get(self.cell(n, case), "") for n in names) + " |")
        lines += ["", "## Totals", "",
                  "Each backend runs every case in the input form it takes (`Capabilities.inputs`); "
                  "*of which for the form* counts the skips whose case is not defined for that form.", "",
                  "| backend | input form | " + " | ".join(STATUSES) + " | of which for the form |",
                  "|---|---|" + "---|" * (len(STATUSES) + 1)]
        for n in names:
            c = self.counts(n)
            lines.append(f"| {e(n)} | {e(self.form_of(n))} | " + " | ".join(str(c.get(s, 0)) for s in STATUSES)
                         + f" | {self.form_skips(n)} |")
        lines += ["", "## Policies that backends legitimately differ on", "",
                  "The harness pins: fully masked rows output zeros; both causal alignments; "
                  "attn_mask True = may attend, key_padding_mask True = ignore; scores scaled by 1/sqrt(d_head) and "
                  "not capped (a declared score scale, T5's 1 or muP's 1/d_head, and a declared soft cap c, "
                  "c * tanh(s / c) before any mask: every case compared with the reference scaled and capped so).",
                  "",
                  "An alignment is *verified* when its causal cases ran and held; a skip shows its reason.", "",
                  "| backend | fully masked rows | causal alignments verified | its own causal flag | "
                  "mask polarity at its own API | scores |",
                  "|---|---|---|---|---|---|"]
        for n, row in self.policies().items():
            if self.backends[n].available:
                lines.append(f"| {e(n)} | {e(row['fully_masked_rows'])} | {e(row['causal_alignment'])} "
                             f"| {e(row['native_causal'])} | {e(row['mask_polarity'])} | {e(row['scores'])} |")
        divergent = [(n, d) for n, info in self.backends.items() for d in info.divergences]
        if divergent:
            lines += ["", "## Declared divergences", "", "Each is verified where its case ran: the case is rerun "
                      "under the declared behaviour and must pass there ('verified on' counts the variants it "
                      "covers that diverged and held under it, and names up to three, so a reader sees where it held; "
                      "a declaration whose case did not run here is not verified, and says so).", "",
                      "| backend | case | when | behaviour | observed | reason | verified on |",
                      "|---|---|---|---|---|---|---|"]
            for n, d in divergent:
                covered = self.covered_by(n, d)
                verified = [r.variant for r in covered if r.status == Status.EXPECTED_DIVERGENCE]
                shown = verified_on(verified) if verified else "none: " + self.why_unverified(n, d)
                failed = [r for r in covered if r.status == Status.FAILED]
                if verified and failed:  # a bug beside the declared behaviour: the table must not read as settled
                    shown += (f"; it does not hold on {len(failed)} variant(s) it covers, which fail even under it "
                              f"(the first: {failed[0].variant})")
                lines.append(f"| {e(n)} | {e(d['case'])} | {e(d.get('when') or 'always')} "
                             f"| {md_code(str(d.get('behaviour', '')), in_table=True)} | {e(d['observed'])} "
                             f"| {e(d['reason'])} | {e(shown)} |")
        unavailable = [(n, i) for n, i in self.backends.items() if not i.available]
        if unavailable:
            lines += ["", "## Not run here", ""] + [f"- **{e(n)}**: {_not_run_reason(i)}" for n, i in unavailable]
        missing = self.missing_results()
        if missing:
            lines += ["", "## No results", ""] + [
                f"- **{e(n)}**: available, but no case result came back (counted as a failure)" for n in missing]
        if self.nothing_ran():
            lines += ["", "## No case ran", ""] + [
                f"- **{e(n)}**: every case was skipped (a backend with no verdict is not OK)"
                for n in self.nothing_ran()]
        if self.mutation:
            m = self.mutation
            lines += ["", "## Mutation score", "",
                      f"{m['caught']} of {m['total']} mutants caught "
                      f"({100.0 * m['caught'] / max(1, m['total']):.0f}%)"
                      + (f" by the cases asked for ({', '.join(e(c) for c in m['cases'])})" if m.get("cases") else "")
                      + ".", "",
                      "| mutant | bug | caught by |", "|---|---|---|"]
            for row in m["mutants"]:
                lines.append(f"| {e(row['name'])} | {e(row['bug'])} | "
                             f"{', '.join(e(c) for c in row['caught_by']) or '**NOT CAUGHT**'} |")
        bad = self.failures()
        if bad:
            lines += ["", "## Failures", ""]
            for r in bad:
                lines.append(f"- {md_code(f'{r.case}[{r.variant}]')} **{e(r.status.value)}**: {e(r.message)}  \n"
                             f"  repro: {md_code(r.repro)}")
        skipped = self.skip_reasons()
        if skipped:
            lines += ["", "## Skipped", "",
                      "Each backend's skipped case variants, identical reasons grouped (every variant is in "
                      "conformance.json with its reason).", "",
                      "| backend | variants | reason | cases |", "|---|---|---|---|"]
            for n, groups in skipped.items():
                for reason, (count, in_cases) in groups.items():
                    lines.append(f"| {e(n)} | {count} | {e(reason)} | "
                                 f"{', '.join(md_code(c, in_table=True) for c in in_cases)} |")
        return "\n".join(lines) + "\n"

    def failed_cases_line(self, backend: str) -> str:
        """The cases that failed on ``backend``, by name (a name says what the case proves), with how many variants
        of each and their status, in case order: the line under a FAIL in the summary, since the failures printed
        while the run goes come in case order and the first is not always the one whose message names the bug."""
        by_case: dict[str, Counter] = {}
        abandoned = 0
        for r in self.for_backend(backend):
            if r.status in BAD and r.observed == ABANDONED:  # never ran: one count, as the run printed one line
                abandoned += 1
            elif r.status in BAD:
                by_case.setdefault(r.case, Counter())[r.status.value] += 1
        return FAILING_CASES_HEAD + ", ".join(
            f"{case} ({', '.join(f'{n} {status}' for status, n in counts.items())})"
            for case, counts in by_case.items()) + (
            f"; {abandoned} variant(s) not run: the worker was lost too often" if abandoned else "")

    def diagnoses_line(self, backend: str) -> str:
        """The known mistakes the failed outputs of ``backend`` match (the diagnoses the failures printed), the most
        often matched first, each with the cases it was found in; "" when no failure matched one. The line under
        the failing cases in the summary: the first failure printed can be a case whose message has numbers only."""
        return diagnoses_line([(r.case, r.extra.get("diagnosis")) for r in self.for_backend(backend)
                               if r.status == Status.FAILED])

    def covered_by(self, backend: str, declared: dict) -> list[CaseResult]:
        """The results of ``backend`` that a declared divergence (as the report keeps it: case, behaviour, reason,
        when) covers: its case's variants whose parameters fit its ``when``."""
        fits = Divergence(declared["case"], declared["behaviour"], declared.get("reason") or "-",
                          declared.get("when") or {})
        return [r for r in self.for_backend(backend) if fits.matches(r.case, r.params)]

    def why_unverified(self, backend: str, declared: dict) -> str:
        """Why a declared divergence was verified on no variant here: its case did not run, no variant of the case
        fits its ``when`` (the backend's input form or capabilities give the case none), every variant it covers
        was skipped (the first skip reason), some failed even under it, or they held without it."""
        case, when = declared["case"], declared.get("when") or {}
        ran = [r for r in self.for_backend(backend) if r.case == case]
        if not ran:
            return "the case did not run here"
        if all(r.status == Status.SKIPPED for r in ran):
            return f"every variant of the case was skipped ({ran[0].message})"
        covered = self.covered_by(backend, declared)
        if not covered:
            condition = ", ".join(f"{k} in {list(v)}" if isinstance(v, (list, tuple)) else f"{k} = {v!r}"
                                  for k, v in when.items())
            have = "; ".join(f"{k}: " + ", ".join(sorted({repr(r.params.get(k)) for r in ran})) for k in when)
            return (f"no variant of the case here has {condition} (its variants in the {self.form_of(backend)} "
                    f"form have {have})")
        skipped = [r for r in covered if r.status == Status.SKIPPED]
        if len(skipped) == len(covered):
            return f"every variant it covers was skipped ({skipped[0].message})"
        failed = [r for r in covered if r.status == Status.FAILED]
        if failed:  # the strict run diverged, and the declared behaviour did not hold either
            return (f"it does not hold: {len(failed)} variant(s) it covers fail even under it (the first: "
                    f"{failed[0].variant})")
        return "the case did not diverge here"

    def skip_reasons(self) -> dict[str, dict[str, tuple[int, list[str]]]]:
        """backend -> skip reason -> (how many variants skipped with it, the cases they belong to), most first."""
        out: dict[str, dict[str, tuple[int, list[str]]]] = {}
        for name, info in self.backends.items():
            if not info.available:
                continue
            groups: dict[str, list[str]] = {}
            for r in self.for_backend(name):
                if r.status == Status.SKIPPED:
                    groups.setdefault(r.message or "(no reason given)", []).append(r.case)
            if groups:
                out[name] = {reason: (len(found), list(dict.fromkeys(found)))
                             for reason, found in sorted(groups.items(), key=lambda kv: -len(kv[1]))}
        return out

    def write(self, directory: str | Path) -> dict[str, Path]:
        """Write conformance.json and conformance.md into ``directory``, merged by backend with what is there.

        Under a lock (``directory/.conformance.lock``, the filelock library), the existing JSON is read and
        every backend it holds that this run did not check, with its results, is kept (listed as
        ``earlier_runs``); a backend this run checked replaces the old one. A backend listed there without
        results in an incomplete file (another run still working on it) is left for that run to write.
        ``self`` is not changed: its ``ok`` stays this run's verdict."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with results_lock(directory / ".conformance.lock"):
            merged = self.merged_with(_read_report(directory / "conformance.json"))
            return {"json": write_json_atomic(directory / "conformance.json", merged.to_json()),
                    "markdown": write_text_atomic(directory / "conformance.md", merged.to_markdown())}

    def merged_with(self, earlier: dict | None) -> Report:
        """This report plus the backends of ``earlier`` (a conformance.json document) that it does not have."""
        if not earlier:
            return self
        merged = Report(results=list(self.results), backends=dict(self.backends), mutation=self.mutation,
                        seconds=self.seconds, complete=self.complete, earlier=list(self.earlier),
                        tampered=list(self.tampered), case_plugin_errors=dict(self.case_plugin_errors))
        results_by = {}
        for row in earlier.get("results", []):
            results_by.setdefault(row.get("backend"), []).append(row)
        for name, info in earlier.get("backends", {}).items():
            if name in merged.backends or (info.get("available") and name not in results_by):
                continue
            try:
                merged.backends[name] = BackendInfo(**info)
                merged.results += [CaseResult(**row) for row in results_by.get(name, [])]
            except TypeError:  # a document of another schema version: not merged
                continue
            merged.earlier.append(name)
        if merged.mutation is None:
            merged.mutation = earlier.get("mutation")
        return merged

    def summary_lines(self) -> list[str]:
        out = []
        if self.tampered:
            out.append(f"  TAMPERED: plugin code replaced {', '.join(self.tampered)} in the harness's process; "
                       "the run fails")
        for module, reason in self.case_plugin_errors.items():
            out.append(f"  ERROR case plugin {module}: {reason} (its cases did not run; the run fails)")
        for name, info in self.backends.items():
            if not info.available:
                label = "ERROR" if info.load_error else "not run"
                out.append(f"  {name:<28} {label}: {info.reason}")
                continue
            c = self.counts(name)
            bad = sum(c.get(s, 0) for s in BAD)
            text = ", ".join(f"{c[s]} {s}" for s in STATUSES if c.get(s)) or "no results came back"
            if self.form_skips(name):
                text += f" ({self.form_skips(name)} skipped: not defined for inputs={self.form_of(name)!r})"
            if c and name in self.nothing_ran():
                bad, text = 1, text + "; no case ran"
            out.append(f"  {name:<28} {'OK  ' if c and not bad else 'FAIL'} {text}")
            never = self.grid_never_ran(name)
            if never:
                out.append(f"  {'':<28}      warning: its output was never compared with the reference: every "
                           f"variant of {GRID_CASE} skipped (first: {clipped(never, 200)})")
            failing = self.failed_cases_line(name) if bad else FAILING_CASES_HEAD
            if failing != FAILING_CASES_HEAD:  # "no case ran" has none to name
                out.append(f"  {'':<28}      {failing}")
                out += [f"  {'':<28}      {line}" for line in self.diagnoses_line(name).splitlines()]
        for case, why in self.left_out.items():
            out.append(f"  not run: {case} ({why})")
        out.append(f"  not run by check: {PREPARE_NOT_RUN}")
        return out


FAILING_CASES_HEAD = "failing cases: "

#: what the summary says of the prepared calls the benchmarks time, which no case runs
PREPARE_NOT_RUN = ("prepare()'s benchmarked calls (a separate code path): `mha-harness bench` checks each one's output "
                   "or gradients against the reference before timing it")

#: the reference grid: the case whose variants compare a backend's outputs with the reference across shapes
GRID_CASE = "check_output_matches_reference"

#: the summary's diagnoses lines show this many distinct diagnoses, one per line, each whole up to this many
#: characters (every one is printed whole with its failure)
DIAGNOSES_SHOWN, DIAGNOSIS_CHARS = 3, 600


def _scores_policy(cap, scale=None, qk_norms=(), rotary=(), sliding_window=False, alibi=()) -> str:
    """The scores' conventions a backend declares, in words (the policy table's "scores" column): its score scale
    when it declares one other than 1/sqrt(d_head), its soft cap, the q/k norms, rotary embeddings, sliding window
    and ALiBi biases it can be built with; "as they are" for none."""
    parts = [] if scale is None else [f"scaled by {score_scale_label(scale)} (declared, not 1/sqrt(d_head))"]
    if cap is not None:
        parts.append(f"soft-capped at {cap:g} (declared: {cap:g} * tanh(s / {cap:g}) before any mask)")
    if qk_norms:
        parts.append(f"q and k normed in the layers whose config asks ({', '.join(qk_norms)} declared)")
    if rotary:
        parts.append(f"q and k turned by rotary embeddings in the layers whose config asks ({', '.join(rotary)} "
                     "declared)")
    if sliding_window:
        parts.append("the keys behind a sliding window masked in the layers whose config asks (sliding_window "
                     "declared)")
    if alibi:
        parts.append(f"biased by distance (ALiBi) in the layers whose config asks ({', '.join(alibi)} declared)")
    return "; ".join(parts) or "as they are"


def _not_run_reason(info: BackendInfo) -> str:
    """Why a backend did not run, for the markdown: a load error says "failed to load" once, in bold."""
    if not info.load_error:
        return md_text(info.reason)
    reason = str(info.reason or "")
    reason = reason[len("failed to load:"):].strip() if reason.startswith("failed to load:") else reason
    return f"**failed to load**: {md_text(reason)}"


def _read_report(path: Path) -> dict | None:
    """An existing conformance.json of this schema, or None (absent, unreadable or another schema)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != "mha-harness/conformance":
        return None
    return doc


def backend_info(backend, source: str, reason: str | None) -> BackendInfo:
    """Describe a loaded backend for the report; ``reason`` says why it is unavailable (None: available).

    The plugin code this runs (``versions()``, properties) is guarded: a plugin that raises anything or
    hangs is described as a load error with that reason, never a crash of the run."""
    from mha_harness.util.guard import PluginFault, call_guarded, plugin_timeout
    try:
        return call_guarded(lambda: _describe(backend, source, reason), "describing the backend", plugin_timeout())
    except PluginFault as fault:
        return BackendInfo(str(getattr(backend, "name", "?")), source=source, available=False,
                           reason=f"failed to load: {fault}", load_error=True)


def _describe(backend, source: str, reason: str | None) -> BackendInfo:
    try:
        versions = dict(backend.versions()) if reason is None else {}
    except Exception:  # noqa: BLE001 - a plugin's versions() must not lose the report
        versions = {}
    from mha_harness.contract.api import policy_texts
    native_causal, mask_polarity = policy_texts(backend)
    return BackendInfo(backend.name, source=source, available=reason is None, reason=reason,
                       capabilities=backend.capabilities.to_dict(), versions=versions,
                       mask_polarity=mask_polarity, native_causal=native_causal,
                       divergences=[{"case": d.case, "behaviour": d.behaviour,
                                     "when": {k: list(v) if isinstance(v, tuple) else v
                                                              for k, v in d.when.items()},
                                     "observed": d.observed, "reason": d.reason} for d in backend.divergences])


def entry_info(entry) -> BackendInfo:
    """Describe a registry entry; one whose plugin failed to load (or whose availability() failed) is a load error."""
    if entry.error is not None:
        return BackendInfo(entry.name, source=entry.source, available=False, reason=entry.error, load_error=True)
    return backend_info(entry.backend, entry.source, entry.reason_unavailable)
