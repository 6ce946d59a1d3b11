"""Whether a failing check looks for the known mistake its output matches.

Naming a mistake costs reference computations of every wrong layer the harness knows (about 0.3 s for a grid row at
T = 1000). A strict run whose failure a declared divergence will be verified on needs none of it: the verifying run
decides the verdict, and names the mistake itself where it fails too. The runner runs such strict runs
:func:`undiagnosed`."""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from mha_harness.contract.scoped import scoped

_DIAGNOSING: contextvars.ContextVar[bool] = contextvars.ContextVar("diagnosing", default=True)


@contextlib.contextmanager
def undiagnosed() -> Iterator[None]:
    """Within this block a failing check raises its failure without naming a known mistake (its verdict, error and
    bound unchanged)."""
    with scoped(_DIAGNOSING, False):
        yield


def diagnosing() -> bool:
    """True unless inside :func:`undiagnosed`."""
    return _DIAGNOSING.get()
