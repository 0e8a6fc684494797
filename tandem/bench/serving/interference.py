"""How much of the machine other processes took during a run: on a shared 2-core machine a
neighbour's test run can halve a setup's speed, and a run's figures should say so.

Share = (the machine's busy CPU time - the CPU time of this process and the cluster's
workers) / (wall time * cores), over the run. Ray's own daemons count as others (they use
little); 0.1 or more means the run is suspect."""

from __future__ import annotations

import logging
import os
import time

import psutil

logger = logging.getLogger(__name__)

SUSPECT = 0.1
"""A run whose others' share is at least this is flagged in the report."""


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class CpuWatch:
    """Others' share of the CPU between start() and stop(); ``pids``: the workers'."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = []
        for pid in [os.getpid(), *pids]:
            try:
                self.procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                logger.warning("process %d is gone: its CPU time counts as others'", pid)

    def _own_s(self) -> float:
        total = 0.0
        for p in self.procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), _busy_s(), self._own_s()

    def stop(self) -> float:
        """-> others' share of the machine's CPU since start(), 0 to 1."""
        wall = time.monotonic() - self.t0
        others = (_busy_s() - self.busy0) - (self._own_s() - self.own0)
        return max(0.0, min(1.0, others / (wall * (psutil.cpu_count() or 1)))) if wall > 0 else 0.0
