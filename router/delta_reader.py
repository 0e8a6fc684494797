"""A request's deltas as the router reads them from its inbox: the ones already waiting go as one.

Each delta costs the router the same whatever it holds: a wake-up, an HTTP or gRPC message
written, a client woken. When the router falls behind the engine (on a CPU host it shares
the cores with the step), deltas queue up in its inbox; merging the queued ones into one
costs nothing in latency (each token still leaves as soon as the router can take it) and
makes its work per token shrink exactly when it is short of CPU. A delta is never held back
to wait for another.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, TypeVar

from tandem.worker.api import StreamDelta

T = TypeVar("T")


def can_follow(first: StreamDelta, then: StreamDelta) -> bool:
    """Whether ``then`` may be merged into ``first``: the same completion, and ``first``
    neither finishes it nor carries an error (a finish or an error is always a delta's last)."""
    return (first.index == then.index and first.finish_reason is None and first.error is None
            and first.request_id == then.request_id)


def _joined(a: list[T] | None, b: list[T] | None) -> list[T] | None:
    if a is None and b is None:
        return None
    return [*(a or ()), *(b or ())]


def merge(first: StreamDelta, then: StreamDelta) -> StreamDelta:
    """One delta holding ``first``'s output, then ``then``'s (its counts, finish and error)."""
    return dataclasses.replace(then, token_ids=[*first.token_ids, *then.token_ids], text=first.text + then.text,
                               logprobs=_joined(first.logprobs, then.logprobs),
                               top_logprobs=_joined(first.top_logprobs, then.top_logprobs))


class DeltaReader:
    """Reads a request's queue in the router's inbox (router/delta_inbox.py), where other
    items (a call's end) may come between deltas: those are never merged, and come out in
    their place."""

    def __init__(self, queue: asyncio.Queue[Any]) -> None:
        self._queue = queue
        self._held: Any = None
        """An item taken off the queue that could not be merged: the next one to go."""

    async def next(self) -> Any:
        """The next item (waiting for one); a delta with every delta queued behind it that
        can follow it merged in. The queue's order is kept."""
        item, self._held = self._held, None
        if item is None:
            item = await self._queue.get()
        if not isinstance(item, StreamDelta):
            return item
        delta = item
        while not self._queue.empty():
            then = self._queue.get_nowait()
            if not (isinstance(then, StreamDelta) and can_follow(delta, then)):
                self._held = then
                break
            delta = merge(delta, then)
        return delta
