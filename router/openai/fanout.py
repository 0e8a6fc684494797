"""The prompts of one OpenAI request run at once: each through its own ``RequestRelay.relay``
(its own request on the workers, its own metrics), their deltas handed to the front door one
at a time, each tagged with its prompt's index.

A delta counts as sent (for the request metrics) once the front door asks for the next one,
as with a single relay, and a prompt's run waits for that before it reads on: a slow client
slows every prompt alike, and nothing piles up in the router. The first prompt to fail ends
the whole iteration with its ``RequestFailed``; leaving the ``async with`` block, however
(done, failed, the client gone, the handler cancelled), cancels every run still going, which
closes its backend stream: the workers abort it and free its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType

from tandem.router.metrics import RequestTimer
from tandem.router.relay import RequestFailed, RequestRelay, failure_of
from tandem.router.validation import ValidRequest
from tandem.worker.api import StreamDelta

_Item = tuple[int, StreamDelta | RequestFailed | None, "asyncio.Future[None] | None"]


class PromptRuns:
    """``async with PromptRuns(...) as runs: async for prompt_index, delta in runs: ...``"""

    def __init__(self, relay: RequestRelay, requests: Sequence[ValidRequest], timers: Sequence[RequestTimer], *,
                 buffered: bool) -> None:
        """requests: one per prompt, each with its timer (its place among max_concurrent_requests).
        buffered: each runs through ``generate_buffered`` (one merged delta per completion at
        its end; a worker failing it midway runs it again)."""
        if len(requests) != len(timers) or not requests:
            raise ValueError("PromptRuns needs one timer per request, and at least one request")
        self._relay = relay
        self._requests = list(requests)
        self._timers = list(timers)
        self._buffered = buffered
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._taken: asyncio.Future[None] | None = None
        self._num_running = len(requests)
        self.finished: list[StreamDelta | None] = [None] * len(requests)
        """Each prompt's last delta (its usage) once its run ended OK."""

    async def __aenter__(self) -> PromptRuns:
        self._tasks = [asyncio.create_task(self._run(i), name=f"prompt {i} of {self._requests[0].request_id}")
                       for i in range(len(self._requests))]
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        for task in self._tasks:
            task.cancel()  # a no-op for those done; the rest close their streams (abort)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def __aiter__(self) -> PromptRuns:
        return self

    async def __anext__(self) -> tuple[int, StreamDelta]:
        if self._taken is not None and not self._taken.done():
            self._taken.set_result(None)  # the last delta went out: its run reads on
        self._taken = None
        while self._num_running:
            index, item, taken = await self._queue.get()
            if isinstance(item, RequestFailed):
                raise item
            if taken is None:  # the run ended OK; item is its last delta
                self._num_running -= 1
                self.finished[index] = item
                continue
            assert item is not None  # a delta: it comes with its taken future
            self._taken = taken
            return index, item
        raise StopAsyncIteration

    async def _run(self, index: int) -> None:
        request = self._requests[index]
        loop = asyncio.get_running_loop()
        try:
            async with self._relay.relay(request, self._timers[index], buffered=self._buffered) as deltas:
                async for delta in deltas:
                    taken: asyncio.Future[None] = loop.create_future()
                    self._queue.put_nowait((index, delta, taken))
                    await taken
            self._queue.put_nowait((index, deltas.finished, None))
        except RequestFailed as failure:
            self._queue.put_nowait((index, failure, None))
        except Exception as e:  # noqa: BLE001 - never leave the reader waiting on a run that died
            self._queue.put_nowait((index, failure_of(request.request_id, e), None))
