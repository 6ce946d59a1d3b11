"""The ``mha-harness`` command line: list, check, search, bench and run.

Usage errors (unknown backend or case, malformed spec, bad sequence lengths, unwritable results
directory, missing optional dependency) print one line and exit with status 2; failing
conformance exits 1; an interrupted run (Ctrl-C, SIGTERM) keeps every finished result and exits 130.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from mha_harness.util.atomic import check_writable
from mha_harness.util.install import install_hint
from mha_harness.util.options import available_memory_bytes, float_range, int_range, nonempty_path
from mha_harness.util.text import clipped

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: the reader of stdout closed it early (128 + SIGPIPE, a shell's status for a command killed by the broken pipe)
EXIT_BROKEN_PIPE = 141


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2, no usage dump
        raise UsageError(message)


def _lengths(text: str) -> list[int]:
    """Comma-separated lengths (--seq-lens, --query-lens, --timing-seq-lens): argparse names the option."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"got {text!r}; accepted: comma-separated positive integers, e.g. 128,256,512")
    return values


def _one_per_option(option: str, example: str):
    """An option type taking one backend (a name or a spec): a comma-joined list is refused with the fix, since
    argparse would pass it whole and the registry would only say it is no name it knows."""
    def one(text: str) -> str:
        if "," in text and all(part.strip() for part in text.split(",")):
            raise argparse.ArgumentTypeError(f"got {text!r}; one backend per option: repeat {option} for several, "
                                             f"e.g. {example}")
        return text
    return one


BACKEND_NAME = _one_per_option("--backend", "--backend numpy-naive --backend jax-dpa")
BACKEND_SPEC = _one_per_option("--backend-spec", "--backend-spec my_pkg.attn:MyAttention --backend-spec "
                                                 "my_pkg.attn:Other (with --backend for registered names)")

#: range-checked option types (mha_harness.util.options): a bad value is one line naming the option, exit 2
TIMEOUT = float_range(0.0, 7 * 24 * 3600.0)
JOBS = int_range(1, 1024)
REPEATS = int_range(1, 1_000_000)
TIMING_ROUNDS = int_range(1, 1000)


def _check_inputs_fit(seq_lens, batch: int = 1, d_model: int = 512) -> None:
    """Refuse sequence lengths whose inputs alone (query, key, value, output as float64) exceed the memory
    available now: a UsageError naming --seq-lens, the bytes needed and the bytes available."""
    available = available_memory_bytes()
    if not seq_lens or available is None:
        return
    longest = max(seq_lens)
    needed = 4 * batch * longest * d_model * 8
    if needed > available:
        raise UsageError(f"--seq-lens: T={longest} needs at least {needed / 2**30:.1f} GiB for its inputs alone "
                         f"(batch {batch}, d_model {d_model}); {available / 2**30:.1f} GiB are available; "
                         "accepted: shorter sequences")


_positive_int = int_range(1)
_positive_float = float_range(0.0)  # finite and > 0: nan and inf are refused


QUICK_BUDGET_S = 1.0
BENCH_BUDGET_S = 2.0


def _add_bench_options(p: argparse.ArgumentParser, budget: float = BENCH_BUDGET_S) -> None:
    """Options shared by ``bench`` and the quick sweep of ``run``."""
    from mha_harness.bench.threads import DEFAULT_THREADS
    p.add_argument("--threads", type=_positive_int, default=DEFAULT_THREADS,
                   help=f"threads for every backend: BLAS, OpenMP/torch, XLA (default {DEFAULT_THREADS})")
    p.add_argument("--budget", type=_positive_float, default=budget, metavar="S",
                   help=f"seconds of sampling per backend and point before giving up on the CI target "
                        f"(default {budget:g}; at least 6 samples are always taken)")
    p.add_argument("--ci", type=_positive_float, default=0.03, metavar="FRACTION",
                   help="target half-width of the median's 95%% CI, relative (default 0.03)")
    p.add_argument("--bench-timeout", type=_positive_float, default=120.0, metavar="S",
                   help="seconds a backend's worker may take for one request (prepare, a turn of samples, a memory "
                        "measurement) before it is killed and the point reported as timeout; a backend that "
                        "times out is not run further (default 120)")
    p.add_argument("--max-memory", type=_positive_int, default=None, metavar="MIB",
                   help="a worker whose resident size passes this is killed, the point reported as out-of-memory "
                        "(default: 80%% of the memory available at start)")


def _bench_config(args, **overrides):
    from mha_harness.bench.sweep import BenchConfig
    values = dict(threads=args.threads, budget_s=args.budget, ci_rel=args.ci, timeout_s=args.bench_timeout,
                  max_memory_bytes=args.max_memory * 2 ** 20 if args.max_memory else None)
    values.update(overrides)
    return BenchConfig(**values)


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", default=[], metavar="NAME", type=BACKEND_NAME,
                   help="a registered backend name (repeatable); default: every available backend except "
                        "those that run only when named (see list), unless --opt-in")
    p.add_argument("--opt-in", action="store_true",
                   help="with no --backend: also run the backends that run only when named (the compiled ones: "
                        "minutes of compilation on a small machine)")
    p.add_argument("--backend-spec", action="append", default=[], metavar="MODULE:OBJECT",
                   type=BACKEND_SPEC,
                   help="load backends from 'package.module:object' (an instance, class or factory; repeatable; the "
                        "module is imported from the current folder or sys.path). With --backend-spec or --backend, "
                        "only those backends run: the spec's plus the --backend names, not the other registered ones")
    p.add_argument("--results", type=nonempty_path, default="results", metavar="DIR",
                   help="where results are written (default: results)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mha-harness", description="Conformance and benchmarks for multi-head attention backends.")
    sub = parser.add_subparsers(dest="command", metavar="{list,check,search,bench,fidelity,run}", parser_class=_Parser)

    p = sub.add_parser("list", help="every backend: available or why not, and its capabilities")
    p.add_argument("--backend-spec", action="append", default=[], metavar="MODULE:OBJECT",
                   type=BACKEND_SPEC,
                   help="list only the backends of 'package.module:object' (an instance, class or factory; "
                        "repeatable), with the reason when it fails to load; the registered ones are not listed, "
                        "as check runs only these")
    p.add_argument("--verbose", "-v", action="store_true", help="show every capability and the source")
    p.add_argument("--cases", action="store_true",
                   help="list the conformance cases instead: the built-in ones and those of installed case plugins "
                        "(what each requires, its input forms, its module), and the case plugins that failed to load")

    p = sub.add_parser("check", help="run the conformance cases (each backend in its own worker process)")
    _add_selection(p)
    p.add_argument("--case", action="append", default=[], metavar="CASE", help="run only this case (repeatable)")
    p.add_argument("--timeout", type=TIMEOUT, default=None, metavar="S",
                   help="seconds per case before the worker is killed (default 120); not with --no-isolate, where "
                        "nothing can stop a plugin that hangs")
    p.add_argument("--jobs", type=JOBS, default=None, help="backends checked at once (default: CPU count)")
    p.add_argument("--no-isolate", action="store_true",
                   help="run plugin code in this process (faster start; no crash isolation, and a plugin "
                        "that patches NumPy or the harness can change the verdict: only for code you trust)")
    p.add_argument("--quick", action="store_true", help="skip the slow cases (T = 8192)")
    p.add_argument("--mutants", action="store_true",
                   help="also compute the mutation score: the --quick cases (with --case: those cases) on every "
                        "mutant of the zoo, a few minutes")

    p = sub.add_parser("search", help="property-based search (hypothesis) for inputs a backend gets wrong; shrinks "
                                      "to a minimal runnable repro saved under results/search/")
    _add_selection(p)
    p.add_argument("--max-examples", type=int_range(1, 1_000_000), default=None,
                   help="examples per backend (default 200; 50 with --quick)")
    p.add_argument("--seed", type=int_range(0, None), default=None, help="fix hypothesis's seed (deterministic search)")
    p.add_argument("--time-budget", type=float_range(0.0, 7 * 24 * 3600.0), default=None, metavar="S",
                   help="seconds of generation per backend (shrinking a found failure is not cut short)")
    p.add_argument("--quick", action="store_true", help="a smaller space (T <= 129, batch <= 2) and fewer examples")
    p.add_argument("--timeout", type=TIMEOUT, default=60.0, metavar="S",
                   help="worker seconds per example before the worker is killed (default 60)")
    p.add_argument("--no-isolate", action="store_true", help="call the backend in this process")
    p.add_argument("--dtype", action="append", default=None, choices=("float32", "float64", "bfloat16", "float16"),
                   help="search only this dtype (repeatable; default: every dtype the backend declares)")
    p.add_argument("--no-gradients", action="store_true",
                   help="draw no gradient examples (by default a backend that declares gradients gets them)")
    p.add_argument("--mutants", action="store_true",
                   help="search the mutant zoo (every mutant, or the --backend ones) and write the table of what "
                        "was found to <results>/search/mutants.md")

    p = sub.add_parser("bench", help="time and peak memory across sequence lengths, each backend in its own worker; "
                                     "tables, JSON with confidence intervals, plots")
    _add_selection(p)
    _add_bench_options(p)
    p.add_argument("--seq-lens", type=_lengths, default=None, metavar="N,N,...",
                   help="prefill: sequence lengths (default 128,256,512,1024,2048); decode: KV lengths "
                        "(default 1024,4096,16384,65536); cross: the key/value sequence's lengths Tk (default "
                        "77,256,1024,4096)")
    p.add_argument("--workload", choices=("prefill", "decode", "cross"), default="prefill",
                   help="prefill: Tq = Tk = T (default); decode: Tq in --query-lens against KV lengths --seq-lens, "
                        "bottom-right causal (results in <results>/bench-decode); cross: cross-attention, Tq in "
                        "--query-lens queries of one sequence against --seq-lens keys and values of another (one "
                        "x_kv), unmasked, for layers that take x_q and x_kv (results in <results>/bench-cross)")
    p.add_argument("--query-lens", type=_lengths, default=None, metavar="N,N,...",
                   help="decode: new queries per call (default 1,16); cross: query lengths Tq (default 128,4096; "
                        "more queries than keys too)")
    p.add_argument("--causal", choices=("off", "on", "both"), default=None,
                   help="prefill only: off (default), on (top-left, Tq = Tk) or both; a decode step is always "
                        "bottom-right causal and cross-attention unmasked: --causal with --workload decode, or on or "
                        "both with --workload cross, is a usage error")
    p.add_argument("--backward", action="store_true", help="also time forward + backward where gradients exist")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default="float32",
                   help="the layer's dtype (default float32)")
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--d-model", type=_positive_int, default=512, help="d_model (default 512)")
    p.add_argument("--heads", type=_positive_int, default=8,
                   help="query heads (default 8); --d-model must be a multiple of it")
    p.add_argument("--bias", action="store_true",
                   help="the layer's four projections carry biases (b_q, b_k, b_v, b_o), as GPT-2's and "
                        "nn.MultiheadAttention's do; default: none. Backends that declare bias=False are skipped")
    p.add_argument("--kv-heads", type=_positive_int, default=None, metavar="N",
                   help="key/value heads (grouped-query attention): N divides --heads, 1 <= N <= --heads; default: "
                        "as many as --heads (multi-head). Backends that do not declare grouped_query are skipped")
    from mha_harness.contract.conventions import (
        ALIBI_KINDS,
        DEFAULT_QK_NORM_EPS,
        DEFAULT_ROTARY_BASE,
        QK_NORMS,
        ROTARY_KINDS,
    )
    p.add_argument("--rotary", choices=ROTARY_KINDS, default=None,
                   help="time a layer with rotary embeddings on q and k (half_split: Llama's rotate_half; interleaved: "
                        "GPT-J's), base --rotary-base, key j at position j and query i at i + Tk - Tq; default: none. "
                        "Backends that do not declare it (capabilities.rotary) are skipped")
    p.add_argument("--rotary-base", type=float_range(1.0), default=DEFAULT_ROTARY_BASE, metavar="BASE",
                   help="the base of --rotary's frequencies (pair i turns by position * BASE ** (-2i / d_head)): "
                        "500000 for Llama 3, 1000000 for Qwen 2 and 3; default: 10000 (Llama 2)")
    p.add_argument("--qk-norm", choices=QK_NORMS, default=None,
                   help="time a layer that normalises q and k after their projections (rms_per_head: Qwen 3's, "
                        "Gemma 3's); default: none. Backends that do not declare it (capabilities.qk_norms) are "
                        "skipped")
    p.add_argument("--qk-norm-eps", type=float_range(0.0, exclusive_min=False), default=DEFAULT_QK_NORM_EPS,
                   metavar="EPS", help="the epsilon of --qk-norm's norm (added to the mean square, or the variance, "
                                       "inside its square root): default 1e-6 (Qwen 3's, flax's); torch's "
                                       "nn.LayerNorm defaults to 1e-5")
    p.add_argument("--sliding-window", type=_positive_int, default=None, metavar="W",
                   help="time a layer whose query at position p sees only the keys after p - W (Mistral's, Gemma's "
                        "sliding_window); default: every key. Backends that do not declare sliding_window are skipped")
    p.add_argument("--alibi", choices=ALIBI_KINDS, default=None,
                   help="time a layer whose scores are biased by distance (linear: BLOOM's -m (p - s); symmetric: "
                        "flash-attn's and MPT's -m |p - s|), with the paper's slopes; default: none. Backends that do "
                        "not declare that kind (capabilities.alibi) are skipped")

    p = sub.add_parser("fidelity", help="figures proving the benchmarks: timing against torch.utils.benchmark, "
                                        "alone vs in the sweep, memory methods against formulas, harness overhead")
    p.add_argument("--results", type=nonempty_path, default="results", metavar="DIR")
    p.add_argument("--backend", action="append", default=[], metavar="NAME", type=BACKEND_NAME,
                   help="CPU backends whose timing (and, where they offer direct_callable, overhead) is checked "
                        "(default: every available CPU backend except the opt-in ones)")
    p.add_argument("--backend-spec", action="append", default=[], metavar="MODULE:OBJECT",
                   type=BACKEND_SPEC,
                   help="also check the backends of a plugin that is not installed, as check and bench take it "
                        "(with --backend-spec or --backend, only those)")
    p.add_argument("--opt-in", action="store_true", help="with no --backend: also the backends that run only when "
                                                          "named")
    p.add_argument("--threads", type=_positive_int, default=None, help="threads for every backend (default: "
                                                                     "the bench default)")
    p.add_argument("--timing-seq-lens", type=_lengths, default=None,
                   metavar="N,N,...", help="the timing section's lengths (default: 512,2048)")
    p.add_argument("--timing-rounds", type=TIMING_ROUNDS, default=None, metavar="N",
                   help="the timing section's rounds at each length (default: 12; a backend whose ratio's 95%% CI "
                        "is wider than +-5%% gets more, up to 3N). Fewer rounds: a shorter run, wider CIs")
    p.add_argument("--section", action="append", default=None, metavar="NAME",
                   help="run only this section (repeatable; default: all, in this order): memory (the memory "
                        "methods against formulas and XLA), overhead (prepared callable vs the library called "
                        "directly), tiled-vs-naive, timing (the sweep against adaptive_autorange and alone: the "
                        "one that covers a plugin's own backend)")

    p = sub.add_parser("run", help="the main job: conformance of every available backend, mutation score and a "
                                   "quick benchmark sweep, written under results/")
    _add_selection(p)
    p.add_argument("--timeout", type=TIMEOUT, default=None, metavar="S",
                   help="seconds per conformance case before the worker is killed (default 120)")
    p.add_argument("--jobs", type=JOBS, default=None, help="backends checked at once (default: CPU count)")
    p.add_argument("--seq-lens", type=_lengths, default=None, metavar="N,N,...")
    p.add_argument("--skip-bench", action="store_true", help="conformance and mutation score only")
    _add_bench_options(p, budget=QUICK_BUDGET_S)
    return parser


def _usage(fn, *args, **kwargs):
    """Run a resolution step; its ValueError/TypeError is the user's mistake (exit 2), not a crash."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _registry(specs):
    import os

    from mha_harness.registry import load_registry
    if specs and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # module:object resolves from the working directory, as with python -m
    return _usage(load_registry, specs)


def _targets(args, registry):
    """Names to run: --backend names, else the --backend-spec backends, else every registered one.

    Sources that failed to load are included (reported as load errors, which fail the run)."""
    if args.backend or args.backend_spec:
        names = list(args.backend) + [e.name for e in registry.entries.values()
                                      if e.spec in args.backend_spec and e.name not in args.backend]
    elif getattr(args, "opt_in", False):
        names = list(registry.entries)
    else:
        names = [e.name for e in registry.by_default()]
        _say_opted_out(registry)
    if args.backend:
        for name in names:
            entry = _usage(registry.get, name)  # unknown names are usage errors
            reason = entry.reason_unavailable
            if reason and entry.error is None:
                raise UsageError(f"--backend {name}: not available here: {reason}")
    return names


def opt_in_reason(entry) -> str | None:
    from mha_harness.registry import opt_in_reason as reason
    return reason(entry)


def _say_opted_out(registry) -> None:
    """One line per available backend that a run naming no backend leaves out (``opt_in``), with its reason."""
    for entry in registry.opted_out():
        print(f"  not run unless named: {entry.name} ({opt_in_reason(entry)}; --backend {entry.name})")


def _list_cases() -> int:
    """``list --cases``: every registered case, one line each, then the case plugins that failed to load (exit 1)."""
    from mha_harness.conformance.casekit import BUILTIN_CASES, all_cases, case_plugin_errors
    cases = all_cases()
    width = max(len(name) for name in cases)
    for name, c in cases.items():
        origin = c.func.__module__
        facts = [f"requires {', '.join(c.requires)}" if c.requires else "requires nothing",
                 f"forms {', '.join(c.forms)}"] + (["slow (not in --quick)"] if c.slow else []) \
            + ([] if origin.startswith(BUILTIN_CASES + ".") else [f"from {origin}"])
        print(f"{name:<{width}}  {'; '.join(facts)}")
    errors = case_plugin_errors()
    for module, why in errors.items():
        print(f"case plugin {module}: {why} (its cases are not listed and do not run)", file=sys.stderr)
    return EXIT_FAILED if errors else EXIT_OK


def cmd_list(args) -> int:
    if args.cases:
        if args.backend_spec or args.verbose:
            raise UsageError("--cases: lists cases, not backends; accepted: mha-harness list --cases alone")
        return _list_cases()
    from mha_harness.conformance.runner import divergence_problems
    from mha_harness.contract.score_scale import score_scale_label
    registry = _registry(args.backend_spec)
    # the backends check/search/bench would run with the same options: with --backend-spec, only the spec's
    entries = [e for e in registry.entries.values() if not args.backend_spec or e.spec in args.backend_spec]
    width = max(len(e.name) for e in entries)
    refused = {}  # what check would refuse at load, as it does: divergences naming unknown cases or 'when' keys
    for entry in entries:
        reason = entry.reason_unavailable
        problems = divergence_problems(entry.backend) if entry.backend is not None and reason is None else []
        if problems:
            refused[entry.name] = reason = "declared divergences refused: " + "; ".join(problems)
        status = "available" if reason is None else f"unavailable: {reason}"
        if reason is None and opt_in_reason(entry):
            status += f"; runs only when named (--backend {entry.name}): {opt_in_reason(entry)}"
        print(f"{entry.name:<{width}}  {status}")
        if entry.backend is not None:
            caps = entry.backend.capabilities
            flags = [f for f in ("key_padding_mask", "bool_attn_mask", "additive_attn_mask", "cross_attention",
                                 "attention_weights", "gradients", "grouped_query", "bias") if caps.has(f)]
            if caps.cross_attention and not caps.more_queries_than_keys:
                flags[flags.index("cross_attention")] = "cross_attention (Tq <= Tk only)"
            causal = ("always " if caps.always_causal else "") + ("/".join(caps.causal_alignments) or "none")
            parts = [f"inputs {caps.inputs}", f"dtypes {','.join(caps.dtypes)}", f"devices {','.join(caps.devices)}",
                     f"causal {causal}"] + ([", ".join(flags)] if flags else [])
            if getattr(caps, "score_scale", None) is not None:
                parts.append(f"scores scaled by {score_scale_label(caps.score_scale)}")
            if getattr(caps, "logit_softcap", None) is not None:
                parts.append(f"scores soft-capped at {caps.logit_softcap:g}")
            if getattr(caps, "qk_norms", ()):
                parts.append(f"q/k norms {','.join(caps.qk_norms)}")
            if getattr(caps, "d_head_multiple", 1) > 1:
                parts.append(f"d_head a multiple of {caps.d_head_multiple}")
            if getattr(caps, "rotary", ()):
                parts.append(f"rotary {','.join(caps.rotary)}"
                             + (" (partial too)" if getattr(caps, "partial_rotary", False) else "")
                             + (f" rescaled {','.join(caps.rotary_scalings)}"
                                if getattr(caps, "rotary_scalings", ()) else ""))
            if getattr(caps, "sliding_window", False):
                parts.append("sliding window")
            if getattr(caps, "alibi", ()):
                parts.append(f"ALiBi {','.join(caps.alibi)}")
            if getattr(caps, "max_seq_len", None) is not None:  # what check and bench skip beyond
                parts.append(f"sequences up to {caps.max_seq_len} positions (max_seq_len)")
            if not getattr(caps, "native_parameters", True):
                parts.append("no native parameter shapes (the parameter count case skips)")
            print(f"{'':<{width}}  " + "; ".join(parts))
            divergences = entry.backend.divergences
            if args.verbose:
                print(f"{'':<{width}}  source: {entry.source}; divergences declared: {len(divergences)}")
                for d in divergences:
                    when = f" when {d.when}" if d.when else ""
                    print(f"{'':<{width}}    {d.case}: {d.behaviour}{when} ({d.reason})")
    if args.backend_spec:
        print(f"({len(registry.entries) - len(entries)} registered backends not listed: mha-harness list)")
        broken = [e.name for e in entries if e.error or e.name in refused]  # import, construction or
        # availability() failed, or check would refuse its declarations
        if broken:  # a spec that does not load is an error of the command, as for check and bench
            print(f"mha-harness list: {len(broken)} --backend-spec backend(s) failed to load"
                  f"{' or declare divergences check refuses' if refused else ''}: {', '.join(broken)}",
                  file=sys.stderr)
            return EXIT_FAILED
    return EXIT_OK


#: a progress line of the mutation score after every this many mutants
MUTANTS_PER_PROGRESS_LINE = 16

#: how many variants repeating a message already printed whole get a line of their own
REPEATS_SHOWN = 3


class ProgressLines:
    """Prints each failing variant as it finishes: its message (a message this case already printed for the backend
    is one short line naming that variant, and so is a failure whose diagnosis a variant of this backend already
    printed: an outside user's undeclared T5 scale printed 110 failures in 773 lines), one repro per case, backend
    and diagnosis (a second mistake in one case printed its message without one: an outside user's Qwen 3 layer);
    one line for a backend's abandoned remainder."""

    def __init__(self, out=None):
        self.out = out
        self.abandoned: set[str] = set()
        self.shown_repro: set[tuple] = set()  # (backend, case, diagnosis) whose repro was shown
        self.first_with: dict[tuple, str] = {}  # (backend, case, status, message) -> the variant that printed it
        self.diagnosed_by: dict[tuple, str] = {}  # (backend, diagnosis) -> the variant that printed it in full
        # (backend, status, message) -> the case[variant] that printed it: a load error repeats in every case (an
        # outside user's plugin that raised in load printed 28 errors and 28 repro lines)
        self.first_anywhere: dict[tuple, str] = {}
        self.repeats: dict[tuple, int] = {}  # (backend, status, message) -> short lines printed for it

    def say(self, text: str) -> None:
        print(text, file=self.out or sys.stdout, flush=True)

    def __call__(self, result) -> None:
        from mha_harness.conformance.results import ABANDONED
        from mha_harness.conformance.runner import under_declaration
        if result.status in ("passed", "skipped", "expected-divergence"):
            return
        if result.observed == ABANDONED:  # each abandoned variant is in the JSON
            if result.backend not in self.abandoned:
                self.abandoned.add(result.backend)
                self.say(f"  {result.status.upper():<8} {result.backend}: {result.message}")
            return
        key = (result.backend, result.case)
        same = self.first_with.setdefault((*key, result.status, result.message), result.variant)
        diagnosis = result.extra.get("diagnosis") or ""
        this = f"{result.case}[{result.variant}]"  # variant ids repeat across cases: the other one is named whole
        first = self.diagnosed_by.setdefault((result.backend, diagnosis), this) if diagnosis else None
        said = (result.backend, result.status, result.message)
        anywhere = self.first_anywhere.setdefault(said, this)
        if anywhere != this:  # printed whole before: a few short lines, then one saying the rest are in the report
            self.repeats[said] = self.repeats.get(said, 0) + 1
            if self.repeats[said] > REPEATS_SHOWN:
                if self.repeats[said] == REPEATS_SHOWN + 1:
                    self.say(f"  {result.status.upper():<8} {result.backend}: more variants with the same message "
                             f"as {anywhere} (not printed; each is in the report)")
                return
            if same == result.variant:  # printed whole for another case: one short line, no repro either
                self.say(f"  {result.status.upper():<8} {this}: the same message as {anywhere}")
                return
        if same != result.variant:
            self.say(f"  {result.status.upper():<8} {result.case}[{result.variant}]: the same message as [{same}]")
        elif first is not None and first != this and diagnosis in result.message:
            error = "" if result.max_error is None else f"max error {result.max_error:.3g}; "
            self.say(f"  {result.status.upper():<8} {this}: {under_declaration(result.message)}{error}the same "
                     f"diagnosis as {first} (the full message is in the report)")
        else:
            self.say(console_message(f"  {result.status.upper():<8} {result.case}[{result.variant}]: ",
                                     result.message))
        if result.repro and (*key, diagnosis) not in self.shown_repro:
            self.shown_repro.add((*key, diagnosis))
            self.say(f"           repro: {result.repro}")


def _check(args, registry, results_dir: Path, *, cases=None, include_slow=True, mutants=False):
    import os

    from mha_harness.checking import check
    from mha_harness.conformance.mutation import mutation_score
    from mha_harness.conformance.search_examples import SEARCH_DIR_ENV, search_dir
    _usage(check_writable, results_dir / "conformance", "--results")
    os.environ[SEARCH_DIR_ENV] = str(search_dir(results_dir))  # the search regressions check replays (workers inherit)
    names = _targets(args, registry)
    start = time.perf_counter()
    partial = {}

    writing, interrupted = threading.Lock(), threading.Event()

    def write_partial(backend_name, results):  # every finished backend is on disk, complete or not
        with writing:  # never two at once, and none after an interruption (the process may exit mid-write)
            if interrupted.is_set():
                return
            partial[backend_name] = results
            report = _assemble(registry, names, partial, start)
            report.complete = False
            report.write(results_dir / "conformance")

    progress = ProgressLines()

    isolate = not getattr(args, "no_isolate", False)
    if not isolate and args.timeout is not None:  # before anything runs: it could not be honoured
        raise UsageError(f"--timeout: got {args.timeout:g} with --no-isolate; accepted: leave it out, or drop "
                         "--no-isolate (a per-case timeout kills the backend's worker process; in this process "
                         "nothing can stop a plugin that hangs)")
    runnable = [n for n in names if registry.get(n).backend is not None]
    try:
        report = check(runnable, cases=cases or None, isolate=isolate,
                       timeout=args.timeout, jobs=args.jobs, include_slow=include_slow, registry=registry,
                       progress=progress, on_backend_done=write_partial)
    except KeyboardInterrupt:
        with writing:  # a write in progress in a backend's thread finishes first; later ones are skipped
            interrupted.set()
        raise
    from mha_harness.conformance.report import entry_info
    for name in names:  # sources that failed to load were not run; they are reported as load errors
        report.backends.setdefault(name, entry_info(registry.get(name)))
    if mutants:
        print("computing the mutation score" + (f" of the cases asked for ({', '.join(cases)})" if cases else "")
              + " ...", flush=True)
        from mha_harness.implementations.mutants import mutant_backends

        def said(done: int, total: int, caught: int) -> None:
            if done % MUTANTS_PER_PROGRESS_LINE == 0 or done == total:
                print(f"  mutants: {done}/{total} run, {caught} caught", flush=True)
        report.mutation = mutation_score(mutant_backends(), cases=cases or None, progress=said)
    report.seconds = time.perf_counter() - start
    paths = report.write(results_dir / "conformance")
    print(f"\nconformance ({report.seconds:.1f} s checking, {time.perf_counter() - _COMMAND_START[0]:.1f} s since "
          "the command started):")
    print("\n".join(report.summary_lines()))
    if report.mutation:
        m = report.mutation
        print(f"  mutation score: {m['caught']}/{m['total']} mutants caught"
              + (f" by the cases asked for ({', '.join(m['cases'])})" if m.get("cases") else ""))
    print(f"  report: {paths['markdown']}  json: {paths['json']}")
    if any(r.status == "skipped" for r in report.results):
        print(f"  skip reasons: the 'Skipped' section of {paths['markdown']} (grouped, with counts); each "
              "variant's in the JSON's results[].message")
    return report


#: the most of one failure message the console shows (wrapped); the full text is in conformance.json/.md
CONSOLE_MESSAGE_CHARS = 1200


def console_message(head: str, message: str, width: int = 110) -> str:
    """``head`` + ``message`` wrapped into indented lines, whole up to CONSOLE_MESSAGE_CHARS: the diagnosis at the
    end of a long failure message ("the output matches scores scaled by 1/d_head ...") is never cut off."""
    import textwrap
    text = " ".join(message.split())
    if len(text) > CONSOLE_MESSAGE_CHARS:
        text = text[:CONSOLE_MESSAGE_CHARS] + " ... (cut; the whole message is in conformance.md)"
    return textwrap.fill(text, width=width, initial_indent=head, subsequent_indent=" " * 11,
                         break_long_words=False, break_on_hyphens=False)


def _assemble(registry, names, partial, start):
    from mha_harness.conformance.report import Report, entry_info
    report = Report(seconds=time.perf_counter() - start)
    for name in names:
        report.backends[name] = entry_info(registry.get(name))
        report.results += partial.get(name, [])
    return report


def _start_workers_early(args) -> None:
    """With isolated workers: start their fork server before the registry loads, so the frameworks it preloads
    import beside the registry's availability checks (which import them too) rather than after them."""
    if not getattr(args, "no_isolate", False):
        from mha_harness.conformance.isolation import start_worker_server
        start_worker_server()


def cmd_check(args) -> int:
    _start_workers_early(args)
    registry = _registry(args.backend_spec)
    from mha_harness.conformance.runner import select_cases
    _usage(select_cases, args.case or None)  # unknown case names are usage errors, before any work
    report = _check(args, registry, Path(args.results), cases=args.case, include_slow=not args.quick,
                    mutants=args.mutants)
    return EXIT_OK if report.ok else EXIT_FAILED


def _available_backends(registry, names):
    return [registry.get(n).backend for n in names if registry.get(n).available]


def _worker_payloads(registry, backends) -> dict:
    """How each backend's bench worker rebuilds it: from its ``module:object`` spec, as check's workers do (a
    plugin's factory-made classes need not pickle); None (pickled) for a backend given as an object."""
    from mha_harness.checking import target_of
    out = {}
    for backend in backends:
        target = target_of(registry.get(backend.name))
        if target.spec and target.load_spec is not None:
            out[backend.name] = target.payload()
    return out


def cmd_search(args) -> int:
    from mha_harness.checking import target_of
    from mha_harness.conformance.search import (
        DEFAULT_MAX_EXAMPLES,
        MUTANT_SPEC,
        QUICK_MAX_EXAMPLES,
        mutant_table,
        run_search,
    )
    _require("hypothesis", "search")
    mutants = args.mutants or any(n.startswith("mutant-") for n in args.backend)
    _start_workers_early(args)
    registry = _registry(list(args.backend_spec) + ([MUTANT_SPEC] if mutants else []))
    if args.mutants and not args.backend:
        names = [e.name for e in registry.entries.values() if e.spec == MUTANT_SPEC]
    elif args.backend or args.backend_spec:
        names = _targets(args, registry)
    else:
        names = [e.name for e in registry.available()
                 if e.spec != MUTANT_SPEC and (args.opt_in or opt_in_reason(e) is None)]
        if not args.opt_in:
            _say_opted_out(registry)
    results = Path(args.results)
    _usage(check_writable, results / "search", "--results")
    targets = []
    for name in names:
        entry = registry.get(name)
        if entry.backend is None or not entry.available:
            raise UsageError(f"--backend {name}: not available here: {entry.reason_unavailable}")
        targets.append(target_of(entry))
    from mha_harness.conformance.strategies import SearchSpace
    dtypes = tuple(args.dtype) if args.dtype else None
    for target in targets:  # a --dtype no backend declares is the user's mistake, before any search runs
        _usage(SearchSpace.for_backend, target.backend, dtypes=dtypes)
    outcomes = run_search(targets, max_examples=args.max_examples or (QUICK_MAX_EXAMPLES if args.quick
                                                                       else DEFAULT_MAX_EXAMPLES),
                          seed=args.seed, time_budget=args.time_budget, quick=args.quick, results=results,
                          isolate=not args.no_isolate, timeout=args.timeout,
                          dtypes=dtypes, gradients=not args.no_gradients)
    if args.mutants:
        from mha_harness.implementations.mutants import MUTANTS
        from mha_harness.util.atomic import write_text_atomic
        table = mutant_table(outcomes, {m.name: m.bug for m in MUTANTS})
        command = "mha-harness " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["search"] else "mha-harness search"
        path = write_text_atomic(results / "search" / "mutants.md", f"Produced by `{command}`\n\n{table}\n")
        found = sum(not o.passed for o in outcomes)
        print(f"\n{table}\n\nmutants found: {found}/{len(outcomes)}; table: {path}")
        return EXIT_OK if found == len(outcomes) else EXIT_FAILED
    return EXIT_OK if all(o.passed for o in outcomes) else EXIT_FAILED


def cmd_bench(args) -> int:
    from mha_harness.bench.sweep import kv_heads_error, results_folder, run_bench
    kv_error = kv_heads_error(args.kv_heads, args.heads, "--kv-heads", "--heads")
    if kv_error:  # before anything loads: a usage error, naming the option and the values it accepts
        raise UsageError(kv_error)
    if args.workload == "decode" and args.causal is not None:  # it would be ignored: say so before anything runs
        raise UsageError(f"--causal: got {args.causal!r} with --workload decode; accepted: leave it out (a decode step "
                         "is always bottom-right causal: its new queries are the last positions and see every "
                         "cached key)")
    if args.workload == "cross" and args.causal not in (None, "off"):  # off is what it does: a script may say so
        raise UsageError(f"--causal: got {args.causal!r} with --workload cross; accepted: off or leave it out "
                         "(cross-attention is unmasked: the queries' sequence and the keys' are two, with no "
                         "positions in common for a causal mask to order)")
    if args.workload == "prefill" and args.query_lens is not None:  # ignored otherwise: prefill times Tq = Tk = T
        raise UsageError(f"--query-lens: got {','.join(map(str, args.query_lens))} with --workload prefill; accepted: "
                         "leave it out (prefill times Tq = Tk = T), or --workload decode (Tq new queries against "
                         "a cache of --seq-lens keys) or cross (Tq queries against --seq-lens keys of another "
                         "sequence)")
    args.causal = args.causal or "off"
    _check_inputs_fit(args.seq_lens, args.batch, args.d_model)
    registry = _registry(args.backend_spec)
    names = _targets(args, registry)
    _usage(check_writable, Path(args.results) / results_folder(args.workload), "--results")
    _require("matplotlib", "bench")
    _require("scipy", "bench")
    config = _usage(_bench_config, args, dtype=args.dtype, workload=args.workload, batch=args.batch,
                    d_model=args.d_model, num_heads=args.heads, num_kv_heads=args.kv_heads, bias=args.bias,
                    rotary=args.rotary, rotary_base=args.rotary_base, qk_norm=args.qk_norm,
                    qk_norm_eps=args.qk_norm_eps, sliding_window=args.sliding_window, alibi=args.alibi)
    if args.d_model % args.heads:
        divisors = [n for n in range(1, args.d_model + 1) if args.d_model % n == 0]
        raise UsageError(f"--heads: got {args.heads}, which does not divide --d-model {args.d_model}; accepted: a "
                         f"divisor of --d-model ({', '.join(map(str, divisors))}), or a --d-model that is a "
                         f"multiple of {args.heads}")
    feature_error = config.features_error()
    if feature_error:  # e.g. rotary embeddings on an odd d_head: named by its option, before anything runs
        field_name, colon, rest = feature_error.partition(":")
        if colon and field_name in ("rotary", "rotary_base", "qk_norm", "qk_norm_eps", "sliding_window", "alibi"):
            feature_error = f"--{field_name.replace('_', '-')}:{rest}"  # each field's option is its name so spelt
        feature_error = feature_error.replace("or rotary=None", "or no --rotary")  # the API's words, on a command line
        raise UsageError(feature_error)
    backends = _available_backends(registry, names)
    doc = run_bench(backends, Path(args.results), seq_lens=args.seq_lens, causal=args.causal, backward=args.backward,
                    config=config, query_lens=args.query_lens,
                    payloads=_worker_payloads(registry, backends)) if backends else {}
    explicit = bool(args.backend or args.backend_spec)  # asked for by name: measuring none of its points is a failure
    return _bench_verdict(_not_loaded(registry, names), doc, explicit)


def _not_loaded(registry, names) -> list[str]:
    """Requested sources whose plugin code failed to load (they are not benchmarked): one line each."""
    return [f"{name}: {registry.get(name).error}" for name in names if registry.get(name).error]


def _points_by_backend(doc: dict) -> dict[str, list[dict]]:
    """The sweep's points grouped by backend, in the order they appear."""
    points: dict[str, list[dict]] = {}
    for point in doc.get("points", []):
        points.setdefault(point["backend"], []).append(point)
    return points


def _bench_problems(doc: dict) -> list[str]:
    """One line per backend with points that were neither measured nor skipped as unsupported (timeout, crash,
    out of memory, error, not run after losses), or whose memory measurement failed."""
    lines = []
    for name, mine in _points_by_backend(doc).items():
        lost = [p for p in mine if p.get("status") not in ("measured", "skipped")]
        # timed, but the memory pass failed: the table shows n/a for its memory
        no_memory = [p for p in mine if p.get("status") == "measured" and p.get("memory_error")]
        for points, what, why in ((lost, "not measured",
                                   lambda p: clipped(f"{p.get('status')}: {p.get('skipped') or ''}", 200)),
                                  (no_memory, "timed but without a memory reading",
                                   lambda p: f"memory pass {clipped(p['memory_error'], 200)}")):
            if points:
                first = points[0]
                mask = first.get("call_mask") or ("causal" if first.get("causal") else "none")
                lines.append(f"{name}: {len(points)} point(s) {what} (first: Tq={first.get('tq')} "
                             f"Tk={first.get('tk')} {first.get('mode')}, mask {mask}: {why(first)})")
    return lines


def _skip_hint(why: str, workload: str = "prefill") -> str:
    """What to do about a backend whose every point of a ``workload`` sweep was skipped for ``why``, where the
    command line can help."""
    if "always causal" in why:
        if workload == "cross":
            return ("; cross-attention is unmasked: an always-causal layer runs the prefill workload with --causal on, "
                    "or decode")
        return "; pass --causal on (or both)"
    if workload == "cross" and "cross-attention" in why:  # a one-x or KV-cache layer, or no cross_attention
        return ("; the cross workload times a layer that takes x_q and x_kv of another sequence (inputs='separate' or "
                "'shared_kv', cross_attention=True: an encoder-decoder's cross-attention block); time this layer "
                "with --workload prefill (or decode, with a decode step)")
    if "inputs='self'" in why:
        return ("; a layer called as module(x) runs the prefill workload (Tq = Tk; --causal on for a causal layer); "
                "for decode, a second backend with a decode step (LoadedAttention.prepare_decode_step: fill the "
                "cache untimed, return the step) around the model's KV-cache step (inputs='kv_cache': "
                "layer(x_new, cache)) or around the layer as one that takes x_q and x_kv (inputs='shared_kv')")
    if "no decode step" in why:
        return ("; implement LoadedAttention.prepare_decode_step (docs/plugins.md, 'A decode step'): the decode "
                "workload times a step over a cache filled before it")
    if "grouped_query" in why:
        return "; leave out --kv-heads (multi-head), or declare grouped_query if the backend supports it"
    if "no biases" in why:
        return "; leave out --bias, or declare bias=True if the backend's layer takes biases"
    for option, capability in (("--rotary", "rotary"), ("--qk-norm", "qk_norms"),
                               ("--sliding-window", "sliding_window"), ("--alibi", "alibi")):
        if f"{option} times" in why:
            return f"; leave out {option}, or declare {capability} if the backend's layer can be built with it"
    return ""


def _nothing_measured(doc: dict) -> list[str]:
    """One line per backend none of whose points was measured, every one skipped as unsupported, with the first
    reason and what to do about it where the command line can help (an always-causal layer at the default --causal
    off, a one-x layer under --workload decode, a multi-head-only backend under --kv-heads)."""
    lines = []
    for name, mine in _points_by_backend(doc).items():
        if all(p.get("status") == "skipped" for p in mine):
            why = mine[0].get("skipped") or "unsupported"
            lines.append(f"{name}: no point measured, all {len(mine)} skipped "
                         f"(first: {clipped(why, 300)}){_skip_hint(why, doc.get('workload', 'prefill'))}")
    return lines


def _bench_verdict(not_loaded: list[str], doc: dict, explicit: bool = False) -> int:
    """Exit 0 only when every requested backend loaded and every point was measured (or is unsupported), and each
    backend requested by name (``explicit``) had at least one point measured."""
    problems = not_loaded + _bench_problems(doc) + (_nothing_measured(doc) if explicit else [])
    if not doc:
        problems.append("nothing was benchmarked: no requested backend is available")
    if problems:
        print("\nmha-harness bench: not every requested backend was measured:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_fidelity(args) -> int:
    from mha_harness.bench.fidelity import SECTIONS, run_fidelity
    for name in args.section or ():
        if name not in SECTIONS:
            raise UsageError(f"--section: got {name!r}; accepted: {', '.join(SECTIONS)}")
    from mha_harness.bench.threads import DEFAULT_THREADS
    registry = _registry(args.backend_spec)
    _usage(check_writable, Path(args.results) / "bench", "--results")
    _require("scipy", "bench")
    named = bool(args.backend or args.backend_spec)
    if named:  # the --backend names and the specs' backends, as the other commands take them
        names = _targets(args, registry)
        for name in names:
            reason = registry.get(name).reason_unavailable
            if reason:
                raise UsageError(f"{name}: not available here: {reason}")
    else:  # every available CPU backend
        names = [e.name for e in registry.available()
                 if e.backend.device == "cpu" and (args.opt_in or opt_in_reason(e) is None)]
        if not args.opt_in:
            _say_opted_out(registry)
    doc = run_fidelity(registry, names, Path(args.results), threads=args.threads or DEFAULT_THREADS,
                       overhead_names=names if named else None, sections=args.section,
                       timing_seq_lens=args.timing_seq_lens, timing_rounds=args.timing_rounds,
                       payloads=_worker_payloads(registry, _available_backends(registry, names)))
    return _fidelity_verdict(doc, names, args.section, named)


def _fidelity_verdict(doc: dict, names, sections, named: bool) -> int:
    """Exit 1 when a section the user asked for (``--section``; without it, timing for backends named by --backend
    or --backend-spec: the section that covers them) compared nothing for a requested backend, saying so on stderr;
    else 0 (comparisons outside their targets are figures, not failures)."""
    from mha_harness.bench.fidelity import SECTIONS, nothing_compared
    asked = [n for n in SECTIONS if n in (sections or (["timing"] if named else []))]
    lines = nothing_compared(doc, names, asked, overhead_names=names if named else None)
    if lines:
        print("\nmha-harness fidelity: a section you asked for compared nothing for a requested backend:",
              file=sys.stderr)
        for line in lines:
            print(f"  {line}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_run(args) -> int:
    _check_inputs_fit(args.seq_lens)
    _start_workers_early(args)
    registry = _registry(args.backend_spec)
    results = Path(args.results)
    report = _check(args, registry, results, include_slow=True, mutants=True)
    bench_ok = True
    if not args.skip_bench:
        from mha_harness.bench.sweep import run_bench
        _require("scipy", "bench")
        lost = {r.backend for r in report.results if r.status in ("crashed", "timeout", "error")}
        names = [n for n, info in report.backends.items() if info.available and n not in lost]
        for name in sorted(lost):  # a backend that failed this way in conformance is not worth a benchmark
            print(f"  not benchmarked: {name} (errors, crashes or timeouts in conformance)")
        backends = _available_backends(registry, names)
        if backends:
            doc = run_bench(backends, results, seq_lens=args.seq_lens, causal="off", backward=False, quick=True,
                            config=_bench_config(args), payloads=_worker_payloads(registry, backends))
            bench_ok = _bench_verdict([], doc) == EXIT_OK
        else:
            print("  benchmark skipped: no backend left to benchmark")
    print(f"\nmha-harness run: conformance {'OK' if report.ok else 'FAILED'}"
          f"{'' if bench_ok else '; benchmark incomplete'}; results under {results}/")
    return EXIT_OK if report.ok and bench_ok else EXIT_FAILED


def _require(module: str, extra: str) -> None:
    import importlib.util
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{module} is not installed; it is needed here ({install_hint(extra)})")


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    """The command. Called without ``argv`` it is the whole program (``mha-harness``, ``python -m mha_harness``):
    then processes that plugin code started and left running are killed when it ends
    (:mod:`mha_harness.util.reaper`); called with ``argv`` (tests, embedding) the caller's children are left alone."""
    if argv is not None:
        return _main(argv)
    from mha_harness.util import reaper
    reaper.become_subreaper()
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader left early (`mha-harness list | head`): end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
        return EXIT_BROKEN_PIPE
    finally:
        left = reaper.kill_leftovers()
        if left:
            print(f"mha-harness: killed {len(left)} process(es) that plugin code started and left running "
                  f"(pid {', '.join(map(str, left))})", file=sys.stderr)


#: when this command started (perf_counter): the wall time printed includes loading the registry and the workers
_COMMAND_START = [time.perf_counter()]


def _main(argv) -> int:
    _COMMAND_START[0] = time.perf_counter()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return EXIT_USAGE
        signal.signal(signal.SIGTERM, _sigterm)
        command = {"list": cmd_list, "check": cmd_check, "search": cmd_search, "bench": cmd_bench,
                   "fidelity": cmd_fidelity, "run": cmd_run}[args.command]
        try:
            return command(args)
        except SystemExit as exc:  # only plugin code calls sys.exit inside a command: never its exit code
            print(f"mha-harness: error: plugin code called sys.exit({exc.code!r}) in this process; "
                  "the run is incomplete", file=sys.stderr)
            return EXIT_FAILED
    except UsageError as exc:
        print(f"mha-harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:  # a missing optional dependency
        print(f"mha-harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mha-harness: interrupted; every results file written before it is whole on disk", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
