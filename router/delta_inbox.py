"""Where the workers' stream deltas reach the router: one ZMQ PULL socket on the router's event
loop, bound before the first request and named in every streaming call (the worker's
DeltaOutbox connects to it), its frames handed to the queue of the request they belong to.

The socket is read by a reader callback on its file descriptor that takes every frame
waiting, not by an awaited recv per frame: zmq.asyncio makes a Future, registers and
unregisters it for each one, which was the largest share of the router's Python work per
streamed token.

NOTE: a request's queue is opened before its call goes out, so no delta of it can come
first; a delta of a request that has no queue (the router gave up on it) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.base import Authenticator

from tandem.kvtransfer.curve import CurveKeys
from tandem.worker.delta_wire import MalformedDelta, decode_delta

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


_CONTEXT: list[zmq.asyncio.Context] = []


def _shared_context() -> zmq.asyncio.Context:
    """One asyncio ZMQ context for the process's inboxes, never terminated. NOTE: not
    zmq.asyncio.Context.instance(), a shadow of the sync one the process's outboxes share:
    when collected it would terminate theirs; and a context of its own per inbox blocks its
    collector while a socket it made is open (an inbox never stopped: a test's backend)."""
    if not _CONTEXT:
        _CONTEXT.append(zmq.asyncio.Context())
    return _CONTEXT[0]


class DeltaInbox:
    """The router's inbox; start() it on the event loop that reads the queues."""

    def __init__(self, host: str = LOOPBACK, keys: CurveKeys | None = None) -> None:
        """host: where workers reach the router (loopback unless workers run on other hosts);
        keys: the cluster's CurveZMQ keys, when only its workers may send."""
        self._host = host
        self._keys = keys
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._socket: zmq.Socket | None = None
        self._auth: Authenticator | None = None
        self.address = ""
        """tcp://HOST:PORT, once started."""
        self.num_malformed = 0
        """Frames refused (not a delta of this wire format)."""
        self.num_denied = 0
        """Handshakes refused (CurveZMQ: a key that is not the cluster's)."""

    @property
    def started(self) -> bool:
        return self._socket is not None

    def start(self) -> None:
        context = _shared_context()
        # A plain socket of the same ZMQ context (the ZAP handler is the context's): read
        # without a Future per frame (see the module's docstring).
        socket: zmq.Socket = zmq.Context.shadow(context.underlying).socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # the workers' sends must never be refused
        if self._keys is not None:
            self._auth = self._keys.authenticator(context, self._denied, kind=AsyncioAuthenticator)
            self._keys.serve(socket)
        port = socket.bind_to_random_port(f"tcp://{self._host}")
        self.address = f"tcp://{self._host}:{port}"
        self._socket = socket
        loop = asyncio.get_running_loop()
        # NOTE: ZMQ's descriptor is edge-triggered: each wake-up takes every frame waiting.
        loop.add_reader(socket.fileno(), self._receive)
        loop.call_soon(self._receive)  # (frames before the reader was added)

    def open(self, request_id: str) -> asyncio.Queue[Any]:
        """The queue that gets ``request_id``'s deltas from now on (the router's own id for
        the call: unique). The caller may put its own items in it too."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} already has an inbox queue")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def num_open(self) -> int:
        return len(self._queues)

    async def stop(self) -> None:
        socket, self._socket = self._socket, None
        if socket is not None:
            asyncio.get_running_loop().remove_reader(socket.fileno())
        if self._auth is not None:
            self._auth.stop()
        if socket is not None:
            socket.close()

    def _denied(self) -> None:
        self.num_denied += 1

    def _receive(self) -> None:
        socket = self._socket
        # (asked before each recv: cheaper than the zmq.Again a recv of nothing raises)
        while socket is not None and cast(int, socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frame = socket.recv(zmq.NOBLOCK, copy=True)
            try:
                delta = decode_delta(frame)
            except MalformedDelta as e:
                self.num_malformed += 1
                logger.warning("a malformed delta frame (%d bytes) dropped: %s", len(frame), e)
                continue
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
