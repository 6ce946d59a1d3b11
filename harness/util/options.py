"""argparse ``type=`` functions that range-check a command-line value and say what is accepted.

Each factory returns a converter; a bad value raises ``argparse.ArgumentTypeError`` whose text is
"got '0'; accepted: an integer >= 1" (argparse puts "argument --jobs:" in front, so the one line
names the option, the value and the accepted range). NaN and infinities are refused by every
float option.
"""
from __future__ import annotations

import argparse
import math
import os


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _describe(kind: str, minimum, maximum, exclusive_min: bool) -> str:
    low = "" if minimum is None else f"{'>' if exclusive_min else '>='} {_number(minimum)}"
    high = "" if maximum is None else f"<= {_number(maximum)}"
    bounds = " and ".join(b for b in (low, high) if b)
    return f"{kind} {bounds}".strip()


def int_range(minimum: int | None = 1, maximum: int | None = None):
    """An integer in [minimum, maximum] (either bound may be None)."""
    accepted = _describe("an integer", minimum, maximum, False)

    def convert(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; accepted: {accepted}") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"got {text!r}; accepted: {accepted}")
        return value

    convert.__name__ = "integer"
    return convert


def float_range(minimum: float | None = 0.0, maximum: float | None = None, *, exclusive_min: bool = True):
    """A finite number above ``minimum`` (``exclusive_min``) or at least it, and at most ``maximum``."""
    accepted = _describe("a finite number", minimum, maximum, exclusive_min)

    def convert(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; accepted: {accepted}") from None
        too_low = minimum is not None and (value <= minimum if exclusive_min else value < minimum)
        if not math.isfinite(value) or too_low or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"got {text!r}; accepted: {accepted}")
        return value

    convert.__name__ = "number"
    return convert


def nonempty_path(text: str) -> str:
    """A path that is not empty or blank (``--results ''`` would silently mean the working directory)."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"got {text!r}; accepted: a directory path (not empty)")
    return str(text)


def available_memory_bytes() -> int | None:
    """Memory a new allocation can get now: MemAvailable from /proc/meminfo, else physical pages; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def did_you_mean(got: str, accepted) -> str:
    """``"did you mean 'jax-dpa'? "`` for a misspelt name (the closest of ``accepted``, at most three), else ``""``:
    put before the "accepted: one of ..." of a message naming an unknown backend or case."""
    import difflib
    close = difflib.get_close_matches(str(got), list(accepted), n=3, cutoff=0.5)
    return f"did you mean {', '.join(map(repr, close))}? " if close else ""
