"""Each backend's plugin code runs in its own worker process; the verdict stays in the harness's process.

The case function, the float64 reference, the tolerance and the comparison run here (the parent). The
backend a case sees is a :class:`~mha_harness.conformance.proxy.BackendProxy` whose calls (load, forward,
vjp, native_parameter_shapes) are sent to the backend's worker, which only runs plugin code and answers with
plain data and arrays (:mod:`mha_harness.util.wire`: never unpickled here). So a plugin that patches
``np.exp``, ``np.testing`` or the harness inside its worker changes nothing the verdict uses.

Guarantees:

* a case has ``timeout`` seconds of worker time; past it the worker is killed (``timeout``);
* a worker that dies is ``crashed`` with its exit code or signal, and "killed: out of memory (signal 9)" when the
  kernel's OOM counter (the cgroup's ``memory.events`` / ``memory.oom_control``, else ``/proc/vmstat``) rose;
* any ``BaseException`` raised by plugin code (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``...) is that
  call's error, reported for that case, never the harness's exit code;
* every worker starts its own session (process group); the whole group is killed when the worker ends, so a
  process the plugin started cannot outlive the run or hold its stdout open (one that calls ``setsid`` itself
  leaves the group: not covered);
* after ``MAX_CONSECUTIVE_LOSSES`` timeouts or crashes in a row the backend's remaining cases are errors, not run
  (``observed`` ABANDONED; the command line prints one line for them all), except those its declarations skip,
  which are skipped with their reason as always (that decision needs no worker).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mha_harness.conformance.casekit import Case
from mha_harness.conformance.proxy import BackendProxy, WorkerLost, describe_exception, raise_described
from mha_harness.conformance.results import ABANDONED, CaseResult, Status
from mha_harness.conformance.runner import (
    declared_skip,
    lost_result,
    plan,
    point_to_undeclared_failures,
    run_case,
    settle_precision_declarations,
)
from mha_harness.contract.api import AttentionBackend
from mha_harness.util.pipes import GarbledAnswer, reap, recv_bytes_within
from mha_harness.util.rebuild import backend_payload, build_backend
from mha_harness.util.wire import decode

MAX_CONSECUTIVE_LOSSES = 2
#: seconds a worker may take to import and build its backend, on top of the case's own timeout
START_TIMEOUT = 300.0
#: seconds a worker may take to drop a case's loaded layers
RELEASE_TIMEOUT = 30.0
#: seconds a worker that is done may take to quit on its own before it is killed
QUIT_TIMEOUT = 2.0
#: seconds the backends' threads get, after Ctrl-C or SIGTERM, to finish what they were writing
INTERRUPT_GRACE = 10.0
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: ``spawn`` starts every worker as a fresh interpreter (each one imports NumPy, the harness and its framework:
#: about 4 s of CPU for torch); anything else (the default, ``forkserver``) forks workers from one server process
#: that imported those once
WORKER_START_ENV = "MHA_HARNESS_WORKER_START"
#: imported once into the fork server: the harness's worker side, and each framework the harness's process has
#: already loaded (availability checks import it: a backend's worker will import it too). Never plugin code.
_PRELOAD = ("mha_harness.conformance.proxy", "mha_harness.util.wire", "mha_harness.contract.api")
_PRELOAD_FRAMEWORKS = ("torch", "jax", "flax.linen")


def _forks_from_server() -> bool:
    """Workers fork from the server unless ``$MHA_HARNESS_WORKER_START=spawn`` or the platform has no fork server."""
    return os.environ.get(WORKER_START_ENV) != "spawn" and "forkserver" in multiprocessing.get_all_start_methods()


def _worker_context():
    """The multiprocessing context that starts workers: a fork server preloaded with what workers import, where
    the platform has one; ``spawn`` otherwise or when ``$MHA_HARNESS_WORKER_START=spawn``."""
    if not _forks_from_server():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # read once, when the server starts (the first worker of this process)
    context.set_forkserver_preload(list(_PRELOAD) + [m for m in _PRELOAD_FRAMEWORKS if m in sys.modules])
    return context


def start_worker_server() -> None:
    """Start the fork server now, preloaded with every installed framework of ``_PRELOAD_FRAMEWORKS``, so its
    imports (seconds for torch and jax) run beside this process's own start (loading the registry imports the
    same frameworks to check availability) instead of after it, when the first worker is wanted. Nothing happens
    where workers are spawned (``$MHA_HARNESS_WORKER_START=spawn``, or no fork server on this platform); a
    framework that fails to import in the server is skipped there (multiprocessing ignores the ImportError)."""
    if not _forks_from_server():
        return
    import importlib.util
    from multiprocessing import forkserver
    installed = [m for m in _PRELOAD_FRAMEWORKS if importlib.util.find_spec(m.split(".")[0]) is not None]
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD) + installed)
    forkserver.ensure_running()


@dataclass
class Target:
    """A backend to check: the object, and how a worker process can rebuild it."""

    backend: AttentionBackend
    spec: str | None = None  # ``module:object`` that produces it, when known
    source: str = "python object"  # where it came from, for the report
    #: turns ``spec`` into backends in the worker (a module-level function, e.g. mha_harness.registry's
    #: backends_from_spec, given by the front end: the engine does not import the registry above it)
    load_spec: Callable[[str], list[AttentionBackend]] | None = None
    #: for a backend given as a Python object: the ``module:object`` of its class or factory, when a new process can
    #: import it (repro lines name it: only registered backends are found by name)
    importable_as: str | None = None

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def repro_spec(self) -> str | None:
        """The spec a repro line must name: backends given as module:object, or as objects whose class or factory
        is importable, are not found by name."""
        return self.spec if self.source.startswith(("--backend-spec", "spec ")) else self.importable_as

    def payload(self):
        return backend_payload(self.backend, self.spec, self.load_spec)


def unsendable(exc: BaseException) -> str:
    """Why a backend given as a Python object could not be sent to a worker process, and what to do instead."""
    return (f"cannot send the backend to a worker process ({type(exc).__name__}: {exc}); give it as module:object "
            "(a worker rebuilds it from there) or pass isolate=False (--no-isolate)")


# --- the worker process -------------------------------------------------------------------------------------

def worker_main(conn, payload, threads: int | None, environ: dict | None = None,
                path: list | None = None) -> None:
    """The worker: its own process group; answers (op, args) requests with encoded {"ok": ...} or {"error": ...}.

    ``environ`` and ``path``: the harness's environment and ``sys.path`` when the worker was started (a forked
    worker would otherwise have the fork server's, frozen when it started)."""
    try:
        os.setsid()
    except OSError:
        pass
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if path is not None:
        sys.path[:] = path
    if threads:
        for var in _THREAD_VARS:
            os.environ[var] = str(threads)
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(threads)  # also the OpenMP and BLAS pools a preloaded framework already started
        except Exception:  # noqa: BLE001 - thread limits are an optimisation
            pass
        if "torch" in sys.modules:  # preloaded by the fork server: OMP_NUM_THREADS was read before it was set
            try:
                sys.modules["torch"].set_num_threads(threads)
            except Exception:  # noqa: BLE001
                pass
    from mha_harness.conformance.proxy import Server
    from mha_harness.util.wire import encode
    server, startup_error = None, None
    try:
        server = Server(build_backend(payload))
    except BaseException as exc:  # noqa: BLE001 - the plugin's import or constructor: that backend's error
        startup_error = describe_exception(exc)
        startup_error["message"] = f"building the backend in its worker: {startup_error['message']}"
    while True:
        try:
            op, args = conn.recv()
        except BaseException:  # noqa: BLE001 - the harness went away
            os._exit(0)
        if op == "quit":  # returning ends the process normally: its exit handlers release what the plugin made
            return
        try:
            if startup_error is not None:
                reply = {"error": startup_error}
            elif op == "hello":
                reply = {"ok": None}
            else:
                reply = {"ok": getattr(server, op)(*args)}
            data = encode(reply)
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt... from plugin code
            try:
                data = encode({"error": describe_exception(exc)})
            except BaseException:  # noqa: BLE001
                data = encode({"error": {"type": "Error", "message": "unreportable exception", "kind": "other"}})
        try:
            conn.send_bytes(data)
        except BaseException:  # noqa: BLE001
            os._exit(0)


# --- out-of-memory evidence ---------------------------------------------------------------------------------

def _memory_cgroup_files() -> list[Path]:
    """Files holding this process's cgroup OOM-kill counter (v2 memory.events, v1 memory.oom_control)."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            out.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control")
    return out


OOM_COUNTER_FILES: list[Path] = _memory_cgroup_files() + [Path("/proc/vmstat")]


def oom_kills() -> int | None:
    """The kernel's OOM-kill count for this process's memory cgroup (else the whole machine); None if unknown."""
    for path in OOM_COUNTER_FILES:
        try:
            for line in path.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


def death_message(exitcode: int | None, oom_before: int | None, oom_after: int | None) -> str:
    """Why a worker died, in words: exit code, signal, or out of memory when the OOM counter rose."""
    if exitcode is None:
        return "worker process died (exit status unknown)"
    if exitcode < 0:
        sig = -exitcode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL and oom_before is not None and oom_after is not None and oom_after > oom_before:
            return "killed: out of memory (signal 9)"
        return f"worker process killed by {name} (exit code {exitcode})"
    return f"worker process exited with exit code {exitcode} before answering"


# --- the harness's side --------------------------------------------------------------------------------------

_ACTIVE: set = set()
_STOPPING = threading.Event()


class WorkerTransport:
    """Sends a backend's calls to its worker process, restarting it after a loss.

    Each case gives the worker ``timeout`` seconds in total: only the time spent waiting for the worker is
    charged (the harness's own reference and comparison are not), and so is not the worker's start."""

    isolated = True

    def __init__(self, payload, threads: int | None):
        self.payload, self.threads = payload, threads
        self.process = self.conn = None
        self.budget: float | None = None  # worker seconds left to the current case
        self.timeout = None
        self.limit_message = ""

    # lifecycle
    def _start(self) -> None:
        context = _worker_context()
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_main, daemon=True,
                                       args=(child, self.payload, self.threads, dict(os.environ), list(sys.path)))
        self.oom_before = oom_kills()
        self.process.start()
        child.close()
        _ACTIVE.add(self)
        case_budget, case_message = self.budget, self.limit_message
        self.budget, self.limit_message = START_TIMEOUT, (
            f"the worker did not import and build the backend within {START_TIMEOUT:g} s; worker killed")
        try:
            self.call("hello")  # the plugin's import and constructor are not charged to the case
        finally:
            self.budget, self.limit_message = case_budget, case_message

    def close(self) -> None:
        """Ask a worker that is done to quit (so its exit cleans up what the plugin made: a multiprocessing lock
        left to a killed process makes "resource_tracker: ... leaked semaphore objects" at the end of the run),
        then :meth:`stop` it and whatever is left of its process group."""
        process = self.process
        if process is not None and process.is_alive() and not _STOPPING.is_set():
            try:
                self.conn.send(("quit", ()))
                reap(process, QUIT_TIMEOUT)
            except (OSError, ValueError):
                pass
        self.stop()

    def stop(self) -> None:
        """Kill the worker and its whole process group (whatever plugin processes it started)."""
        process, self.process = self.process, None
        _ACTIVE.discard(self)
        if process is None:
            return
        for kill in (lambda: os.killpg(process.pid, signal.SIGKILL), lambda: process.kill()):
            try:
                kill()
            except (ProcessLookupError, PermissionError, OSError, AttributeError, TypeError):
                pass  # TypeError: a process that never started has no pid
        reap(process, 5)
        try:
            os.killpg(process.pid, signal.SIGKILL)  # members that outlived the leader
        except (ProcessLookupError, PermissionError, OSError, TypeError):
            pass
        try:
            self.conn.close()
        except OSError:
            pass

    # per case
    def begin_case(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.limit_message = f"no result within {timeout:g} s; worker killed" if timeout else ""
        self.budget = timeout

    def end_case(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.budget, self.limit_message = RELEASE_TIMEOUT, "releasing the case's loaded layers timed out"
            try:
                self.call("release")
            except WorkerLost:
                pass
        self.budget = None

    def call(self, op: str, *args):
        if _STOPPING.is_set():
            raise WorkerLost(Status.ERROR, "not run: the run was interrupted")
        if self.process is None:
            self._start()
        try:
            self.conn.send((op, args))
        except (OSError, EOFError, BrokenPipeError):
            self._lost()
        started = time.monotonic()
        deadline = None if self.budget is None else started + self.budget
        try:
            while True:
                wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
                try:
                    ready = self.conn.poll(wait)
                except (OSError, EOFError):
                    self._lost()
                if ready:
                    try:
                        data = recv_bytes_within(self.conn)
                    except GarbledAnswer as exc:
                        self.stop()
                        raise WorkerLost(Status.ERROR, f"the worker's answer could not be read: {exc}") from None
                    except (OSError, EOFError):
                        self._lost()
                    break
                if _STOPPING.is_set():
                    self.stop()
                    raise WorkerLost(Status.ERROR, "not run: the run was interrupted")
                process = self.process  # None once an interrupt's handler stopped it from another thread
                if process is None or not process.is_alive():
                    self._lost()
                if deadline is not None and time.monotonic() >= deadline:
                    self.stop()
                    raise WorkerLost(Status.TIMEOUT, self.limit_message)
        finally:
            if self.budget is not None:
                self.budget = max(0.0, self.budget - (time.monotonic() - started))
        try:
            reply = decode(data)
        except Exception as exc:  # noqa: BLE001 - a worker answering garbage is that backend's error
            self.stop()  # the pipe is out of step: the next answer would be read from inside this one
            raise WorkerLost(Status.ERROR, f"the worker's answer could not be read ({type(exc).__name__}: {exc})") \
                from None
        if not isinstance(reply, dict) or not ({"ok", "error"} & set(reply)):
            self.stop()
            raise WorkerLost(Status.ERROR, "the worker's answer is not a reply")
        if "error" in reply:
            raise_described(reply["error"] if isinstance(reply["error"], dict) else {"message": reply["error"]})
        return reply["ok"]

    def _lost(self):
        process = self.process
        if _STOPPING.is_set():  # Ctrl-C or SIGTERM stopped the worker: the case was not run, nothing crashed
            self.stop()
            raise WorkerLost(Status.ERROR, "not run: the run was interrupted")
        if process is None:
            raise WorkerLost(Status.ERROR, "not run: the worker was stopped before it answered")
        exitcode = reap(process, 2)
        message = death_message(exitcode, self.oom_before, oom_kills())
        self.stop()
        raise WorkerLost(Status.CRASHED, message)


def run_target_isolated(target: Target, cases: list[Case], *, timeout: float, threads: int | None,
                        progress=None) -> list[CaseResult]:
    """All planned variants of one backend; plugin calls in its worker, each case under ``timeout`` seconds."""
    results: list[CaseResult] = []
    spec = target.repro_spec
    try:
        payload = target.payload()
    except Exception as exc:  # noqa: BLE001 - an unpicklable object: run nothing, say why
        return [lost_result(target.name, c, p, Status.ERROR, unsendable(exc), spec)
                for c, p in plan(target.backend, cases)]
    transport = WorkerTransport(payload, threads)
    proxy = BackendProxy(target.backend, transport)
    losses = 0
    planned = plan(target.backend, cases)
    try:
        for i, (case, params) in enumerate(planned):
            if _STOPPING.is_set():
                break
            if losses >= MAX_CONSECUTIVE_LOSSES:
                results += _abandoned(target, planned[i:], spec, progress)
                break
            result = run_case(proxy, case, params, spec=spec, timeout=timeout)
            losses = losses + 1 if result.status in (Status.TIMEOUT, Status.CRASHED) else 0
            results.append(result)
            if progress:
                progress(result)
    finally:
        transport.close()
    settle_precision_declarations(target.backend, results, progress)
    point_to_undeclared_failures(results)
    return results


def _abandoned(target: Target, remainder: list, spec: str | None, progress) -> list[CaseResult]:
    """The variants left when the worker was lost too often: those the backend's declarations skip are skipped
    with their reason (deciding that needs no worker); every other one is an error, not run, marked ABANDONED."""
    skips = [declared_skip(target.backend, case, params) for case, params in remainder]
    not_run = sum(skip is None for skip in skips)
    message = (f"not run: {target.name}'s worker was lost {MAX_CONSECUTIVE_LOSSES} times in a row (timeouts or "
               f"crashes); its remaining {not_run} case variant(s) were abandoned"
               + (f" ({len(skips) - not_run} more skip on its declarations)" if not_run < len(skips) else "")
               + "; each is among the report's results (conformance.json, where one is written)")
    out = []
    for (case, params), skip in zip(remainder, skips):
        if skip is None:
            result = lost_result(target.name, case, params, Status.ERROR, message, spec)
            result.observed = ABANDONED
        else:
            result = lost_result(target.name, case, params, Status.SKIPPED, skip[0], spec)
            result.observed = skip[1]
        out.append(result)
        if progress:
            progress(result)
    return out


def schedule(targets: list[Target], cases: list[Case]) -> list[Target]:
    """The order in which backends start: the longest expected first (longest-processing-time-first scheduling),
    so that on a machine with few cores the slowest backend is not the last to start while the others idle.

    Expected length: backends that compile per shape (``compiles_per_shape``: compilation dominates) before the
    rest, then more planned variants first; ties keep the given order. Only the order changes, never what runs."""
    def planned(target: Target) -> int:
        try:
            return len(plan(target.backend, cases))
        except Exception:  # noqa: BLE001 - a plugin's variants: its worker reports the fault; order only here
            return 0

    def compiles(target: Target) -> bool:
        return getattr(target.backend, "compiles_per_shape", False) is True

    sizes = {id(t): planned(t) for t in targets}
    return sorted(targets, key=lambda t: (not compiles(t), -sizes[id(t)]))


def run_isolated(targets: list[Target], cases: list[Case], *, timeout: float = 120.0, jobs: int | None = None,
                 progress=None, on_backend_done=None) -> dict[str, list[CaseResult]]:
    """Run several backends, ``jobs`` at a time, each with its own worker; results keyed by backend name."""
    jobs = max(1, jobs or min(len(targets), os.cpu_count() or 1))
    threads = 1 if jobs > 1 else None
    out: dict[str, list[CaseResult]] = {}

    def one(target: Target):
        out[target.name] = run_target_isolated(target, cases, timeout=timeout, threads=threads, progress=progress)
        if on_backend_done:
            on_backend_done(target.name, out[target.name])

    _STOPPING.clear()
    # daemon threads (not a ThreadPoolExecutor, whose threads the interpreter joins at exit): after Ctrl-C or
    # SIGTERM the process must exit at once even while a worker is stuck in a hanging plugin. ``jobs`` threads take
    # the backends in schedule order (the longest first), each the next one when it finishes the last
    queue = schedule(targets, cases)
    taking = threading.Lock()
    errors: list[BaseException] = []

    def guarded():
        while not _STOPPING.is_set():
            with taking:
                if not queue:
                    return
                target = queue.pop(0)
            try:
                one(target)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(exc)

    threads_ = [threading.Thread(target=guarded, daemon=True, name=f"check-{i}")
                for i in range(min(jobs, len(targets)))]
    try:
        for thread in threads_:
            thread.start()
        for thread in threads_:
            while thread.is_alive():
                thread.join(0.2)
    except BaseException:  # Ctrl-C / SIGTERM: kill every worker now; finished results are already kept
        _STOPPING.set()
        for transport in list(_ACTIVE):
            transport.stop()
        # their calls now fail at once: give the threads a moment to hand over (and write) what they finished, so
        # the process does not exit in the middle of a report write (a half-written temporary file left behind)
        deadline = time.monotonic() + INTERRUPT_GRACE
        for thread in threads_:
            thread.join(max(0.0, deadline - time.monotonic()))
        raise
    if errors:
        raise errors[0]
    return out
