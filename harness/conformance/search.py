"""``mha-harness search``: property-based search for inputs on which a backend breaks the contract.

Hypothesis draws examples from the backend's declared input space (:mod:`mha_harness.conformance.strategies`),
checks each against the float64 reference, the mask/leakage invariants, gradients, bad input and parameter count
(:func:`mha_harness.conformance.search_examples.check_example`), and on failure shrinks to a minimal example,
prints it as a shell-safe one-line repro and saves it as a regression case that ``mha-harness check`` replays
(``check_search_regressions_still_pass``).

The hypothesis loop and every comparison run in this process; the backend's own calls (load, forward, vjp,
native_parameter_shapes) run in its worker process (:class:`RemoteBackend`, pebble) with a per-call timeout, so a
plugin that crashes or hangs is a finding, not the end of the run. ``seed`` makes the search deterministic;
hypothesis's example database under ``<results>/search/.hypothesis/<backend>/`` replays earlier failures first.
"""
from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mha_harness.conformance.casekit import CaseFailure, CaseSkipped
from mha_harness.conformance.isolation import Target, _backend_in_worker
from mha_harness.conformance.search_examples import check_example, example_id, repro_line, save_regression, search_dir
from mha_harness.contract.api import AttentionConfig, Unsupported

MUTANT_SPEC = "mha_harness.implementations.mutants:mutant_backends"
DEFAULT_MAX_EXAMPLES = 200
QUICK_MAX_EXAMPLES = 50


# --- the backend's calls in its worker process ---------------------------------------------------------------------
_WORKER_LOADED: dict = {}


def _call_in_worker(payload, op: str, *args):
    backend = _backend_in_worker(payload)
    if op == "start":  # the worker has imported the backend's framework and built it
        return backend.name
    if op == "shapes":
        return backend.native_parameter_shapes(args[0])
    params, dtype, token = args[:3]
    if _WORKER_LOADED.get("token") != token:
        _WORKER_LOADED.clear()
        _WORKER_LOADED.update(token=token, loaded=backend.load(params, dtype=dtype))
    loaded = _WORKER_LOADED["loaded"]
    if op == "forward":
        return loaded.forward(args[3], need_weights=args[4])
    return loaded.vjp(args[3], args[4])


class _RemoteLoaded:
    def __init__(self, remote: RemoteBackend, params, dtype: str):
        self.remote, self.params, self.dtype, self.config = remote, params, dtype, params.config
        self.token = (id(self), time.perf_counter_ns())

    def forward(self, inputs, *, need_weights: bool = False):
        return self.remote.call("forward", self.params, self.dtype, self.token, inputs, need_weights)

    def vjp(self, inputs, cotangent):
        return self.remote.call("vjp", self.params, self.dtype, self.token, inputs, cotangent)


class RemoteBackend:
    """Looks like the backend (name, capabilities, divergences) to the search; its calls run in one worker
    process with ``timeout`` seconds each. A timeout or a dead worker raises :class:`CaseFailure` (a finding);
    the worker is replaced for the next call. Exceptions the backend raises come back as themselves."""

    def __init__(self, target: Target, timeout: float = 60.0):
        from pebble import ProcessPool
        self.backend, self.timeout = target.backend, timeout
        self.name, self.capabilities, self.divergences = target.name, target.backend.capabilities, \
            target.backend.divergences
        self.payload = target.payload()
        self.pool = ProcessPool(max_workers=1, context=multiprocessing.get_context("spawn"))

    def call(self, op: str, *args):
        from concurrent.futures import TimeoutError as FutureTimeout

        from pebble import ProcessExpired
        future = self.pool.schedule(_call_in_worker, args=(self.payload, op) + args, timeout=self.timeout)
        try:
            return future.result()
        except FutureTimeout:
            raise CaseFailure(f"{op}: no result within {self.timeout:g} s; worker killed") from None
        except ProcessExpired as exc:
            raise CaseFailure(f"{op}: the worker process died with exit code {exc.exitcode} ({exc})") from None

    def native_parameter_shapes(self, config: AttentionConfig):
        return self.call("shapes", config)

    def load(self, params, *, dtype: str = "float32"):
        return _RemoteLoaded(self, params, dtype)

    def close(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=10)


# --- the search -----------------------------------------------------------------------------------------------------
@dataclass
class SearchOutcome:
    """What one backend's search found."""

    backend: str
    passed: bool
    examples: int = 0
    rejected: int = 0
    seconds: float = 0.0
    example: dict | None = None
    message: str = ""
    repro: str = ""
    saved: str | None = None
    extra: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        head = f"search {self.backend}: {self.examples} examples in {self.seconds:.1f} s"
        if self.passed:
            return [f"{head}: no failure"]
        return [f"{head}: FAILED", f"  {self.message[:600]}", f"  minimal example: {describe(self.example)}",
                f"  repro: {self.repro}"] + ([f"  saved: {self.saved}"] if self.saved else [])


def describe(example: dict[str, Any] | None) -> str:
    """A readable one-line summary of an example's shapes and features."""
    if not example:
        return "-"
    e = example
    parts = [f"B={e['batch']} Tq={e['tq']} Tk={e['tk']} heads={e['heads']} kv_heads={e['kv_heads']} "
             f"d_head={e['d_head']} {e['dtype']}"]
    if e.get("bias"):
        parts.append("bias")
    if e.get("causal"):
        parts.append(f"causal {e['causal']}")
    if e.get("padding"):
        parts.append(f"padding valid={e['padding']['valid']} at {e['padding']['side']}")
    if e.get("attn_mask"):
        m = e["attn_mask"]
        parts.append(f"{m['kind']} mask {m['per']} density {m['density']}"
                     + (f" empty rows {m['empty_rows']}" if m.get("empty_rows") else ""))
    if e.get("logit_scale", 1) != 1:
        parts.append(f"logits x{e['logit_scale']}")
    if e.get("poison", "random") != "random":
        parts.append(f"poison {e['poison']}")
    if e.get("gradients"):
        parts.append("gradients")
    if e.get("malformed") is not None:
        parts.append(f"bad call #{e['malformed']}")
    return ", ".join(parts)


def search_backend(target: Target, *, max_examples: int = DEFAULT_MAX_EXAMPLES, seed: int | None = None,
                   time_budget: float | None = None, quick: bool = False, results: str | Path = "results",
                   isolate: bool = True, timeout: float = 60.0, save: bool = True) -> SearchOutcome:
    """Search ``target`` for a failing example; shrink, save (under ``<results>/search/<backend>/``) and return it.

    ``time_budget`` bounds the generation phase (seconds); shrinking a found failure is not cut short."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.database import DirectoryBasedExampleDatabase

    from mha_harness.conformance.strategies import SearchSpace, examples

    backend = RemoteBackend(target, timeout) if isolate else target.backend
    if isolate:
        try:  # the worker's start (importing torch or jax) is not charged to the time budget
            backend.call("start")
        except Exception as exc:  # noqa: BLE001 - a backend its worker cannot build is reported, not raised
            backend.close()
            return SearchOutcome(target.name, passed=False,
                                 message=f"the worker process could not build {target.name}: "
                                         f"{type(exc).__name__}: {exc}")
    space = SearchSpace.for_backend(target.backend, quick=quick)
    folder = search_dir(results)
    state: dict[str, Any] = {"n": 0, "rejected": 0, "failing": None}
    start = time.perf_counter()

    def body(example):
        if state["failing"] is None and time_budget is not None and time.perf_counter() - start > time_budget:
            return  # generation budget spent: the remaining draws are not run
        state["n"] += 1
        try:
            check_example(backend, example)
        except (Unsupported, CaseSkipped):
            state["rejected"] += 1
            reject()
        except Exception as exc:
            state["failing"] = (dict(example), exc)
            raise

    test = settings(max_examples=max_examples, deadline=None, derandomize=False, report_multiple_bugs=False,
                    database=DirectoryBasedExampleDatabase(str(folder / ".hypothesis" / target.name)),
                    suppress_health_check=list(HealthCheck), print_blob=False, verbosity=Verbosity.quiet,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                    )(given(examples(space))(body))
    if seed is not None:
        test = fixed_seed(seed)(test)
    outcome = SearchOutcome(target.name, passed=True)
    try:
        test()
    except Exception:  # the failure (a Flaky one too) is reported below
        if state["failing"] is None:
            raise
    finally:
        if isolate:
            backend.close()
    outcome.seconds = round(time.perf_counter() - start, 2)
    outcome.examples, outcome.rejected = state["n"], state["rejected"]
    if state["failing"] is not None:
        example, exc = state["failing"]
        outcome.passed = False
        outcome.example = example
        outcome.message = str(exc) if isinstance(exc, CaseFailure) else f"{type(exc).__name__}: {exc}"
        outcome.repro = repro_line(target.name, target.spec if target.spec and ":" in target.spec else None, example)
        if save:
            outcome.saved = str(save_regression(target.name, target.spec if target.spec and ":" in target.spec
                                                else None, example, outcome.message, folder))
        outcome.extra["id"] = example_id(example)
    return outcome


def mutant_table(outcomes: list[SearchOutcome], bugs: dict[str, str]) -> str:
    """Markdown table: mutant, bug, found?, examples, seconds, the shrunk example."""
    rows = ["| mutant | bug | found | examples | seconds | shrunk example |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(f"| {o.backend} | {bugs.get(o.backend, '')} | {'no' if o.passed else 'yes'} | {o.examples} | "
                    f"{o.seconds:.1f} | {describe(o.example)} |")
    return "\n".join(rows)


def run_search(targets: list[Target], *, progress: Callable[[str], None] = print, **options) -> list[SearchOutcome]:
    outcomes = []
    for target in targets:
        outcome = search_backend(target, **options)
        for line in outcome.lines():
            progress(line)
        outcomes.append(outcome)
    return outcomes
