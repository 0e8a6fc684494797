"""Following one request's output stream from the worker that makes it.

The worker's streaming call (``generate`` on a colocated worker, ``stream`` on a decode
worker) is one Ray call that returns once the request's last delta is sent; the deltas
themselves come over the router's inbox socket (router/delta_inbox.py), one frame each. The
call's end (its return, its error, or its worker marked down) is put in the same queue as
the deltas, so that reading a token costs one queue wake-up and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray

from tandem.router.backend import NoHealthyWorker, WorkerFailed
from tandem.router.delta_inbox import DeltaInbox
from tandem.router.delta_reader import DeltaReader
from tandem.router.policy import WorkerState
from tandem.router.worker_calls import WORKER_GONE, WorkerCalls, short_error
from tandem.worker.api import StreamDelta, WorkerRequest

logger = logging.getLogger(__name__)

LAST_DELTAS_TIMEOUT_S = 10.0
"""How long the deltas still on the wire when a worker's streaming call returned may take."""


@dataclass(frozen=True)
class CallEnded:
    """A streaming call's end, queued behind the deltas that came before it."""

    call: asyncio.Future


def _ended(queue: asyncio.Queue[Any], call: asyncio.Future) -> None:
    if not call.cancelled():
        call.exception()  # retrieved: the stream reads it only if it is still followed
    queue.put_nowait(CallEnded(call))


async def _last(deltas: DeltaReader, request_id: str) -> Any:
    """The next item, once the worker's call has returned: its last deltas are on the wire."""
    try:
        return await asyncio.wait_for(deltas.next(), LAST_DELTAS_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise WorkerFailed(f"{request_id}: its worker's last deltas never came") from None


class WorkerStreams:
    """The router's side of every worker stream."""

    def __init__(self, calls: WorkerCalls, mark_unhealthy: Callable[[WorkerState, BaseException], None]) -> None:
        self.calls = calls
        self.mark_unhealthy = mark_unhealthy
        self.inbox = DeltaInbox()
        """Started on the first stream (on the event loop that reads it); a cluster's router
        replaces it with one on its own address and keys (router/cluster.py)."""

    async def follow(self, streamer: WorkerState, start: Callable[[str], Any], request: WorkerRequest,
                     holders: list[WorkerState], died: list[BaseException] | None = None,
                     failed: list[BaseException] | None = None) -> AsyncIterator[StreamDelta]:
        """Yield the deltas of the streaming call ``start(inbox address)`` makes on
        ``streamer`` (an ObjectRef); on any early exit abort the request on every holder. A
        streamer that dies is marked unhealthy (the request then fails with UNAVAILABLE), and
        so does a request aborted because its prefill worker died (``died``); one aborted
        because its prefill phase failed otherwise (``failed``) ends with that failure, not as
        an abort."""
        if not self.inbox.started:
            self.inbox.start()
        queue = self.inbox.open(request.request_id)  # NOTE: before the call, so no delta comes first
        ref = call = None
        finished = False
        try:
            ref = start(self.inbox.address)
            call = asyncio.ensure_future(self.calls.unless_down(streamer, ref))
            call.add_done_callback(partial(_ended, queue))
            deltas = DeltaReader(queue)
            returned = False
            while True:
                item = await (deltas.next() if not returned else _last(deltas, request.request_id))
                if isinstance(item, CallEnded):
                    error = item.call.exception()
                    if error is not None:
                        raise error
                    returned = True  # the last delta was sent: it is on its way
                    continue
                delta: StreamDelta = item
                if delta.error is not None:
                    raise WorkerFailed(f"{request.request_id}: {delta.error}")
                if delta.finish_reason == "abort" and died:
                    raise WorkerFailed(f"{request.request_id}: the prefill worker is gone: {short_error(died[0])}")
                if delta.finish_reason == "abort" and failed:
                    raise NoHealthyWorker(f"{request.request_id}: prefill failed: {short_error(failed[0])}")
                finished = delta.request_finished  # with n > 1, each completion finishes on its own
                yield delta
                if finished:
                    return
        except WORKER_GONE as e:
            self.mark_unhealthy(streamer, e)
            raise
        finally:
            self.inbox.close(request.request_id)
            if call is not None:
                call.cancel()  # (the wait only)
            if not finished:
                if ref is not None:
                    try:
                        ray.cancel(ref)
                    except Exception:  # noqa: BLE001 - already finished on the worker side
                        pass
                await self.calls.abort_on(holders, request.request_id)
