"""CPU time per thread of a set of processes, from /proc (Linux): where a served request's
cycles go (the engine loop, Ray's threads, the router's event loop, gRPC's pollers...).

A snapshot reads every thread's user + system clock ticks and its name; the difference of
two snapshots, grouped by process and thread name, says who took the CPU between them.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ThreadKey:
    """A thread, named as top -H names it, in its process (``label``: what the process is)."""

    label: str
    pid: int
    name: str


def _thread_ticks(pid: int) -> dict[tuple[int, str], int]:
    """(tid, name) -> user + system ticks, for each thread of ``pid`` (empty when it is gone)."""
    out: dict[tuple[int, str], int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        # "tid (name) state ..." where the name may hold spaces and parentheses: split at the last ')'.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[(int(tid), name)] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return out


def snapshot(processes: dict[int, str]) -> dict[ThreadKey, int]:
    """Every thread's ticks so far, of ``processes`` (pid -> label)."""
    ticks: dict[ThreadKey, int] = {}
    for pid, label in processes.items():
        for (tid, name), t in _thread_ticks(pid).items():
            # Keyed by tid too, so that two threads of one name are summed below, not overwritten.
            ticks[ThreadKey(label, pid, f"{name}#{tid}")] = t
    return ticks


def cpu_by_thread(before: dict[ThreadKey, int], after: dict[ThreadKey, int]) -> list[tuple[str, str, float]]:
    """-> (process label, thread name, CPU seconds) between two snapshots, threads of one name
    in one process summed, the busiest first; threads that did not run are left out."""
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    for key, t in after.items():
        used = t - before.get(key, 0)
        if used > 0:
            seconds[(f"{key.label} {key.pid}", key.name.rsplit("#", 1)[0])] += used / CLOCK_TICKS
    return sorted(((label, name, s) for (label, name), s in seconds.items()), key=lambda r: -r[2])
