"""How a backend travels to a worker process: pickled, or as the ``module:object`` spec a worker rebuilds it from
(a plugin's classes made by a factory, or holding a module, need not pickle). Shared by the conformance workers and
the benchmark workers."""
from __future__ import annotations

import pickle
from collections.abc import Callable


def backend_payload(backend, spec: str | None = None, load_spec: Callable[[str], list] | None = None) -> tuple:
    """What a worker needs to rebuild ``backend``: its spec and the (module-level, picklable) function that turns a
    spec into backends, when both are known; else the backend pickled (raises for an unpicklable one)."""
    if spec and load_spec is not None:
        return ("spec", (spec, load_spec), backend.name)
    return ("pickle", pickle.dumps(backend), backend.name)


def build_backend(payload: tuple):
    """The backend a :func:`backend_payload` describes, built in this (worker) process."""
    kind, data, name = payload
    if kind == "spec":
        spec, load_spec = data
        matches = [b for b in load_spec(spec) if b.name == name]
        if not matches:
            raise LookupError(f"{spec} no longer produces a backend named {name!r}")
        return matches[0]
    return pickle.loads(data)
