"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

An interrupted run (Ctrl-C, SIGTERM, a crash) leaves either the previous complete file
or the new complete file, never half of one.
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
