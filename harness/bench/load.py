"""How busy the rest of the machine is while a benchmark times: CPU seconds of other processes.

A figure measured next to other work is slower and noisier than the same call alone; the sweep and
``mha-harness fidelity`` record, per group of points or round, how many cores other processes kept busy
(the whole machine's busy time from /proc/stat, less this process, its finished children and the live
benchmark workers) and the hypervisor's steal time. Linux only; elsewhere the figures are None.
"""
from __future__ import annotations

import os

from mha_harness.bench.worker import cpu_ns

#: other processes keeping more than this many cores busy while a point was timed: its figures come from a
#: loaded machine (the table marks them, bench prints a warning)
LOADED_CORES = 0.25


def fewer_threads_advice(threads: int | None, other_cores: float, cores: int | None) -> str:
    """When a benchmark's ``threads`` and the ``other_cores`` other processes kept busy together exceed the
    machine's ``cores``: the clause saying that fewer threads leave the others a core (threads spinning against them
    made an eleventh stranger's figures ten times slower on a busy 2-core box, a twelfth's fidelity rounds 30 times
    slower than its first); else ''."""
    if not threads or not cores or threads <= 1 or threads + other_cores <= cores:
        return ""
    fewer = max(1, int(cores - other_cores))
    return (f"; {threads} threads and their load need more than this machine's {cores} cores: a rerun with "
            f"--threads {fewer} leaves the others room, for a comparison within that run only (figures of "
            f"another --threads, the committed ones included, are not comparable with it); for figures "
            f"comparable with those, rerun with --threads {threads} once the machine is idle")


def box_cpu_s() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine so far (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def own_cpu_s(worker_pids) -> float:
    """CPU seconds used so far by this process, its finished children and the live workers ``worker_pids``."""
    t = os.times()
    workers = sum((cpu_ns(pid) or 0) for pid in worker_pids if pid is not None) / 1e9
    return t.user + t.system + t.children_user + t.children_system + workers


class LoadMeter:
    """Other processes' CPU between the meter's creation and :meth:`conditions` (a worker restarted in between
    loses its earlier CPU time, so the figure can only err towards "busier"). ``worker_pids``: a callable giving
    the live workers' pids, read at both ends."""

    def __init__(self, worker_pids):
        self.worker_pids = worker_pids
        self.box, self.own = box_cpu_s(), own_cpu_s(worker_pids())

    def conditions(self, seconds: float) -> dict:
        """{seconds, other_cpu_s, steal_s, other_cores}; the last three None where /proc/stat cannot be read.

        ``other_cores`` (other processes' CPU-s per second) is taken from the unrounded figures: a window of a few
        hundredths of a second rounds to 0.0 s and 0.0 CPU-s, and its ratio must not be lost with them."""
        box, own = box_cpu_s(), own_cpu_s(self.worker_pids())
        out = {"seconds": round(seconds, 1), "other_cpu_s": None, "steal_s": None, "other_cores": None}
        if self.box and box:
            other = max(0.0, (box[0] - self.box[0]) - (own - self.own))
            out["other_cpu_s"] = round(other, 1)
            out["steal_s"] = round(box[1] - self.box[1], 2)
            out["other_cores"] = round(other / seconds, 2) if seconds > 0 else None
        return out
