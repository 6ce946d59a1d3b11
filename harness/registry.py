"""The registry of attention backends.

Sources, in order: the built-in backends (the entry points mha-harness itself declares in the group
``mha_harness.backends``: one list, in pyproject.toml), every other entry point in that group, and any
``module:object`` named on the command line or in Python. An object may be a backend instance, a backend class
(constructed without arguments) or a callable returning one backend or an iterable of them (one entry point
can register several kernels). Two backends with one name is an error naming both sources.

Plugin code never decides the fate of the run. Importing, constructing and ``availability()``
run under :func:`mha_harness.util.guard.call_guarded`: any ``BaseException`` (``SystemExit`` from
``sys.exit(0)`` at import or the spec ``sys:exit``, a ``KeyboardInterrupt`` raised by the plugin)
or a hang past the plugin timeout (20 s, ``$MHA_HARNESS_PLUGIN_TIMEOUT``) becomes that source's
recorded error ("import timed out after 20 s"), shown by ``list`` and failing ``check``.
Third-party sources (anything outside ``mha_harness.``) are first imported in a throw-away
subprocess with the same timeout, so one that kills or hangs its process is refused before it
is imported here; only those that came back are imported in this process, once: the outcome of
each spec is remembered for the life of the process. Built-ins are imported directly (no probe,
no timeout) but under the same exception guard.
"""
from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, replace
from importlib import metadata

from mha_harness.contract.api import AttentionBackend
from mha_harness.util.guard import PluginFault, call_guarded, plugin_timeout, run_python_isolated
from mha_harness.util.options import did_you_mean

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
    """One registered backend, or one source that failed to produce any.

    ``reason`` is the backend's ``availability()`` answer, asked once when the entry is made."""

    name: str
    source: str
    spec: str
    backend: AttentionBackend | None = None
    error: str | None = None
    reason: str | None = None

    @property
    def reason_unavailable(self) -> str | None:
        return self.error or self.reason

    @property
    def available(self) -> bool:
        return self.reason_unavailable is None


def is_trusted(spec: str) -> bool:
    """The harness's own code (``mha_harness.…``): imported without the subprocess probe or a timeout."""
    return isinstance(spec, str) and spec.startswith("mha_harness.")


def availability_of(backend: AttentionBackend, timeout: float | None = -1.0) -> tuple[str | None, str | None]:
    """Ask ``backend.availability()`` under the guard: (reason it is unavailable, plugin error).

    A reason string is a legitimate answer ("no CUDA device"); raising anything, hanging past ``timeout``
    seconds (default: the plugin timeout) or answering something other than None or a string is the
    plugin's error, which fails a run that requested it."""
    timeout = plugin_timeout() if timeout == -1.0 else timeout
    try:
        reason = call_guarded(backend.availability, "availability()", timeout)
    except PluginFault as fault:
        return None, f"failed to load: {fault}"
    if reason is not None and not isinstance(reason, str):
        return None, f"failed to load: availability() returned {type(reason).__name__}; accepted: None or a string"
    return reason, None


def availability_reason(backend: AttentionBackend, timeout: float | None = -1.0) -> str | None:
    """None when usable here, else why not (a reason, or the plugin's error; see :func:`availability_of`)."""
    reason, error = availability_of(backend, timeout)
    return error or reason


def parse_spec(spec: str) -> tuple[str, str]:
    """Split ``package.module:object``; a malformed spec is a ValueError naming the accepted form."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ValueError(f"backend spec: got {spec!r}; accepted: 'package.module:object' "
                         "(a dotted module path, a colon, an attribute name)")
    module, attr = spec.split(":")
    return module, attr


def _resolve(spec: str):
    module_name, attr = parse_spec(spec)
    importlib.import_module("mha_harness").load_core()  # the integrity snapshot, before any plugin is imported
    module = obj = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            shadow = _namespace_shadow(module)
            if shadow:
                raise AttributeError(f"{exc}: {shadow}") from None
            raise
    return obj


def _namespace_shadow(module) -> str:
    """Why a module has none of the attributes a spec names, when it is a namespace package (a folder without
    __init__.py, e.g. a plugin's project folder in the current directory, which is imported first): "" otherwise.
    Two outside users ran mha-harness beside their project folders and read only "module 'x' has no attribute"."""
    if getattr(module, "__file__", None) is not None:
        return ""
    places = list(dict.fromkeys(getattr(getattr(module, "__spec__", None), "submodule_search_locations", None) or []))
    if not places:
        return ""
    return (f"'{module.__name__}' was imported as a namespace package (a folder without __init__.py) from "
            f"{', '.join(places)}, which shadows any installed package of that name (the current folder and the "
            "script's are searched first); run mha-harness from another folder, or give the folder an __init__.py "
            "that defines it")


def backends_from_object(obj) -> list[AttentionBackend]:
    """Turn an instance, class or factory into backends; anything else is a TypeError naming what it got."""
    if isinstance(obj, AttentionBackend):
        return [obj]
    if isinstance(obj, type) and issubclass(obj, AttentionBackend):
        return [obj()]
    if callable(obj) and not isinstance(obj, type):
        produced = obj()
        if isinstance(produced, AttentionBackend):
            items = [produced]
        elif isinstance(produced, (list, tuple)) or hasattr(produced, "__next__"):
            items = list(produced)
        else:
            raise TypeError(f"backend factory {obj!r}: returned {type(produced).__name__}; "
                            "accepted: an AttentionBackend or a list of them")
        for item in items:
            if not isinstance(item, AttentionBackend):
                raise TypeError(f"backend factory {obj!r}: produced {type(item).__name__}; "
                                "accepted: mha_harness.AttentionBackend instances")
        return items
    raise TypeError(f"backend object: got {type(obj).__name__}; accepted: an AttentionBackend instance, "
                    "subclass, or a callable returning them")


#: spec -> the imported object, or the one-line reason it could not be imported (once per process)
_IMPORTED: dict[str, tuple[object, str | None]] = {}
#: spec -> None when the probe subprocess imported it, else the reason (once per process)
_PROBED: dict[str, str | None] = {}

_PROBE = """
import json, sys
spec, out = sys.argv[1], sys.argv[2]
try:
    from mha_harness.registry import _probe_in_this_process
    result = _probe_in_this_process(spec)
except BaseException as exc:  # noqa: BLE001
    result = {"error": f"{type(exc).__name__}: {exc}"}
with open(out, "w", encoding="utf-8") as handle:
    json.dump(result, handle)
"""


def _probe_in_this_process(spec: str) -> dict:
    """What the probe subprocess runs: import, construct, name and ask availability, all guarded."""
    timeout = plugin_timeout()
    try:
        obj = call_guarded(lambda: _resolve(spec), "import", timeout)
        backends = call_guarded(lambda: backends_from_object(obj), "constructing the backend", timeout)
        return {"names": [str(call_guarded(lambda b=b: b.name, "name", timeout)) for b in backends]}
    except PluginFault as fault:
        return {"error": str(fault)}


def _probe(spec: str) -> str | None:
    """Import ``spec`` in a throw-away subprocess under the plugin timeout: None if it came back, else why not."""
    if spec not in _PROBED:
        text, failure = run_python_isolated(_PROBE, [spec], plugin_timeout())
        if failure is not None:
            _PROBED[spec] = f"import {failure}" if "timed out" in failure else f"probing the import: {failure}"
        else:
            try:
                _PROBED[spec] = json.loads(text).get("error")
            except (ValueError, AttributeError):
                _PROBED[spec] = "probing the import: the probe process wrote no readable report"
    return _PROBED[spec]


def probe_all(specs) -> None:
    """Probe every third-party spec not probed yet, a few subprocesses at a time (the answers are remembered)."""
    todo = [s for s in dict.fromkeys(specs) if not is_trusted(s) and s not in _PROBED and s not in _IMPORTED]
    if len(todo) < 2:
        return
    import threading
    slots = threading.Semaphore(4)

    def one(spec):
        with slots:
            _probe(spec)

    # daemon threads: a Ctrl-C here ends the run at once (each probe's process group dies with its timeout)
    threads = [threading.Thread(target=one, args=(spec,), daemon=True, name=f"plugin-probe {spec}") for spec in todo]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)


def _import_once(spec: str):
    """The object ``spec`` names, imported once per process; PluginFault with the reason otherwise."""
    if spec not in _IMPORTED:
        timeout = None if is_trusted(spec) else plugin_timeout()
        error = None if timeout is None else _probe(spec)
        obj = None
        if error is None:
            try:
                obj = call_guarded(lambda: _resolve(spec), "import", timeout)
            except PluginFault as fault:
                error = str(fault)
        _IMPORTED[spec] = (obj, error)
    obj, error = _IMPORTED[spec]
    if error is not None:
        raise PluginFault(error)
    return obj


def entries_for_spec(spec: str, source: str, failed_name: str | None = None) -> list[BackendEntry]:
    """The registry entries one source produces, each with its availability; a source that fails to
    import, construct or name itself (any exception, or a hang) is one entry carrying that error, named
    ``failed_name`` (an entry point's own name, which its users pass to --backend) or else the spec."""
    timeout = None if is_trusted(spec) else plugin_timeout()
    try:
        obj = _import_once(spec)
        backends = call_guarded(lambda: backends_from_object(obj), "constructing the backend", timeout)
        named = [(call_guarded(lambda b=b: b.name, "name", timeout), b) for b in backends]
    except PluginFault as fault:
        return [BackendEntry(name=failed_name or spec, source=source, spec=spec, error=f"failed to load: {fault}")]
    entries = []
    for name, backend in named:
        if not isinstance(name, str) or not name:
            entries.append(BackendEntry(spec, source, spec,
                                        error="backend has no name: set the class attribute `name`"))
        else:
            reason, error = availability_of(backend, timeout)
            entries.append(BackendEntry(name, source, spec, backend, error=error, reason=reason))
    return entries


class Registry:
    """Every known backend by name, with the source it came from."""

    def __init__(self, entries: list[BackendEntry]):
        self.entries: dict[str, BackendEntry] = {}
        for entry in entries:
            other = self.entries.get(entry.name)
            if other is not None and entry.backend is None and entry.name != entry.spec:
                # a source that failed to load, named after its entry point, yields a name taken: its spec then
                entry = replace(entry, name=entry.spec)
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
            raise RegistryError(f"backend: got {name!r}; {did_you_mean(name, self.entries)}accepted: one of "
                                f"{', '.join(self.entries)}")
        return self.entries[name]

    def available(self) -> list[BackendEntry]:
        return [e for e in self.entries.values() if e.backend is not None and e.available]

    def by_default(self) -> list[BackendEntry]:
        """The entries that run when no backend is named: all but those whose backend declares ``opt_in``."""
        return [e for e in self.entries.values() if opt_in_reason(e) is None]

    def opted_out(self) -> list[BackendEntry]:
        """Available entries left out of a run that names no backend (``opt_in``), each runs when named."""
        return [e for e in self.available() if opt_in_reason(e) is not None]


def opt_in_reason(entry: BackendEntry) -> str | None:
    """Why the entry's backend runs only when named, or None (a plugin's attribute: only a non-empty str counts)."""
    reason = getattr(entry.backend, "opt_in", None) if entry.backend is not None else None
    return reason if isinstance(reason, str) and reason else None


def load_registry(extra_specs=(), *, entry_points: bool = True, builtins: bool = True) -> Registry:
    """Build the registry; malformed ``extra_specs`` raise ValueError (they are the caller's input)."""
    if isinstance(extra_specs, str):
        extra_specs = [extra_specs]
    if not isinstance(extra_specs, (list, tuple, set, frozenset)):
        raise TypeError(f"extra_specs: got {type(extra_specs).__name__}; accepted: a list of "
                        "'package.module:object' strings")
    extra_specs = list(extra_specs)
    for spec in extra_specs:
        parse_spec(spec)
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if not _is_builtin(ep)] if entry_points else []
    probe_all([ep.value for ep in eps] + extra_specs)
    entries: list[BackendEntry] = []
    if builtins:
        for ep in builtin_entry_points():
            entries += entries_for_spec(ep.value, f"built-in {ep.value}")
    for ep in eps:
        entries += entries_for_spec(ep.value, f"entry point {ep.name} = {ep.value}", failed_name=ep.name)
    for spec in extra_specs:
        entries += entries_for_spec(spec, f"--backend-spec {spec}")
    return Registry(entries)


def backends_from_spec(spec: str) -> list[AttentionBackend]:
    """Import ``module:object`` and return its backends (used in worker processes, which are isolated)."""
    return backends_from_object(_resolve(spec))
