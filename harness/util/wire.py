"""What a backend's worker may send back to the harness: plain data and NumPy arrays, nothing executable.

The harness never unpickles what a worker sends: a worker runs plugin code, and an unpickled object can run
code in the receiving process. Messages are JSON with arrays carried as ``.npy`` blobs read with
``allow_pickle=False``. An array that ``.npy`` cannot carry without pickle (object dtype) arrives as an
:class:`UnsendableArray` naming its dtype and shape, so the harness can fail it with that reason.
"""
from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class UnsendableArray:
    """Stands for an array the worker returned that cannot cross as data (e.g. dtype object)."""

    dtype: str
    shape: tuple


def _pack(obj, blobs: list[bytes]):
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.kind == "V":
            return {"__unsendable__": [str(obj.dtype), list(obj.shape)]}
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(obj), allow_pickle=False)
        blobs.append(buffer.getvalue())
        return {"__array__": len(blobs) - 1}
    if isinstance(obj, np.generic):
        return _pack(np.asarray(obj), blobs)
    if isinstance(obj, dict):
        return {"__dict__": [[_pack(k, blobs), _pack(v, blobs)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_pack(v, blobs) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot send {type(obj).__name__} from a worker; accepted: plain data and NumPy arrays")


def encode(obj) -> bytes:
    """Plain data (None, bool, int, float, str, lists, dicts) and NumPy arrays -> bytes."""
    blobs: list[bytes] = []
    head = json.dumps(_pack(obj, blobs), allow_nan=True).encode()
    parts = [struct.pack("<II", len(head), len(blobs)), head]
    for blob in blobs:
        parts += [struct.pack("<Q", len(blob)), blob]
    return b"".join(parts)


def _unpack(obj, blobs: list[bytes]):
    if isinstance(obj, dict):
        if "__array__" in obj:
            return np.load(io.BytesIO(blobs[int(obj["__array__"])]), allow_pickle=False)
        if "__unsendable__" in obj:
            dtype, shape = obj["__unsendable__"]
            return UnsendableArray(str(dtype), tuple(int(s) for s in shape))
        if "__dict__" in obj:
            return {_hashable(_unpack(k, blobs)): _unpack(v, blobs) for k, v in obj["__dict__"]}
        raise ValueError("malformed message from a worker")
    if isinstance(obj, list):
        return [_unpack(v, blobs) for v in obj]
    return obj


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


def decode(data: bytes):
    """The inverse of :func:`encode`; never runs code from the message (no pickle)."""
    view = memoryview(data)
    head_len, count = struct.unpack_from("<II", view, 0)
    offset = 8
    head = json.loads(bytes(view[offset:offset + head_len]))
    offset += head_len
    blobs = []
    for _ in range(count):
        (size,) = struct.unpack_from("<Q", view, offset)
        offset += 8
        blobs.append(bytes(view[offset:offset + size]))
        offset += size
    return _unpack(head, blobs)
