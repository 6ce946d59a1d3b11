"""One case result, and the statuses a result can have."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
EXPECTED_DIVERGENCE = "expected-divergence"
UNEXPECTED_PASS = "unexpected-pass"
ERROR = "error"
TIMEOUT = "timeout"
CRASHED = "crashed"
STATUSES = (PASSED, FAILED, SKIPPED, EXPECTED_DIVERGENCE, UNEXPECTED_PASS, ERROR, TIMEOUT, CRASHED)
#: statuses that make a run fail
BAD = (FAILED, UNEXPECTED_PASS, ERROR, TIMEOUT, CRASHED)


@dataclass
class CaseResult:
    backend: str
    case: str
    variant: str
    params: dict[str, Any]
    status: str
    message: str = ""
    max_error: float | None = None
    observed: str | None = None
    seconds: float = 0.0
    repro: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def repro_command(backend: str, case: str, params: dict) -> str:
    """A one-line command that reruns exactly this case variant and raises on failure."""
    kwargs = json.dumps(params, sort_keys=True)
    return f"python -c \"import mha_harness; mha_harness.repro({backend!r}, {case!r}, **{kwargs})\""
