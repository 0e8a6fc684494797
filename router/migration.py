"""Streaming requests that outlive their worker: when a worker serving a stream dies, hangs or
is drained (WorkerFailed), each unfinished completion goes on, on a healthy worker, from the
tokens its client already has. Nothing is shipped from the failed worker: the new one
prefills prompt plus those tokens (WorkerRequest.num_resumed_tokens) and rebuilds the rest
from them (penalties, min_tokens, the grammar, the text held back for a stop string), and a
seeded row draws what it would have drawn (its draws are a function of seed and position).
A completion of an n > 1 request resumes as an n=1 request of its own, with the seed it draws
from (seed + index). The client's stream goes on with no token twice and none missing.

A request that has no token yet runs again whole; beam search does not migrate (its beams
are not in the stream); with no healthy worker left, or after ``max_migrations``, the failure
reaches the client (UNAVAILABLE).
The client's deadline keeps counting from its call: the migration runs inside it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import cast

from tandem.router.backend import Backend, WorkerFailed
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta

logger = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 2


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass(eq=False)
class _Lane:
    """One backend stream: the whole request (index None), or one completion resumed."""

    index: int | None
    started: float
    """When it started (time.monotonic)."""
    migration: bool
    """Started by a migration, and no token yet (its first measures what the migration added)."""


@dataclass(frozen=True)
class _LaneStart:
    """A lane to start: the backend call that makes its stream."""

    lane: _Lane
    prompt_token_ids: list[int]
    params: SamplingParams
    num_resumed_tokens: int


class MigratingStream:
    """One streaming request's deltas, from as many backend streams as its migrations need."""

    def __init__(self, backend: Backend, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int, max_migrations: int, on_migrated: Callable[[float], None]) -> None:
        self.backend, self.request_id = backend, request_id
        self.prompt_token_ids, self.params, self.priority = prompt_token_ids, params, priority
        self.max_migrations = max_migrations
        self.on_migrated = on_migrated
        self.num_migrations = 0
        self.completions = [_Completion() for _ in range(params.n)]
        # NOTE: one item at most: a lane reads no further ahead of the client than one delta,
        # so that closing the request closes (aborts) every backend stream still going.
        self._queue: asyncio.Queue[tuple[_Lane, StreamDelta | BaseException | None]] = asyncio.Queue(1)
        self._tasks: dict[_Lane, asyncio.Task[None]] = {}

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        lanes = [_LaneStart(_Lane(None, time.monotonic(), False), self.prompt_token_ids, self.params, 0)]
        try:
            # NOTE: one lane (every request, until an n > 1 request's completions resume
            # apart) is read here, inline: no task and no queue between its stream and the
            # client, which are a wake-up more per token.
            while len(lanes) == 1:
                lane, stream = lanes[0].lane, self._stream(lanes[0])
                try:
                    async for got in stream:
                        delta = self._delivered(lane, got)
                        yield delta
                        if delta.request_finished:
                            return
                    return
                except WorkerFailed as e:
                    lanes = self._migrate(lane, e)
                finally:
                    await stream.aclose()  # NOTE: what aborts the lane on its workers when it ends early
            for start in lanes:
                self._start(start)
            while self._tasks:
                lane, item = await self._queue.get()
                if isinstance(item, StreamDelta):
                    delta = self._delivered(lane, item)
                    yield delta
                    if delta.request_finished:
                        return
                    continue
                del self._tasks[lane]
                if isinstance(item, WorkerFailed):
                    for start in self._migrate(lane, item):
                        self._start(start)
                elif item is not None:
                    raise item
        finally:
            await self._stop()

    def _delivered(self, lane: _Lane, delta: StreamDelta) -> StreamDelta:
        delta = self._taken(lane, delta)
        if delta.token_ids and lane.migration:
            self.on_migrated(time.monotonic() - lane.started)
            lane.migration = False
        return delta

    def _taken(self, lane: _Lane, delta: StreamDelta) -> StreamDelta:
        """A lane's delta as the request's: its completion's index and the request's counts."""
        index = delta.index if lane.index is None else lane.index
        completion = self.completions[index]
        completion.token_ids += delta.token_ids
        completion.finished = delta.finish_reason is not None
        return dataclasses.replace(
            delta, request_id=self.request_id, index=index, num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=sum(len(c.token_ids) for c in self.completions),
            num_unfinished=sum(not c.finished for c in self.completions))

    def _migrate(self, lane: _Lane, error: WorkerFailed) -> list[_LaneStart]:
        """The lanes that go on with the failed lane's unfinished completions elsewhere, or
        raise ``error``."""
        # NOTE: no wait for a worker to come back (Ray restarting the only one takes a model
        # load): with no healthy worker to go on, the client hears so at once.
        why = ("beam search does not migrate" if self.params.use_beam_search
               else f"it moved {self.num_migrations} times already (--max-migrations={self.max_migrations})"
               if self.num_migrations >= self.max_migrations
               else "no healthy worker to go on" if not self.backend.is_ready() else None)
        if why is not None:
            raise WorkerFailed(f"{error} ({why})") from None
        started = time.monotonic()
        self.num_migrations += 1
        indexes = range(len(self.completions)) if lane.index is None else [lane.index]
        resumed = [i for i in indexes if not self.completions[i].finished]
        if lane.index is None and not any(self.completions[i].token_ids for i in resumed):
            logger.warning("request %s: %s; running it again elsewhere (migration %d of at most %d)",
                           self.request_id, error, self.num_migrations, self.max_migrations)
            return [_LaneStart(_Lane(None, started, True), self.prompt_token_ids, self.params, 0)]
        starts = []
        for i in resumed:
            tokens = self.completions[i].token_ids
            logger.warning("request %s: %s; completion %d goes on elsewhere after %d tokens (migration %d of at "
                           "most %d)", self.request_id, error, i, len(tokens), self.num_migrations,
                           self.max_migrations)
            params = dataclasses.replace(self.params, n=1, seed=None if self.params.seed is None
                                         else self.params.seed + i)
            starts.append(_LaneStart(_Lane(i, started, True), self.prompt_token_ids + tokens, params, len(tokens)))
        return starts

    def _stream(self, start: _LaneStart) -> AsyncGenerator[StreamDelta, None]:
        return cast(AsyncGenerator[StreamDelta, None], self.backend.generate(
            self.request_id, start.prompt_token_ids, start.params, priority=self.priority,
            num_resumed_tokens=start.num_resumed_tokens))

    def _start(self, start: _LaneStart) -> None:
        """Read the lane by a task of its own, into the request's queue."""
        self._tasks[start.lane] = asyncio.get_running_loop().create_task(self._pump(start.lane, self._stream(start)))

    async def _pump(self, lane: _Lane, stream: AsyncGenerator[StreamDelta, None]) -> None:
        try:
            async for delta in stream:
                await self._queue.put((lane, delta))
            await self._queue.put((lane, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the request's reader
            await self._queue.put((lane, e))
        finally:
            await stream.aclose()  # NOTE: what aborts the lane on its workers when it ends early

    async def _stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()


def generate_migrating(backend: Backend, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, max_migrations: int = DEFAULT_MAX_MIGRATIONS,
                       on_migrated: Callable[[float], None] = lambda seconds: None) -> AsyncIterator[StreamDelta]:
    """backend.generate's deltas, migrating the request when a worker fails it (see the module's
    docstring). on_migrated gets, once per resumed stream, the seconds from the failure to its
    first token: what the migration added to the request's time."""
    return MigratingStream(backend, request_id, prompt_token_ids, params, priority, max_migrations,
                           on_migrated).deltas()
