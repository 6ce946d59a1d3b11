"""Reading a worker's answer and reaping a worker so that nothing the worker's plugin code does can block the parent.

A worker runs plugin code, and plugin code can write anything to any file descriptor it inherited: the parent's
pipe (a forged frame header makes ``Connection.recv_bytes`` wait for bytes that never come) or the process
sentinel (``Process.join(timeout)`` then sees it readable, and ``waitpid`` blocks on a child that is still alive).
"""
from __future__ import annotations

import threading
import time

#: seconds a message may take to arrive whole once its first bytes are there (a worker writes it in one go: even the
#: largest array a case returns crosses a pipe in well under a second)
ARRIVAL_TIMEOUT_S = 60.0


class GarbledAnswer(Exception):
    """The worker's answer did not arrive whole, or not as the harness's framing (plugin code wrote into the pipe)."""


def recv_bytes_within(conn, timeout: float = ARRIVAL_TIMEOUT_S, maxlength: int | None = None) -> bytes:
    """``conn.recv_bytes(maxlength)`` that returns within ``timeout`` seconds or raises :class:`GarbledAnswer`
    (then the caller must kill the worker: that ends the read). EOFError and OSError are raised as they come; a frame
    longer than ``maxlength`` is a GarbledAnswer."""
    box: dict = {}

    def read() -> None:
        try:
            box["data"] = conn.recv_bytes(maxlength)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc
    reader = threading.Thread(target=read, name="mha-harness-recv", daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise GarbledAnswer(f"the answer did not arrive whole within {timeout:g} s of its first bytes (a frame "
                            "whose header promises more than was sent: plugin code wrote into the harness's pipe?)")
    error = box.get("error")
    if isinstance(error, OSError) and "bad message length" in str(error):
        raise GarbledAnswer(f"the answer's frame header is not the harness's ({error}: plugin code wrote into the "
                            "harness's pipe?)")
    if error is not None:
        raise error
    return box["data"]


def reap(process, timeout: float) -> int | None:
    """Wait up to ``timeout`` seconds for ``process`` (a multiprocessing Process) to end, without the blocking
    ``waitpid`` that ``Process.join`` falls into when plugin code has written to the process sentinel; its exit
    code, or None when it is still running."""
    deadline = time.monotonic() + timeout
    while True:
        code = process.exitcode  # waitpid(WNOHANG): never blocks
        if code is not None or time.monotonic() >= deadline:
            return code
        time.sleep(0.02)
