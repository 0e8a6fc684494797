"""What ``tandem bench overload`` watches on its cluster while it runs: the resident memory of
the router's process and of every worker process, the router's calls in progress, the CPU
that other processes on the machine take from them, and the workers' inventories (whether
they hold anything once the load is gone)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from tandem.worker.api import WorkerInventory

logger = logging.getLogger(__name__)

ROUTER = "router"
"""The process name of this process in the samples: the router and the load generator."""
MIB = 2**20
INVENTORY_TIMEOUT_S = 10.0
"""A worker that does not answer its inventory call by then counts as not empty."""


@dataclass(frozen=True)
class Sample:
    t_s: float
    """Seconds from the watch's start."""
    rss_mib: dict[str, float | None]
    """Resident memory of each process by name (None: it had gone)."""
    in_progress: int
    """The router's Generate calls in progress at the sample."""
    in_progress_peak: int
    """The most calls in progress seen since the previous sample (polled every poll_s)."""
    other_cpu_cores: float
    """Cores busy since the previous sample with processes other than the watched ones (other
    work on this machine: the latencies measured meanwhile are only comparable when it is)."""


class Watch:
    """Samples every ``interval_s`` the memory of ``pids`` ({name: pid}, this process added as
    "router") and ``in_progress()``; polls ``in_progress()`` every ``poll_s`` for its peak, so
    that a burst between two samples is not missed. Logs a progress line every ``log_every_s``.
    Use as ``async with``; ``mark(phase)`` records when a phase starts."""

    def __init__(self, pids: dict[str, int], in_progress: Callable[[], int], interval_s: float = 1.0,
                 poll_s: float = 0.05, log_every_s: float = 10.0) -> None:
        self._processes = {ROUTER: psutil.Process(), **{name: psutil.Process(pid) for name, pid in pids.items()}}
        self._other_cpu_cores()  # psutil's CPU figures count from the previous call
        self._in_progress = in_progress
        self.interval_s, self.poll_s, self.log_every_s = interval_s, poll_s, log_every_s
        self.samples: list[Sample] = []
        self.phases: dict[str, float] = {}
        """Phase name -> its start, seconds from the watch's start."""
        self._start = time.perf_counter()
        self._peak = 0
        """The most calls in progress since the last sample."""
        self._task: asyncio.Task | None = None

    def now(self) -> float:
        """Seconds from the watch's start (the samples' clock)."""
        return time.perf_counter() - self._start

    def mark(self, phase: str) -> None:
        self.phases[phase] = self.now()
        logger.info("%s: starting at +%.1f s", phase, self.phases[phase])

    def _rss(self) -> dict[str, float | None]:
        rss: dict[str, float | None] = {}
        for name, process in self._processes.items():
            try:
                rss[name] = process.memory_info().rss / MIB
            except psutil.NoSuchProcess:
                # A worker Ray restarted runs under another pid: its memory is no longer known.
                rss[name] = None
        return rss

    def _other_cpu_cores(self) -> float:
        """Cores busy outside the watched processes since the previous call."""
        busy = psutil.cpu_percent() / 100 * (psutil.cpu_count() or 1)
        ours = 0.0
        for process in self._processes.values():
            try:
                ours += process.cpu_percent() / 100
            except psutil.NoSuchProcess:
                pass  # a restarted worker: its CPU counts as others' from then on
        return max(0.0, busy - ours)

    def _sample(self) -> Sample:
        """Record a sample now; the peak starts again from the calls in progress now."""
        in_progress = self._in_progress()
        sample = Sample(self.now(), self._rss(), in_progress, max(self._peak, in_progress), self._other_cpu_cores())
        self.samples.append(sample)
        self._peak = in_progress
        return sample

    async def _run(self) -> None:
        next_sample, next_log = 0.0, 0.0
        while True:
            now = self.now()
            self._peak = max(self._peak, self._in_progress())
            if now >= next_sample:
                sample = self._sample()
                next_sample = _next_tick(next_sample, now, self.interval_s)
                if now >= next_log:
                    next_log = _next_tick(next_log, now, self.log_every_s)
                    memory = ", ".join(f"{name} {'-' if v is None else f'{v:.0f}'}"
                                       for name, v in sample.rss_mib.items())
                    phase = list(self.phases)[-1] if self.phases else "start"
                    logger.info("+%.0f s (%s): %d calls in progress (peak %d), RSS MiB: %s; other processes: "
                                "%.1f cores", now, phase, sample.in_progress, sample.in_progress_peak, memory,
                                sample.other_cpu_cores)
            await asyncio.sleep(self.poll_s)

    async def __aenter__(self) -> Watch:
        self._task = asyncio.create_task(self._run(), name="tandem-overload-watch")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sample()


def _next_tick(tick: float, now: float, interval: float) -> float:
    """The first tick after ``now`` on the grid ``tick + k * interval``: a loop that fell
    behind skips the ticks it missed instead of sampling in a burst."""
    return tick + interval * (1 + (now - tick) // interval)


async def worker_pids(workers) -> dict[str, int]:
    """{instance: process id} of each worker (``WorkerState``s of a RayBackend)."""
    pids = await asyncio.gather(*(w.handle.pid.remote() for w in workers))
    return {w.instance: pid for w, pid in zip(workers, pids)}


async def inventories(workers) -> list[WorkerInventory | None]:
    """Every worker's inventory; None for one that did not answer within INVENTORY_TIMEOUT_S."""
    async def one(w) -> WorkerInventory | None:
        try:
            return await asyncio.wait_for(w.handle.inventory.remote(), INVENTORY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None

    return list(await asyncio.gather(*(one(w) for w in workers)))


async def wait_until_empty(workers, timeout_s: float, poll_s: float = 0.1) -> dict[str, list[str]]:
    """Poll the workers' inventories until every one holds nothing, at most ``timeout_s``
    -> what each worker still holds at the end ({} when all are empty)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {w.instance: ["no answer"] if inv is None else inv.leaks()
                for w, inv in zip(workers, await inventories(workers)) if inv is None or not inv.is_empty}
        if not held or time.monotonic() >= deadline:
            return held
        await asyncio.sleep(poll_s)
