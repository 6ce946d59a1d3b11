"""One context variable set for the duration of a block: how the harness scopes a rule to one case or call
(an implicit causal alignment, a declared tolerance bound, a declared empty-row convention...)."""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(variable: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """``variable`` holds ``value`` inside the block and its previous value after it (also on an exception)."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
