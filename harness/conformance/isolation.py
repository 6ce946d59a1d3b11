"""Running each backend in its own worker process with a per-case timeout (pebble).

A plugin that raises, hangs or kills its process takes down only its own worker: the case
is reported as error, timeout or crashed with the reason, a fresh worker takes the next
case, and every other backend's results are untouched. After ``MAX_CONSECUTIVE_LOSSES``
timeouts or crashes in a row the backend's remaining cases are reported as errors rather
than run (a plugin that hangs on every call would otherwise cost cases x timeout).
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from mha_harness.conformance.casekit import Case, variant_id
from mha_harness.conformance.results import CRASHED, ERROR, TIMEOUT, CaseResult, repro_command
from mha_harness.conformance.runner import plan, run_case
from mha_harness.contract.api import AttentionBackend

MAX_CONSECUTIVE_LOSSES = 2
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def require_pebble() -> None:
    """Worker isolation needs pebble; say how to get it (or how to do without) in one line."""
    import importlib.util
    if importlib.util.find_spec("pebble") is None:
        raise ModuleNotFoundError("isolation: pebble is not installed (pip install 'mha-harness[isolation]'); "
                                  "or run without worker processes (--no-isolate / isolate=False)")


@dataclass
class Target:
    """A backend to check: the object, and how a worker process can rebuild it."""

    backend: AttentionBackend
    spec: str | None = None  # ``module:object`` that produces it, when known
    source: str = "python object"  # where it came from, for the report

    @property
    def name(self) -> str:
        return self.backend.name

    def payload(self):
        if self.spec:
            return ("spec", self.spec, self.name)
        return ("pickle", pickle.dumps(self.backend), self.name)


_WORKER_CACHE: dict = {}
_ACTIVE_POOLS: set = set()
_STOPPING = threading.Event()


def _init_worker(threads: int | None) -> None:
    if threads:
        for var in _THREAD_VARS:
            os.environ[var] = str(threads)


def _backend_in_worker(payload) -> AttentionBackend:
    kind, data, name = payload
    key = (kind, data if kind == "spec" else hash(data), name)
    if key not in _WORKER_CACHE:
        if kind == "spec":
            from mha_harness.registry import backends_from_spec
            matches = [b for b in backends_from_spec(data) if b.name == name]
            if not matches:
                raise LookupError(f"{data} no longer produces a backend named {name!r}")
            _WORKER_CACHE[key] = matches[0]
        else:
            _WORKER_CACHE[key] = pickle.loads(data)
    return _WORKER_CACHE[key]


def _run_in_worker(payload, case_name: str, params: dict) -> CaseResult:
    from mha_harness.conformance.casekit import all_cases
    return run_case(_backend_in_worker(payload), all_cases()[case_name], params)


def _lost(target: Target, case: Case, params: dict, status: str, message: str) -> CaseResult:
    return CaseResult(target.name, case.name, variant_id(target.name, params), dict(params), status, message,
                      repro=repro_command(target.name, case.name, params))


def run_target_isolated(target: Target, cases: list[Case], *, timeout: float, threads: int | None,
                        progress=None) -> list[CaseResult]:
    """All planned variants of one backend, each in the backend's worker process under ``timeout`` seconds."""
    results: list[CaseResult] = []
    try:
        payload = target.payload()
    except Exception as exc:  # noqa: BLE001 - an unpicklable object: run nothing, say why
        return [_lost(target, c, p, ERROR, f"cannot send the backend to a worker process ({exc}); "
                      "give it as module:object or pass isolate=False") for c, p in plan(target.backend, cases)]
    from pebble import ProcessExpired, ProcessPool
    context = multiprocessing.get_context("spawn")
    pool = ProcessPool(max_workers=1, initializer=_init_worker, initargs=(threads,), context=context)
    _ACTIVE_POOLS.add(pool)
    losses = 0
    try:
        for case, params in plan(target.backend, cases):
            if _STOPPING.is_set():
                break
            if losses >= MAX_CONSECUTIVE_LOSSES:
                result = _lost(target, case, params, ERROR, f"not run: {target.name}'s worker was lost "
                               f"{MAX_CONSECUTIVE_LOSSES} times in a row (timeouts or crashes)")
            else:
                future = pool.schedule(_run_in_worker, args=(payload, case.name, params), timeout=timeout)
                try:
                    result = future.result()
                    losses = 0
                except FutureTimeout:
                    losses += 1
                    result = _lost(target, case, params, TIMEOUT, f"no result within {timeout:g} s; worker killed")
                except ProcessExpired as exc:
                    losses += 1
                    result = _lost(target, case, params, CRASHED,
                                   f"worker process died with exit code {exc.exitcode} ({exc})")
                except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result or a failed rebuild
                    result = _lost(target, case, params, ERROR, f"{type(exc).__name__}: {exc}")
            results.append(result)
            if progress:
                progress(result)
    finally:
        _ACTIVE_POOLS.discard(pool)
        pool.stop()
        pool.join(timeout=10)
    return results


def run_isolated(targets: list[Target], cases: list[Case], *, timeout: float = 120.0, jobs: int | None = None,
                 progress=None, on_backend_done=None) -> dict[str, list[CaseResult]]:
    """Run several backends, ``jobs`` at a time, each in its own worker; results keyed by backend name."""
    require_pebble()
    jobs = max(1, jobs or min(len(targets), os.cpu_count() or 1))
    threads = 1 if jobs > 1 else None
    out: dict[str, list[CaseResult]] = {}

    def one(target: Target):
        out[target.name] = run_target_isolated(target, cases, timeout=timeout, threads=threads, progress=progress)
        if on_backend_done:
            on_backend_done(target.name, out[target.name])

    _STOPPING.clear()
    # daemon threads (not a ThreadPoolExecutor, whose threads the interpreter joins at exit): after Ctrl-C or
    # SIGTERM the process must exit at once even while a worker is stuck in a hanging plugin
    slots = threading.Semaphore(jobs)
    errors: list[BaseException] = []

    def guarded(target: Target):
        with slots:
            if _STOPPING.is_set():
                return
            try:
                one(target)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(exc)

    threads_ = [threading.Thread(target=guarded, args=(t,), daemon=True, name=f"check-{t.name}") for t in targets]
    try:
        for thread in threads_:
            thread.start()
        for thread in threads_:
            while thread.is_alive():
                thread.join(0.2)
    except BaseException:  # Ctrl-C / SIGTERM: kill every worker now; finished results are already kept
        _STOPPING.set()
        for pool in list(_ACTIVE_POOLS):
            pool.stop()
        raise
    if errors:
        raise errors[0]
    return out
