"""Did plugin code change NumPy or the harness in this process? A tripwire for what isolation cannot cover.

Isolated checks run plugin calls in workers, but the registry still imports plugin modules here (to read
their names and declarations), and ``--no-isolate`` runs everything here. :func:`take_snapshot` records the
identity of every function and class of NumPy (``numpy``, ``numpy.linalg``, ``numpy.testing``, ``numpy.random``)
and of the ``mha_harness`` modules loaded when ``mha_harness`` is imported; :func:`changes` names those
replaced since. A conformance run with changes is not OK. It detects, it does not prevent: code that runs in
this process can also defeat the tripwire, which is why the verdict's real protection is the worker.
"""
from __future__ import annotations

import sys

_WATCHED_NUMPY = ("numpy", "numpy.linalg", "numpy.testing", "numpy.random", "numpy.fft")
_SNAPSHOT: dict[tuple[str, str], int] = {}


def _watched_modules():
    for name in list(sys.modules):
        if name in _WATCHED_NUMPY or name == "mha_harness" or (
                name.startswith("mha_harness.") and not name.startswith(("mha_harness.implementations",
                                                                         "mha_harness.cases"))):
            module = sys.modules.get(name)
            if module is not None:
                yield name, module


def _members(module):
    try:
        items = list(vars(module).items())
    except TypeError:
        return
    for attr, value in items:
        if callable(value) and not attr.startswith("__"):
            yield attr, value


def take_snapshot() -> None:
    """Record the functions and classes of NumPy and of the loaded harness modules (adds, never forgets)."""
    for name, module in _watched_modules():
        for attr, value in _members(module):
            _SNAPSHOT.setdefault((name, attr), id(value))


def changes() -> list[str]:
    """``module.attribute`` names whose function or class was replaced or deleted since the snapshot."""
    out = []
    for (name, attr), ident in _SNAPSHOT.items():
        module = sys.modules.get(name)
        value = getattr(module, attr, None) if module is not None else None
        if value is None or id(value) != ident:
            out.append(f"{name}.{attr}")
    return sorted(out)
