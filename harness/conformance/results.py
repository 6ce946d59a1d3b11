"""One case result, the statuses a result can have (one Enum, used everywhere), and its repro line."""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    """What happened to one case variant. A ``str`` subclass: JSON writes the value, and
    ``Status.PASSED == "passed"``."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    EXPECTED_DIVERGENCE = "expected-divergence"
    UNEXPECTED_PASS = "unexpected-pass"
    ERROR = "error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"

    __str__ = str.__str__

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def bad(self) -> bool:
        """True for the statuses that make a run fail."""
        return self in BAD

    @property
    def lost(self) -> bool:
        """True when the backend's worker gave no verdict (error, timeout, crash)."""
        return self in (Status.ERROR, Status.TIMEOUT, Status.CRASHED)


PASSED, FAILED, SKIPPED = Status.PASSED, Status.FAILED, Status.SKIPPED
EXPECTED_DIVERGENCE, UNEXPECTED_PASS = Status.EXPECTED_DIVERGENCE, Status.UNEXPECTED_PASS
ERROR, TIMEOUT, CRASHED = Status.ERROR, Status.TIMEOUT, Status.CRASHED
STATUSES = tuple(Status)
#: statuses that make a run fail
BAD = (FAILED, UNEXPECTED_PASS, ERROR, TIMEOUT, CRASHED)
#: statuses a repro accepts as "this variant holds"
HOLDS = (PASSED, SKIPPED, EXPECTED_DIVERGENCE)
#: the ``observed`` of a variant not run because its backend's worker was lost too often (the console prints one
#: line for a backend's whole abandoned remainder; each variant keeps its own result)
ABANDONED = "not run: worker lost"
#: worst first: the status a (backend, case) cell shows
SEVERITY = (CRASHED, TIMEOUT, ERROR, UNEXPECTED_PASS, FAILED, EXPECTED_DIVERGENCE, PASSED, SKIPPED)


@dataclass
class CaseResult:
    backend: str
    case: str
    variant: str
    params: dict[str, Any]
    status: Status
    message: str = ""
    max_error: float | None = None
    observed: str | None = None
    seconds: float = 0.0
    repro: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.status = Status(self.status)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["status"] = self.status.value
        return out


def _literal(value) -> str:
    """A Python literal for a parameter value; strings in double quotes when that needs no escapes, so the
    shell-quoted line stays readable (any other string falls back to repr: still safe, only less pretty)."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()  # a NumPy scalar -> the Python value it holds
    if isinstance(value, str):
        plain = value.isprintable() and value.isascii() and '"' not in value and "\\" not in value
        return f'"{value}"' if plain else repr(value)
    if isinstance(value, (list, tuple)):
        items = ", ".join(_literal(v) for v in value)
        return f"[{items}]" if isinstance(value, list) else f"({items}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def repro_command(backend: str, case: str, params: dict, spec: str | None = None) -> str:
    """A one-line bash command that reruns exactly this case variant and exits non-zero unless it holds.

    The Python source uses ``repr`` (Python literals, any name quoted safely) and the whole source is one
    ``shlex.quote``-d word, so pasting it into bash runs nothing but this; a backend that came from a
    ``module:object`` spec is named by its spec (and its name, when the spec yields several backends).
    """
    target = spec if spec else backend
    extra = f", backend_name={_literal(backend)}" if spec else ""
    args = ", ".join(f"{k}={_literal(v)}" for k, v in sorted(params.items()))
    source = (f"import mha_harness; mha_harness.repro({_literal(target)}, {_literal(case)}{extra}"
              + (f", {args}" if args else "") + ")")
    return f"python -c {shlex.quote(source)}"
