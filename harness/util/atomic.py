"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

An interrupted run (Ctrl-C, SIGTERM, a crash) leaves either the previous complete file
or the new complete file, never half of one. Files get the permissions any ordinary file gets
(0666 less the user's umask, typically 0644), not mkstemp's private 0600: results are meant to be
read by a web server or a colleague. :func:`results_lock` serialises writers of one results folder.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _umask() -> int:
    """The process's umask: from /proc where it can be read without changing it, else set and set back."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def results_lock(path: str | Path, timeout: float = 600.0):
    """An inter-process lock file (filelock) for read-modify-write of a results folder; waits up to
    ``timeout`` seconds for another run to finish its write."""
    from filelock import FileLock
    return FileLock(str(path), timeout=timeout)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def check_writable(directory: str | Path, parameter: str = "results directory") -> Path:
    """Create ``directory`` if needed and prove a file can be written there, else a ValueError naming it."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".probe.", delete=True)
        probe.close()
    except OSError as exc:
        raise ValueError(f"{parameter}: got {str(directory)!r}, which is not writable ({exc.strerror}); "
                         "accepted: a directory you can write to") from None
    return directory
