"""A request's deltas on their way out of a worker: handed to their reader's send function
on the thread that publishes them (the engine loop's), with no event loop in between.

Each token used to wake the worker's actor thread (a queue put from the engine thread, then
the actor's event loop sending the delta on); on a CPU host that wake-up is taken from the
step's cores. Now the engine thread sends each delta itself (a few microseconds: it encodes
one frame and queues it on a ZMQ socket) and the reader's event loop wakes once, when the
request's last delta has gone.

NOTE: the reader may come after the first deltas (a decode worker publishes its first token
when the prefill's result arrives, possibly before the router's `stream` call): deltas
published before `bind` are held, and go first, in order, when it comes.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from tandem.worker.api import StreamDelta

Send = Callable[[StreamDelta], None]
"""Where a reader's deltas go (called on the publishing thread; it must not block)."""


class DeltaStream:
    """One request's deltas: held until a reader binds, then sent as they are published."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._lock = threading.Lock()
        self._held: list[StreamDelta] = []
        self._send: Send | None = None
        self._done: asyncio.Future[None] | None = None
        self._finished = False
        """Whether the request's last delta was published (held, or sent)."""

    def put(self, delta: StreamDelta) -> None:
        """Publish ``delta`` (any thread): sent now when a reader is bound, else held."""
        with self._lock:  # NOTE: sends happen under the lock, so deltas leave in publishing order
            if self._finished:
                return  # e.g. an abort's delta after the request finished: its reader has gone
            self._finished = delta.request_finished
            if self._send is None:
                self._held.append(delta)
            else:
                self._deliver(delta)

    def bind(self, send: Send) -> asyncio.Future[None]:
        """Send the held deltas, then every one published from now on, to ``send``; call it
        from the reader's event loop, once. -> a future of that loop, done once the
        request's last delta has been sent (its exception: the error ``send`` raised)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._done is not None:
                raise ValueError(f"request {self.request_id!r} has a reader already")
            self._done = loop.create_future()
            self._send = send
            held, self._held = self._held, []
            for delta in held:
                self._deliver(delta)
            return self._done

    def _deliver(self, delta: StreamDelta) -> None:
        # Called with the lock held; the future is resolved on its own loop (any thread here).
        done = self._done
        assert self._send is not None and done is not None
        try:
            self._send(delta)
        except Exception as e:  # noqa: BLE001 - the reader gets it, never the engine thread
            self._send = _dropped
            done.get_loop().call_soon_threadsafe(_settle, done, e)
            return
        if delta.request_finished:
            done.get_loop().call_soon_threadsafe(_settle, done, None)


def _dropped(delta: StreamDelta) -> None:
    """A reader whose send failed gets nothing more."""


def _settle(done: asyncio.Future[None], error: Exception | None) -> None:
    if done.done():  # cancelled: its reader left
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
