"""Reading a worker's answer and reaping a worker so that nothing the worker's plugin code does can block the parent.

A worker runs plugin code, and plugin code can write anything to any file descriptor it inherited: the parent's
pipe (a forged frame header makes ``Connection.recv_bytes`` wait for bytes that never come) or the process
sentinel (``Process.join(timeout)`` then sees it readable, and ``waitpid`` blocks on a child that is still alive).
"""
from __future__ import annotations

import os
import select
import struct
import time

#: seconds a message may take to arrive whole once its first bytes are there (a worker writes it in one go: even the
#: largest array a case returns crosses a pipe in well under a second)
ARRIVAL_TIMEOUT_S = 60.0


class GarbledAnswer(Exception):
    """The worker's answer did not arrive whole, or not as the harness's framing (plugin code wrote into the pipe)."""


def recv_bytes_within(conn, timeout: float = ARRIVAL_TIMEOUT_S, maxlength: int | None = None) -> bytes:
    """What ``conn.send_bytes`` sent at the other end of a multiprocessing Connection (its framing: a 4-byte
    big-endian length, or -1 and an 8-byte one), read so that it returns within ``timeout`` seconds or raises
    :class:`GarbledAnswer` (the caller then kills the worker): each read waits in ``select`` with the time left
    and takes only what is there. EOFError when the other end closes mid-frame; a frame longer than ``maxlength``
    is a GarbledAnswer."""
    fd = conn.fileno()
    deadline = time.monotonic() + timeout

    def read(n: int) -> bytes:
        parts, left = [], n
        while left:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise GarbledAnswer(f"the answer did not arrive whole within {timeout:g} s of its first bytes (a "
                                    "frame whose header promises more than was sent: plugin code wrote into the "
                                    "harness's pipe?)")
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the worker's end closed mid-answer")
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)
    size, = struct.unpack("!i", read(4))
    if size == -1:
        size, = struct.unpack("!Q", read(8))
    if size < 0 or (maxlength is not None and size > maxlength):
        raise GarbledAnswer(f"the answer's frame header announces {size} bytes (at most {maxlength} accepted): plugin "
                            "code wrote into the harness's pipe?")
    return read(size)


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
