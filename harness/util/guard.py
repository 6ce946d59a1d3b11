"""Running untrusted plugin code in the harness's own process under one guard.

Plugin code that the parent process runs (importing a ``module:object`` or an entry point, constructing
a backend, ``availability()``) may raise anything, ``SystemExit`` and ``KeyboardInterrupt`` included, or
never return. :func:`call_guarded` turns each of these into a :class:`PluginFault` carrying one line
("SystemExit: 0", "import timed out after 20 s") that the caller records as that plugin's error.

Why a daemon thread: it catches every ``BaseException`` the plugin raises (a ``sys.exit`` or a
``KeyboardInterrupt`` raised inside the thread ends only that thread), it bounds the wait with
``join(timeout)``, and it costs nothing when the plugin is well behaved. A thread that hangs is
abandoned (daemon: it never holds the interpreter open at exit) and the result is remembered, so the
hanging code is never entered twice. A thread cannot survive ``os._exit`` or a crash of the whole
process; the registry therefore first imports third-party plugins in a throw-away subprocess
(:func:`run_python_isolated`) and only imports in this process what came back from it.

A real Ctrl-C reaches the main thread, which is only waiting on ``join``: it is never mistaken for the
plugin's fault.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

#: seconds a plugin import, construction or availability() may take in this process before it is given up
DEFAULT_PLUGIN_TIMEOUT = 20.0


def plugin_timeout() -> float:
    """The plugin timeout: ``$MHA_HARNESS_PLUGIN_TIMEOUT`` seconds if set to a positive number, else 20."""
    text = os.environ.get("MHA_HARNESS_PLUGIN_TIMEOUT", "")
    try:
        value = float(text)
    except ValueError:
        return DEFAULT_PLUGIN_TIMEOUT
    return value if value > 0 and value == value and value != float("inf") else DEFAULT_PLUGIN_TIMEOUT


class PluginFault(Exception):
    """Plugin code raised (any BaseException) or timed out; ``str()`` is the one-line reason."""


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line (the last line of the exception, as Python prints it)."""
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return " ".join(text.split("\n"))


_HARNESS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def where(exc: BaseException) -> str:
    """`` (at FILE:LINE)``: the last frame of ``exc``'s traceback outside the harness and importlib's bootstrap,
    i.e. the line of plugin (or library) code that raised; empty when there is none (``No module named ...``). A
    SyntaxError's own file and line (its traceback ends in the import machinery, never in the file that failed)."""
    if isinstance(exc, SyntaxError) and exc.filename and not exc.filename.startswith("<"):
        return f" (at {exc.filename}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith(_HARNESS_DIR + os.sep)
              and not os.path.abspath(f.filename).startswith(os.path.dirname(os.path.abspath(traceback.__file__))
                                                               + os.sep + "importlib" + os.sep)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def call_guarded(fn: Callable[[], Any], what: str, timeout: float | None) -> Any:
    """``fn()``'s value; any exception it raises, or a run past ``timeout`` seconds, is a PluginFault.

    ``timeout=None`` runs ``fn`` in this thread with no time limit (for the harness's own built-in code):
    ``Exception`` and ``SystemExit`` are faults, ``KeyboardInterrupt`` is the user's and propagates.
    """
    if timeout is None:
        try:
            return fn()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - becomes the plugin's recorded error
            raise PluginFault(f"{what} raised {describe(exc)}{where(exc)}") from None
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the plugin's fault
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"plugin-guard: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise PluginFault(f"{what} timed out after {timeout:g} s")
    if "error" in outcome:
        raise PluginFault(f"{what} raised {describe(outcome['error'])}{where(outcome['error'])}")
    return outcome.get("value")


def run_python_isolated(code: str, args: list[str], timeout: float) -> tuple[str | None, str | None]:
    """Run ``python -c code args... RESULT_FILE`` in its own session; (result file text, None) or (None, reason).

    The child gets this process's ``sys.path``; stdin is closed, stdout discarded; on timeout its whole
    process group is killed, so nothing it started outlives the call.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="mha-probe-") as tmp:
        result_path, err_path = os.path.join(tmp, "result"), os.path.join(tmp, "stderr")
        with open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-c", code, *args, result_path], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return None, f"timed out after {timeout:g} s"
            except BaseException:
                _kill_group(proc)
                raise
            finally:
                _kill_group(proc, only_children=True)
        if os.path.exists(result_path):
            with open(result_path, encoding="utf-8") as handle:
                return handle.read(), None
        with open(err_path, "rb") as handle:
            tail = handle.read()[-2000:].decode("utf-8", "replace").strip().splitlines()
        last = f": {tail[-1].strip()}" if tail else ""
        return None, f"the process exited with code {proc.returncode} before reporting{last}"


def _kill_group(proc: subprocess.Popen, only_children: bool = False) -> None:
    """SIGKILL the child's process group (what it started too); reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if not only_children:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be refused
            pass
