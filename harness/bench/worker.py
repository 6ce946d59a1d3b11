"""One worker process per backend for ``mha-harness bench``: it holds the backend's prepared callables.

The parent (mha_harness.bench.sweep) asks one worker at a time to prepare a point, take timed samples or
measure a call's peak memory; the other workers wait blocked on a pipe read, so their thread pools are idle
rather than spinning next to the one being timed. Each worker

* starts with the benchmark's thread environment (mha_harness.bench.threads) and its own process group, so a
  terminal's Ctrl-C reaches only the parent, which kills the whole group (and a plugin's children) at the end;
* measures memory in its own process: no other backend's allocations pollute its resident size;
* answers every request within a timeout, or is killed and reported (``timeout``); a worker that dies is
  reported as ``crashed`` with its signal or exit code; one whose resident size passes ``max_bytes`` is killed
  and reported as ``out-of-memory``. The sweep goes on with the other backends.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from contextlib import contextmanager

from mha_harness.util.main_guard import refuse_unguarded_main
from mha_harness.util.pipes import GarbledAnswer, reap, recv_bytes_within
from mha_harness.util.rebuild import backend_payload, build_backend

POLL_S = 0.05
#: before a backend's turn the other workers must have used less than this fraction of a core over one window of
#: SETTLE_WINDOW_S: OpenBLAS's threads spin ~0.1 s after each call, ONNX Runtime's ~0.05 s (measured), and a
#: spinning thread on one of 2 cores would slow whoever is timed next
SETTLE_WINDOW_S = 0.02
SETTLE_IDLE_FRACTION = 0.1
SETTLE_LIMIT_S = 2.0
#: seconds a new worker may take to start (spawn, import the harness, NumPy and the plugin, unpickle the backend):
#: like ``check``'s workers, the start is not charged to the first request's ``--bench-timeout``
STARTUP_TIMEOUT_S = 300.0
#: the longest answer a worker may send (timings and memory figures: a few KiB)
MAX_ANSWER_BYTES = 64 * 2 ** 20
#: samples of the estimated size whose fastest refines the calibration (3 x ~20 ms)
CALIBRATION_SAMPLES = 3
TIMEOUT, CRASHED, OUT_OF_MEMORY, ERROR = "timeout", "crashed", "out-of-memory", "error"


class WorkerLost(Exception):
    """The worker did not answer: ``status`` is timeout, crashed, out-of-memory or error."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- the worker process

def _worker_main(conn, payload: tuple, threads: int) -> None:
    """Serve requests until told to quit or the parent goes away (EOF on the pipe)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a worker stops
    from mha_harness.bench.threads import apply_threads, pin_cpus
    pin_cpus(threads)  # before the plugin is unpickled: every pool it starts (XLA's too) sees ``threads`` CPUs
    server = _Server(build_backend(payload), threads)
    apply_threads(threads)
    _answer(conn, ("ready", os.getpid()))  # the start (spawn, imports, unpickling) is not charged to a request
    while True:
        try:
            request = conn.recv()  # from the parent: pickles are fine this way
        except (EOFError, OSError):
            return
        if request[0] == "quit":
            return
        _answer(conn, server.handle(request))


def _plain(obj):
    """``obj`` with NumPy scalars as Python numbers and tuples as lists: what crosses the wire comes back the same."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    import numpy as np
    return obj.item() if isinstance(obj, np.generic) else obj


def _answer(conn, reply) -> None:
    """Send an answer as data (JSON and ``.npy``, mha_harness.util.wire), never a pickle: the parent must not
    unpickle what a process running plugin code wrote."""
    from mha_harness.util.wire import encode
    try:
        data = encode(_plain(reply))
    except Exception as exc:  # noqa: BLE001 - a value that cannot cross as data is that backend's error
        data = encode([ERROR, f"the answer cannot be sent as data ({type(exc).__name__}: {exc})"])
    conn.send_bytes(data)


class _Server:
    def __init__(self, backend, threads: int):
        self.backend, self.threads = backend, threads
        self.prepared: dict = {}
        self.points: dict = {}  # key -> calls.PreparedPoint: what a later call's output is read with
        self.pinned = False

    def handle(self, request):
        from mha_harness.bench.verify import WRONG_OUTPUT, WrongOutput
        from mha_harness.contract.api import Unsupported
        kind, *args = request
        try:
            return ("ok", getattr(self, f"do_{kind}")(*args))
        except (Unsupported, NotImplementedError) as exc:
            return ("skip", str(exc) or type(exc).__name__)
        except WrongOutput as exc:
            return (WRONG_OUTPUT, str(exc))
        except MemoryError as exc:
            return (OUT_OF_MEMORY, f"MemoryError: {exc}")
        except BaseException as exc:  # noqa: BLE001 - a plugin's failure (SystemExit, KeyboardInterrupt too: SIGINT
            return (ERROR, f"{type(exc).__name__}: {exc}")  # is ignored here) is reported, the sweep goes on

    def do_info(self):
        from mha_harness.bench.threads import thread_report
        versions = self.backend.versions()
        return {"threads": thread_report(self.threads), "versions": versions, "pid": os.getpid()}

    def do_prepare(self, key, shape, warm_up_s: float, min_sample_s: float):
        """Load, prepare and warm up the call for ``shape``; calibrate calls per sample. Returns timings (``prepare_s``:
        loading the layer and preparing its call, a decode step's cache fill included, untimed) and the
        first call's values the parent checks against the reference (``checked``: its output at a few rows, or a
        forward + backward call's gradients, ``PreparedPoint.checked_values``)."""
        from mha_harness.bench.calls import prepare_point
        from mha_harness.bench.stats import calls_per_sample
        from mha_harness.bench.threads import apply_threads
        prepare_start = time.perf_counter()
        point = prepare_point(self.backend, shape)
        prepare_s = time.perf_counter() - prepare_start
        fn = point.fn
        apply_threads(self.threads)  # the backend may have imported its framework just now
        start = time.perf_counter()
        value = fn()
        first_s = time.perf_counter() - start
        checked = point.checked_values(value)
        del value
        # the call's cost is the fastest of the warm-up's timed calls (noise, a loaded machine, a slow first few
        # calls only add time): calibrating from one call sized a 0.39 ms call's samples at 1.2 ms, for a 20 ms
        # target, when that one call happened to take 8 ms
        timed = [_time_calls(fn, 1)]
        while time.perf_counter() - start < warm_up_s:
            timed.append(_time_calls(fn, 1))
        call_s = min(timed)
        calls = calls_per_sample(call_s, min_sample_s)
        if calls > 1:  # refine with samples of the estimated size (one call is too short to time precisely)
            call_s = min(call_s, min(_time_calls(fn, calls) / calls for _ in range(CALIBRATION_SAMPLES)))
            calls = calls_per_sample(call_s, min_sample_s)
        self.prepared[key], self.points[key] = (fn, calls), point
        return {"first_call_s": first_s, "call_s": call_s, "calls_per_sample": calls, "checked": checked,
                "prepare_s": prepare_s}

    def do_last_output(self, key):
        """One more call after the point's timed calls, and what of it the parent checks: a call that drifts (a cache
        written one slot further each call, gradients accumulated over calls, state kept) is right only at first.
        None when this worker did not prepare the point (a restarted one)."""
        point = self.points.get(key)
        return None if point is None else {"checked": point.checked_values(point.fn())}

    def do_warm(self, key):
        """One untimed call before a turn's samples: it wakes what another backend's turn left cold (caches, thread
        pools, recycled pages)."""
        fn, _ = self.prepared[key]
        fn()
        return True

    def do_sample(self, key, count: int):
        """``count`` samples of the calibrated size; a sample's value is its time per call. Nothing else runs in this
        request: the parent's clock around it is what the samples must account for."""
        fn, calls = self.prepared[key]
        return {"samples_s": [_time_calls(fn, calls) / calls for _ in range(count)]}

    def do_memory(self, key, shape, warm_up_s: float, min_sample_s: float, method: str | None = None):
        """Peak extra memory of one call (prepared again if this worker is a restarted one); ``method`` overrides
        the backend's own (mha-harness fidelity measures one kernel with two methods).

        A restarted worker prepares the call and makes one untimed call (compilation, first-touch allocation,
        thread-pool start stay outside the reading), with no warm-up loop or calibration: they only cost time,
        and a slow call (decode at long KV lengths, a loaded machine) must not run past the request's timeout."""
        from mha_harness.bench.calls import prepare_point
        from mha_harness.bench.memory import peak_extra_bytes, pin_mmap_threshold
        from mha_harness.bench.threads import apply_threads
        method = method or self.backend.memory_method
        if method == "rss" and not self.pinned:
            self.pinned = pin_mmap_threshold()
        if key not in self.prepared:  # its output was checked when the point was prepared in the lost worker
            fn = prepare_point(self.backend, shape).fn
            apply_threads(self.threads)
            fn()
            self.prepared[key] = (fn, 1)
        fn, _ = self.prepared[key]
        return {"peak_extra_bytes": peak_extra_bytes(fn, method), "memory_method": method}

    def do_memory_floor(self, repeats: int = 5):
        """The largest reading of this backend's memory method for an empty call: its noise floor here."""
        from mha_harness.bench.memory import peak_extra_bytes, pin_mmap_threshold
        method = self.backend.memory_method
        if method == "rss" and not self.pinned:
            self.pinned = pin_mmap_threshold()
        return max(peak_extra_bytes(lambda: None, method) for _ in range(repeats))

    def do_memory_analysis(self, key):
        """The compiler's own memory figures for the prepared call, when it offers them (XLA: memory_analysis())."""
        fn, _ = self.prepared[key]
        analysis = getattr(fn, "memory_analysis", None)
        if analysis is None:
            return None
        ma = analysis()
        return {name: int(getattr(ma, f"{name}_size_in_bytes")) for name in
                ("argument", "output", "alias", "temp", "generated_code")}

    def do_autorange(self, key, max_run_time: float):
        """torch.utils.benchmark's adaptive_autorange on the same prepared callable, alone in this process."""
        from torch.utils.benchmark import Timer
        fn, _ = self.prepared[key]
        m = Timer(stmt="fn()", globals={"fn": fn}, num_threads=self.threads).adaptive_autorange(
            threshold=0.1, max_run_time=max_run_time)
        return {"median_s": m.median, "iqr_s": m.iqr, "n_measurements": len(m.times),
                "number_per_run": m.number_per_run}

    def do_overhead(self, key, shape, rounds: int):
        """Prepared callable against the backend's direct library call (its public ``direct_callable`` hook) on
        the same inputs: medians over ``rounds`` interleaved rounds of calibrated samples."""
        import statistics

        from mha_harness.bench.calls import backend_arguments
        fn, calls = self.prepared[key]
        params, inputs = backend_arguments(self.backend, shape)
        direct = self.backend.direct_callable(inputs, params, dtype=shape.dtype)
        direct()
        times = {"harness": [], "direct": []}
        pair = [("harness", fn), ("direct", direct)]
        for r in range(rounds):
            for name, f in pair if r % 2 == 0 else pair[::-1]:
                times[name].append(_time_calls(f, calls) / calls)
        return {name: statistics.median(v) for name, v in times.items()}

    def do_drop(self, key):
        self.prepared.pop(key, None)
        self.points.pop(key, None)
        return None


def _time_calls(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------- the parent's handle

def cpu_ns(pid: int) -> int | None:
    """CPU time used so far by every thread of process ``pid``, in ns (Linux: /proc/<pid>/task/*/schedstat);
    None where the figure cannot be read (another OS, a process gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                total += int(handle.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


def wait_until_idle(pids: list[int], *, window_s: float = SETTLE_WINDOW_S, idle_fraction: float = SETTLE_IDLE_FRACTION,
                    limit_s: float = SETTLE_LIMIT_S) -> tuple[float, bool]:
    """Wait until the processes ``pids`` together use under ``idle_fraction`` of a core over one ``window_s``
    (their thread pools have stopped spin-waiting), for at most ``limit_s``. (seconds waited, settled)."""
    start = time.perf_counter()
    if not pids:
        return 0.0, True
    before = [cpu_ns(pid) for pid in pids]
    if all(b is None for b in before):
        return 0.0, True  # nothing to read here: cannot wait for it
    while True:
        time.sleep(window_s)
        after = [cpu_ns(pid) for pid in pids]
        used = sum(abs(a - b) for a, b in zip(after, before) if a is not None and b is not None)
        waited = time.perf_counter() - start
        if used < idle_fraction * window_s * 1e9:
            return waited, True
        if waited >= limit_s:
            return waited, False
        before = after


@contextmanager
def _environment(overrides: dict):
    """The spawned worker copies the parent's environment at start: set it for that moment only."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "worker process vanished"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (SIGKILL: the kernel's OOM killer, or killed from outside)" if -code == signal.SIGKILL else ""
        return f"worker process killed by signal {name}{hint}"
    return f"worker process exited with code {code}"


class BackendWorker:
    """The parent's side of one backend's worker process; restarted on demand after a loss."""

    def __init__(self, backend, threads: int, *, max_bytes: int | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT_S, payload: tuple | None = None):
        self.name = backend.name
        self.threads, self.max_bytes = threads, max_bytes
        # how the worker rebuilds it (mha_harness.util.rebuild): from its module:object spec where the front end
        # gives one, else pickled (which raises for an unpicklable plugin: the caller reports it)
        self.payload = payload or backend_payload(backend)
        self.startup_timeout = startup_timeout
        self.process = None
        self.conn = None

    def _start(self) -> None:
        from mha_harness.bench.threads import thread_env
        refuse_unguarded_main("a benchmark's worker process", alternative=None)  # before spawn imports the script
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_worker_main, args=(child, self.payload, self.threads),
                                  name=f"bench-{self.name}", daemon=True)
        with _environment(thread_env(self.threads)):
            process.start()
        child.close()
        self.process, self.conn = process, parent
        try:
            self._wait(max(self.startup_timeout, 1.0), "to start")
        except WorkerLost as exc:
            raise WorkerLost(exc.status, f"worker did not start: {exc}") from None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.alive else None

    def request(self, message: tuple, timeout: float):
        """Send one request and wait for its answer; (status, value) or WorkerLost (the worker is then gone)."""
        if not self.alive:
            self.kill()
            self._start()
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            raise self._lost(CRASHED, _describe_exit(self.process.exitcode)) from None
        return self._wait(timeout, "")

    def _wait(self, timeout: float, what: str):
        """The worker's next answer within ``timeout`` seconds, or WorkerLost (the worker is then killed)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.conn.poll(POLL_S):
                try:
                    data = recv_bytes_within(self.conn, maxlength=MAX_ANSWER_BYTES)
                except GarbledAnswer as exc:
                    raise self._lost(ERROR, f"the worker's answer could not be read: {exc}") from None
                except (EOFError, OSError):
                    raise self._lost(CRASHED, _describe_exit(reap(self.process, 1))) from None
                return self._read(data)
            if not self.process.is_alive():
                raise self._lost(CRASHED, _describe_exit(self.process.exitcode))
            if self.max_bytes and _rss_bytes(self.process.pid) > self.max_bytes:
                raise self._lost(OUT_OF_MEMORY, f"worker passed the memory limit of {self.max_bytes / 2 ** 20:.0f} MiB "
                                               "(--max-memory); killed")
            if time.monotonic() > deadline:
                raise self._lost(TIMEOUT, f"no answer {what + ' ' if what else ''}within {timeout:g} s "
                                          f"({'startup' if what else '--bench-timeout'}); worker killed")

    def _read(self, data: bytes):
        """An answer as (status, value); a worker that wrote anything else is lost as an error."""
        from mha_harness.util.wire import decode
        try:
            answer = decode(data)
        except Exception as exc:  # noqa: BLE001 - garbage from plugin code
            raise self._lost(ERROR, f"the worker's answer could not be read ({type(exc).__name__}: {exc}): plugin "
                                    "code wrote into the harness's pipe?") from None
        if not (isinstance(answer, list) and len(answer) == 2 and isinstance(answer[0], str)):
            raise self._lost(ERROR, "the worker's answer is not a (status, value) pair: plugin code wrote into the "
                                    "harness's pipe?")
        return tuple(answer)

    def _lost(self, status: str, message: str) -> WorkerLost:
        self.kill()
        return WorkerLost(status, message)

    def kill(self) -> None:
        """Kill the worker's whole process group (the worker and anything a plugin started) and reap it."""
        process, self.process = self.process, None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if process is None:
            return
        if process.pid:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.kill()
            except (ProcessLookupError, OSError, AttributeError):
                pass
        reap(process, 5)

    def close(self) -> None:
        if self.alive:
            try:
                self.conn.send(("quit",))
                reap(self.process, 2)
            except (BrokenPipeError, OSError):
                pass
        self.kill()
