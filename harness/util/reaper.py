"""Processes that plugin code started and left running, ended when the ``mha-harness`` command ends.

Workers run plugin code in their own process group, killed when the worker ends. But some plugin code runs in
the harness's own process (importing a plugin, constructing it, ``availability()``; everything with
``--no-isolate``), and a child it starts there inherits the harness's stdout: a CI step that captures the
output would wait for it. And a child that leaves its worker's group (``setsid``) escapes the group kill.

So the command, when it is the whole program (``mha-harness ...`` / ``python -m mha_harness``):

1. declares itself a *child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): a process whose parent dies
   (a worker's double-forked or ``setsid`` grandchild) is re-parented to the harness instead of to init, so it
   stays findable;
2. at its end, kills every remaining descendant (found through ``/proc``), except multiprocessing's own
   resource tracker, and reaps them.

Not covered: platforms without ``/proc`` or ``prctl`` (the kill then reaches only direct descendants found in
``/proc``, or nothing), and a process that plugin code hands to another service (``systemd-run``, ``at``...).
The harness's Python API (``mha_harness.check``) never does this: the calling process's children are its own.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); True when it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, tuple[int, bool]]:
    """pid -> (parent pid, is a zombie) of every process visible in /proc."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) >= 2:
            out[int(name)] = (int(fields[1]), fields[0] == b"Z")
    return out


def descendants(pid: int, *, zombies: bool = False) -> list[int]:
    """Every descendant of ``pid`` (children first) from /proc, zombies (dead, not yet reaped) only if asked;
    empty where there is no /proc."""
    children: dict[int, list[int]] = {}
    table = _parents()
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        current = todo.pop(0)
        if zombies or not table[current][1]:
            out.append(current)
        todo += children.get(current, [])
    return out


def _harness_helpers() -> set[int]:
    """Processes the harness's own machinery keeps: multiprocessing's resource tracker and the fork server the
    isolated workers start from (each exits by itself when this process ends and closes its pipe)."""
    keep = set()
    try:
        from multiprocessing import forkserver, resource_tracker
    except ImportError:  # pragma: no cover
        return keep
    for pid in (getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None),
                getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)):
        if pid:
            keep.add(pid)
    return keep


def kill_leftovers(keep=()) -> list[int]:
    """SIGKILL every descendant of this process but ``keep`` and the harness's helpers; reap them; their pids."""
    spared = set(keep) | _harness_helpers()
    everything = [p for p in descendants(os.getpid(), zombies=True) if p not in spared]
    victims = [p for p in descendants(os.getpid()) if p not in spared]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    pending = set(everything)  # the dead but unreaped too
    while pending and time.monotonic() < deadline:  # reap the ones that are (now) our children
        for pid in list(pending):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child (its own parent reaps it) or already reaped
                pending.discard(pid)
                continue
            if done:
                pending.discard(pid)
        if pending:
            time.sleep(0.02)
    return victims
