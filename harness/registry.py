"""The registry of attention backends.

Sources, in order: the built-in backends (the entry points mha-harness itself declares in the group
``mha_harness.backends``: one list, in pyproject.toml), every other entry point in that group, and any
``module:object`` named on the command line or in Python. An object may be a backend instance, a backend class
(constructed without arguments) or a callable returning one backend or an iterable of them (one entry point
can register several kernels). A source that fails to import or construct is recorded
with its error and never aborts the run; two backends with one name is an error naming
both sources.
"""
from __future__ import annotations

import importlib
import re
import traceback
from dataclasses import dataclass
from importlib import metadata

from mha_harness.contract.api import AttentionBackend

ENTRY_POINT_GROUP = "mha_harness.backends"

#: the distribution whose own entry points in ENTRY_POINT_GROUP are the built-in backends (its pyproject.toml is the
#: one list of them)
DISTRIBUTION = "mha-harness"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def builtin_entry_points() -> list[metadata.EntryPoint]:
    """The built-in backends: the entry points mha-harness's own pyproject.toml declares in ENTRY_POINT_GROUP."""
    return [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if _is_builtin(ep)]


def _is_builtin(ep: metadata.EntryPoint) -> bool:
    return ep.dist is not None and _canonical(ep.dist.name) == DISTRIBUTION


_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class RegistryError(ValueError):
    """A configuration error in the registry (duplicate names, unknown backend)."""


@dataclass
class BackendEntry:
    """One registered backend, or one source that failed to produce any."""

    name: str
    source: str
    spec: str
    backend: AttentionBackend | None = None
    error: str | None = None

    @property
    def reason_unavailable(self) -> str | None:
        return self.error or availability_reason(self.backend)

    @property
    def available(self) -> bool:
        return self.reason_unavailable is None


def availability_reason(backend: AttentionBackend) -> str | None:
    """``backend.availability()``, where a plugin that raises is unavailable for that reason, never fatal."""
    try:
        return backend.availability()
    except Exception as exc:  # noqa: BLE001
        return f"availability() raised {type(exc).__name__}: {exc}"


def parse_spec(spec: str) -> tuple[str, str]:
    """Split ``package.module:object``; a malformed spec is a ValueError naming the accepted form."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ValueError(f"backend spec: got {spec!r}; accepted: 'package.module:object' "
                         "(a dotted module path, a colon, an attribute name)")
    module, attr = spec.split(":")
    return module, attr


def _resolve(spec: str):
    module_name, attr = parse_spec(spec)
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def backends_from_object(obj) -> list[AttentionBackend]:
    """Turn an instance, class or factory into backends; anything else is a TypeError naming what it got."""
    if isinstance(obj, AttentionBackend):
        return [obj]
    if isinstance(obj, type) and issubclass(obj, AttentionBackend):
        return [obj()]
    if callable(obj) and not isinstance(obj, type):
        produced = obj()
        items = [produced] if isinstance(produced, AttentionBackend) else list(produced)
        for item in items:
            if not isinstance(item, AttentionBackend):
                raise TypeError(f"backend factory {obj!r}: produced {type(item).__name__}; "
                                "accepted: mha_harness.AttentionBackend instances")
        return items
    raise TypeError(f"backend object: got {type(obj).__name__}; accepted: an AttentionBackend instance, "
                    "subclass, or a callable returning them")


def _entries_from(obj_loader, spec: str, source: str) -> list[BackendEntry]:
    try:
        backends = backends_from_object(obj_loader())
    except Exception as exc:  # noqa: BLE001 - recorded, shown by `list`, never fatal
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return [BackendEntry(name=spec, source=source, spec=spec, error=f"failed to load: {last}")]
    entries = []
    for backend in backends:
        if not isinstance(backend.name, str) or not backend.name:
            entries.append(BackendEntry(spec, source, spec,
                                        error="backend has no name: set the class attribute `name`"))
        else:
            entries.append(BackendEntry(backend.name, source, spec, backend))
    return entries


class Registry:
    """Every known backend by name, with the source it came from."""

    def __init__(self, entries: list[BackendEntry]):
        self.entries: dict[str, BackendEntry] = {}
        for entry in entries:
            other = self.entries.get(entry.name)
            if other is not None:
                if other.spec == entry.spec:  # the same object reached twice (e.g. a plugin re-exporting a built-in)
                    continue
                raise RegistryError(f"backend name {entry.name!r} is registered twice: by {other.source} "
                                    f"and by {entry.source}; rename one of them")
            self.entries[entry.name] = entry

    def names(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> BackendEntry:
        if name not in self.entries:
            raise RegistryError(f"backend: got {name!r}; accepted: one of {', '.join(self.entries)}")
        return self.entries[name]

    def available(self) -> list[BackendEntry]:
        return [e for e in self.entries.values() if e.backend is not None and e.available]


def load_registry(extra_specs=(), *, entry_points: bool = True, builtins: bool = True) -> Registry:
    """Build the registry; malformed ``extra_specs`` raise ValueError (they are the caller's input)."""
    entries: list[BackendEntry] = []
    if builtins:
        for ep in builtin_entry_points():
            entries += _entries_from(ep.load, ep.value, f"built-in {ep.value}")
    if entry_points:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if not _is_builtin(ep):
                entries += _entries_from(ep.load, ep.value, f"entry point {ep.name} = {ep.value}")
    for spec in extra_specs:
        parse_spec(spec)
        entries += _entries_from(lambda s=spec: _resolve(s), spec, f"--backend-spec {spec}")
    return Registry(entries)


def backends_from_spec(spec: str) -> list[AttentionBackend]:
    """Import ``module:object`` and return its backends (used in worker processes)."""
    return backends_from_object(_resolve(spec))
