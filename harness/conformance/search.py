"""``mha-harness search``: property-based search for inputs on which a backend breaks the contract.

Hypothesis draws examples from the backend's declared input space (:mod:`mha_harness.conformance.strategies`),
checks each against the float64 reference, the mask/leakage invariants, gradients, bad input and parameter count
(:func:`mha_harness.conformance.search_examples.check_example`), and on failure shrinks to a minimal example,
prints it as a shell-safe one-line repro and saves it as a regression case that ``mha-harness check`` replays
(``check_search_regressions_still_pass``).

The hypothesis loop and every comparison run in this process; the backend's own calls (load, forward, vjp,
native_parameter_shapes) run in its worker process (the conformance proxy and worker transport, as ``check``) with
a timeout per example, so a plugin that crashes or hangs is a finding, not the end of the run. ``seed`` makes the
search deterministic; hypothesis's example database under ``<results>/search/.hypothesis/<backend>/`` replays
earlier failures first.
"""
from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mha_harness.conformance.casekit import CaseFailure, CaseSkipped
from mha_harness.conformance.isolation import Target, WorkerTransport, unsendable
from mha_harness.conformance.proxy import BackendProxy, WorkerLost, fault_message
from mha_harness.conformance.search_examples import (
    SEARCH_DIR_ENV,
    check_example,
    example_id,
    repro_line,
    save_regression,
    search_dir,
)
from mha_harness.contract.api import Unsupported

MUTANT_SPEC = "mha_harness.implementations.mutants:mutant_backends"
DEFAULT_MAX_EXAMPLES = 200
QUICK_MAX_EXAMPLES = 50
#: how much of a failure's message the console shows whole (conformance's console shows as much)
MESSAGE_SHOWN_CHARS = 1200


# --- the search -----------------------------------------------------------------------------------------------------
@dataclass
class SearchOutcome:
    """What one backend's search found."""

    backend: str
    passed: bool
    examples: int = 0
    rejected: int = 0
    #: why drawn examples were rejected as unsupported (the backend's Unsupported or a skip): reason -> count
    rejections: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    example: dict | None = None
    message: str = ""
    repro: str = ""
    saved: str | None = None
    extra: dict = field(default_factory=dict)
    #: of the examples that ran and passed, how many drew each optional feature the backend declares (a q/k norm,
    #: rotary, a decode step): feature -> count
    drew: dict[str, int] = field(default_factory=dict)

    def why_rejected(self, width: int = 120, most: int = 3) -> str:
        """The commonest reasons for rejecting a draw, each with its count (every reason, not only the first)."""
        ranked = sorted(self.rejections.items(), key=lambda kv: (-kv[1], kv[0]))
        text = "; ".join(f"{n}x {reason[:width]}" for reason, n in ranked[:most])
        if len(ranked) > most:
            text += f"; {len(ranked) - most} other reason(s), {sum(n for _, n in ranked[most:])} draw(s)"
        return text

    def _message_shown(self) -> str:
        """The failure's message whole up to MESSAGE_SHOWN_CHARS (its diagnosis comes last), else cut saying so and
        where the whole one is (an outside user's ended mid-diagnosis, at 600 characters, without a mark)."""
        if len(self.message) <= MESSAGE_SHOWN_CHARS:
            return self.message
        where = f"the whole message is in {self.saved}" if self.saved else "its repro line prints the whole message"
        return self.message[:MESSAGE_SHOWN_CHARS] + f" ... (cut; {where})"

    def lines(self) -> list[str]:
        head = f"search {self.backend}: {self.examples} examples in {self.seconds:.1f} s"
        if self.drew and self.passed:  # how much of a clean search reached the optional features declared
            head += " (" + ", ".join(f"{feature} in {n}" for feature, n in self.drew.items()) + ")"
        if self.rejected:  # hypothesis draws again for each: max_examples counts the examples that ran
            head += f" ({self.rejected} of them rejected as unsupported and drawn again: {self.why_rejected()})"
        if self.passed:
            return [f"{head}: no failure"]
        if self.example is None:  # nothing to shrink or replay: the message says why
            return [f"{head}: FAILED", f"  {self._message_shown()}"]
        saved = []
        if self.saved:  # <search dir>/<backend>/<id>.json: the folder the pytest route must be pointed at
            saved = [f"  saved: {self.saved} (replayed by `mha-harness check` with the same --results, and by the "
                     f"pytest route with {SEARCH_DIR_ENV}={Path(self.saved).parent.parent})"]
        return [f"{head}: FAILED", f"  {self._message_shown()}", f"  minimal example: {describe(self.example)}",
                f"  repro: {self.repro}"] + saved


def describe(example: dict[str, Any] | None) -> str:
    """A readable one-line summary of an example's shapes and features."""
    if not example:
        return "-"
    e = example
    parts = [f"B={e['batch']} Tq={e['tq']} Tk={e['tk']} heads={e['heads']} kv_heads={e['kv_heads']} "
             f"d_head={e['d_head']} {e['dtype']}"]
    if e.get("bias"):
        parts.append("bias")
    if e.get("qk_norm"):
        parts.append(f"qk_norm {e['qk_norm']}")
    if e.get("rotary"):
        parts.append(f"rotary {e['rotary']} base {float(e.get('rotary_base', 10_000.0)):g}"
                     + (f" on {e['rotary_dims']} of {e['d_head']} features" if e.get("rotary_dims") else "")
                     + (f" scaled {e['rotary_scaling']}" if e.get("rotary_scaling") else ""))
    if e.get("sliding_window"):
        parts.append(f"sliding window {e['sliding_window']}")
    if e.get("alibi"):
        parts.append(f"alibi {e['alibi']}")
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
    if e.get("decode_step"):
        parts.append("decode step")
    if e.get("malformed") is not None:
        parts.append(f"bad call #{e['malformed']}")
    return ", ".join(parts)


def search_backend(target: Target, *, max_examples: int = DEFAULT_MAX_EXAMPLES, seed: int | None = None,
                   time_budget: float | None = None, quick: bool = False, results: str | Path = "results",
                   isolate: bool = True, timeout: float = 60.0, save: bool = True,
                   dtypes: tuple[str, ...] | None = None, gradients: bool = True) -> SearchOutcome:
    """Search ``target`` for a failing example; shrink, save (under ``<results>/search/<backend>/``) and return it.

    ``time_budget`` bounds the generation phase (seconds); shrinking a found failure is not cut short. ``dtypes``
    and ``gradients=False`` narrow the space the backend declares (a ValueError when no declared dtype is left)."""
    from hypothesis import HealthCheck, Phase, Verbosity, configuration, given, reject, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.database import DirectoryBasedExampleDatabase

    from mha_harness.conformance.strategies import SearchSpace, examples

    space = SearchSpace.for_backend(target.backend, quick=quick, dtypes=dtypes, gradients=gradients)
    try:
        transport = WorkerTransport(target.payload(), None) if isolate else None
    except Exception as exc:  # noqa: BLE001 - an unpicklable object: search nothing, say why
        return SearchOutcome(target.name, passed=False, message=unsendable(exc))
    backend = BackendProxy(target.backend, transport) if isolate else target.backend
    if isolate:
        try:  # the worker's start (importing torch or jax) is not charged to the time budget
            transport.call("hello")
        except (Exception, WorkerLost) as exc:  # a backend its worker cannot build is reported, not raised
            transport.stop()
            return SearchOutcome(target.name, passed=False,
                                 message=f"the worker process could not build {target.name}: {exc}")
    folder = search_dir(results)
    state: dict[str, Any] = {"n": 0, "rejected": 0, "rejections": {}, "failing": None}
    features = {"a q/k norm": ("qk_norm", bool(space.qk_norms)), "rotary": ("rotary", bool(space.rotary)),
                "a partial rotary": ("rotary_dims", space.partial_rotary and bool(space.rotary)),
                "a rescaled rotary": ("rotary_scaling", bool(space.rotary_scalings) and bool(space.rotary)),
                "a sliding window": ("sliding_window", space.sliding_window),
                "ALiBi": ("alibi", bool(space.alibi)),
                "a decode step": ("decode_step", space.decode_step)}
    drew = {feature: 0 for feature, (_, declared) in features.items() if declared}
    start = time.perf_counter()

    def body(example):
        if state["failing"] is None and time_budget is not None and time.perf_counter() - start > time_budget:
            return  # generation budget spent: the remaining draws are not run
        state["n"] += 1
        if isolate:
            transport.begin_case(timeout)  # the worker gets ``timeout`` seconds per example
        try:
            check_example(backend, example)
        except (Unsupported, CaseSkipped) as skip:
            state["rejected"] += 1
            reason = str(skip) or type(skip).__name__
            state["rejections"][reason] = state["rejections"].get(reason, 0) + 1
            reject()
        except WorkerLost as lost:  # a hang or a crash of the worker is a finding
            failure = CaseFailure(f"{getattr(lost, 'status', 'lost')}: {lost}")
            state["failing"] = (dict(example), failure)
            raise failure from None
        except Exception as exc:
            state["failing"] = (dict(example), exc)
            raise
        finally:
            if isolate:
                transport.end_case()
        for feature in drew:  # an example that ran and passed (a rejected or failing one raised above)
            drew[feature] += bool(example.get(features[feature][0]))

    test = settings(max_examples=max_examples, deadline=None, derandomize=False, report_multiple_bugs=False,
                    database=DirectoryBasedExampleDatabase(str(folder / ".hypothesis" / target.name)) if save else None,
                    suppress_health_check=list(HealthCheck), print_blob=False, verbosity=Verbosity.quiet,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                    )(given(examples(space))(body))
    if seed is not None:
        test = fixed_seed(seed)(test)
    outcome = SearchOutcome(target.name, passed=True)
    home = vars(configuration).get("__hypothesis_home_directory")
    scratch = None if save else tempfile.TemporaryDirectory(prefix="mha-harness-search-")  # nothing left behind
    # its caches too, not ./.hypothesis in the cwd
    configuration.set_hypothesis_home_dir(folder / ".hypothesis" if save else Path(scratch.name))
    from hypothesis.errors import Unsatisfiable
    try:
        test()
    except Unsatisfiable:  # every draw rejected as unsupported: nothing was checked, which fails the search
        outcome.passed = False
        outcome.rejections = dict(state["rejections"])
        outcome.message = (f"no example ran: all {state['rejected']} drawn were rejected as unsupported ("
                           f"{outcome.why_rejected(width=300)}); the backend refuses every call its "
                           "capabilities declare: narrow the declaration to what it runs")
    except Exception:  # the failure (a Flaky one too) is reported below
        if state["failing"] is None:
            raise
    finally:
        configuration.set_hypothesis_home_dir(home)
        if scratch is not None:
            scratch.cleanup()
        if isolate:
            transport.close()
    outcome.seconds = round(time.perf_counter() - start, 2)
    outcome.examples, outcome.rejected, outcome.drew = state["n"], state["rejected"], dict(drew)
    outcome.rejections = dict(state["rejections"])
    if state["failing"] is not None:
        example, exc = state["failing"]
        outcome.passed = False
        outcome.example = example
        outcome.message = str(exc) if isinstance(exc, CaseFailure) else fault_message(exc)
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
