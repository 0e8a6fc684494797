"""The router's view of its workers' health: it polls each one's heartbeat and load, routes
around the dead and the hung, has a worker hung for too long killed for Ray to restart, and
takes back those that answer again once their backoff is over."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import ray
from ray.exceptions import RayActorError

from tandem.router.policy import WorkerState
from tandem.router.worker_calls import WORKER_GONE, WorkerCalls, short_error
from tandem.worker.api import WorkerLoad

logger = logging.getLogger(__name__)

LOAD_POLL_S = 0.1
LOAD_TIMEOUT_S = 2.0
"""A worker's load call that takes longer is left for the next poll (a restarting worker's
calls wait for it), so that one worker never holds up the others' loads."""
UNRESPONSIVE_S = 15.0
"""A worker whose heartbeat has not answered for this long, or whose engine loop has not gone
round for this long, is marked down (hung: stopped, or stuck), and the requests waiting on it
fail; it comes back once it answers again. (Load polls may wait behind request traffic: only
the heartbeat, answered off the engine loop, tells busy from hung.)"""
RESTART_HUNG_S = 120.0
"""A worker silent (or its engine stuck) this long is killed, and Ray restarts it: a hang
that does not end by itself (a driver call, a collective whose peer died) needs a new process."""


class WorkerHealth:
    def __init__(self, workers: list[WorkerState], decode: list[WorkerState], calls: WorkerCalls,
                 room_freed: Callable[[], None], unresponsive_after_s: float = UNRESPONSIVE_S,
                 restart_hung_after_s: float = RESTART_HUNG_S) -> None:
        """decode: the workers whose free blocks rising means KV room (room_freed is called);
        calls: whose waits end when a worker goes down."""
        self.workers = workers
        self.decode = decode
        self.calls = calls
        self.room_freed = room_freed
        self.unresponsive_after_s = unresponsive_after_s
        self.restart_hung_after_s = restart_hung_after_s
        self._poller: asyncio.Task | None = None

    def add(self, w: WorkerState) -> None:
        """Poll a worker that joined (its pool's list, e.g. `decode`, is the caller's)."""
        w.last_answer = asyncio.get_running_loop().time()
        self.workers.append(w)

    def start(self) -> None:
        """Keep worker loads (and health) fresh in the background."""
        now = asyncio.get_running_loop().time()
        for w in self.workers:
            w.last_answer = now

        async def poll() -> None:
            while True:
                await self.refresh()
                await asyncio.sleep(LOAD_POLL_S)
        self._poller = asyncio.get_running_loop().create_task(poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None

    async def refresh(self) -> None:
        """Each worker's heartbeat and load: one that answers is healthy again (e.g. restarted
        by Ray) once its backoff is over; a dead or hung one is marked down; a busy one (its
        load late, its heartbeat not) keeps its state."""
        await asyncio.gather(*(self._refresh(w) for w in self.workers))

    async def _refresh(self, w: WorkerState) -> None:
        stuck_s: float | None = None
        load: WorkerLoad | None = None
        poll = w.begin_poll()
        try:
            stuck_s = await asyncio.wait_for(w.handle.heartbeat.remote(), LOAD_TIMEOUT_S)
            load = await asyncio.wait_for(w.handle.load.remote(), LOAD_TIMEOUT_S)
        except WORKER_GONE as e:
            self.mark_down(w, e)
            return
        except asyncio.TimeoutError:
            pass
        now = asyncio.get_running_loop().time()
        if load is not None or (stuck_s is not None and stuck_s < self.unresponsive_after_s):
            w.last_answer = now
        silent_s = now - w.last_answer
        if silent_s >= self.unresponsive_after_s:
            self.mark_down(w, f"is hung: no heartbeat or engine progress for {silent_s:.0f} s")
            if silent_s >= self.restart_hung_after_s:
                logger.error("worker %s hung for %.0f s: killing its process for Ray to restart it",
                             w.instance, silent_s)
                ray.kill(w.handle, no_restart=False)
                w.last_answer = now  # its restart gets a full bound before another kill
            return
        if load is None:
            return
        if w in self.decode and (w.load is None or load.num_free_blocks > w.load.num_free_blocks):
            self.room_freed()
        w.load_reported(load, poll)
        if w.may_recover(now):
            w.recover(now)
            self.room_freed()
            self.calls.came_back(w)
            logger.warning("worker %s is serving again", w.instance)

    def mark_down(self, w: WorkerState, why: str | BaseException = "died") -> None:
        """Route nothing more to `w` (dead or hung, never for a refused request) and end the
        waits on it, until it answers a load poll again after its backoff. why: a reason, or
        the error a call on it raised."""
        if isinstance(why, BaseException):
            why = "died" if isinstance(why, RayActorError) else f"is down: {short_error(why)}"
        if w.mark_down(asyncio.get_running_loop().time()):
            self.calls.went_down(w)
            logger.warning("worker %s %s (failure %d in a row): routing around it for at least %.0f s",
                           w.instance, why, w.num_failures, w.retry_at - asyncio.get_running_loop().time())
