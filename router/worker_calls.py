"""Calls on workers that never leave a request waiting on a worker the router has given up
on: every wait is raced against the worker being marked down (dead, or not answering),
aborts have a deadline, and a worker that is down still gets its aborts, in the background,
for when it answers again. A hung worker (stopped, stuck in a driver call) is as bad as a
dead one, and Ray restarts only the dead: the router must notice the hung itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from ray.exceptions import RayActorError, RayTaskError

from tandem.router.policy import WorkerState
from tandem.worker.api import EngineDown

logger = logging.getLogger(__name__)

T = TypeVar("T")

ABORT_TIMEOUT_S = 5.0
"""An abort a healthy worker has not answered by then is given up on by the request (it may
have just died: a restarted worker holds nothing of the request anyway)."""
LATE_CALL_TIMEOUT_S = 300.0
"""How long a call left to a worker that is down (an abort, undoing a reservation) is
kept for it: it lands if the worker answers again (resumed, or restarted: then it is a no-op)."""


class WorkerDown(RuntimeError):
    """The router marked the worker down while a call on it was waited for."""


MAX_ERROR_CHARS = 200

WORKER_GONE = (RayActorError, WorkerDown, EngineDown)
"""What a call on a worker raises when the worker is gone (dead, given up on, or its engine
stopped on an error)."""


def short_error(e: BaseException) -> str:
    """A worker's error as one short line for clients and logs: the remote cause's message,
    never Ray's traceback with its pids, addresses and paths."""
    if isinstance(e, RayTaskError) and getattr(e, "cause", None) is not None:
        e = e.cause
    if isinstance(e, RayActorError):
        return "its process is gone"
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:MAX_ERROR_CHARS]


class WorkerCalls:
    """Waits on workers that end when their worker is marked down, and calls left behind."""

    def __init__(self) -> None:
        self._down: dict[str, asyncio.Event] = {}
        """Per worker instance: set when it is marked down."""
        self._background: set[asyncio.Task] = set()

    def went_down(self, w: WorkerState) -> None:
        self._event(w).set()

    def came_back(self, w: WorkerState) -> None:
        self._down.pop(w.instance, None)  # waits from now on get a fresh event

    async def unless_down(self, w: WorkerState, call: Awaitable[T]) -> T:
        """Await a call on `w`; raise WorkerDown as soon as `w` is marked down instead."""
        down = self._event(w)
        answer = asyncio.ensure_future(call)
        if down.is_set() or not w.healthy:
            answer.cancel()
            raise WorkerDown(f"worker {w.instance} is down")
        signal = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait((answer, signal), return_when=asyncio.FIRST_COMPLETED)
        finally:
            signal.cancel()
            if not answer.done():
                answer.cancel()  # cancels the wait only: the worker may still run the call
        if answer.done() and not answer.cancelled():
            return answer.result()
        raise WorkerDown(f"worker {w.instance} went down")

    async def abort_on(self, workers: list[WorkerState], request_id: str) -> list[Any]:
        """Abort a request on each of `workers`: the healthy ones are waited for (each given
        ABORT_TIMEOUT_S) -> their answers or exceptions; the others get it in the background."""
        async def one(w: WorkerState) -> Any:
            return await asyncio.wait_for(w.handle.abort.remote(request_id), ABORT_TIMEOUT_S)
        for w in workers:
            if not w.healthy:
                self.later(w.handle.abort.remote(request_id), f"abort of {request_id} on {w.instance}")
        return list(await asyncio.gather(*(one(w) for w in workers if w.healthy), return_exceptions=True))

    def later(self, call: Awaitable[Any], what: str) -> asyncio.Task:
        """Let `call` finish in the background (for up to LATE_CALL_TIMEOUT_S); its outcome
        only goes to the log."""
        async def wait() -> Any:
            try:
                return await asyncio.wait_for(call, LATE_CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the worker died or never came back: nothing is held there
                logger.debug("%s: %s", what, e)
                return e
        task = asyncio.get_running_loop().create_task(wait())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _event(self, w: WorkerState) -> asyncio.Event:
        return self._down.setdefault(w.instance, asyncio.Event())
