"""Where a worker sends its streams' deltas: one ZMQ PUSH socket per router inbox
(router/delta_inbox.py), connected on first use, a frame per delta (delta_wire.py).

NOTE: a send never blocks the worker. The socket queues without bound while its router is
slow or reconnecting (a stream's deltas are few and small, and a router that is gone has its
Ray actors, this worker included, ended by Ray).
"""

from __future__ import annotations

import threading

import zmq

from tandem.kvtransfer.curve import CurveKeys
from tandem.worker.api import StreamDelta
from tandem.worker.delta_wire import encode_delta

MAX_INBOXES = 8
"""Sockets kept (a router that restarted has a new inbox; the least recently opened goes)."""
LINGER_MS = 1000
"""How long a closed socket still tries to deliver what it holds."""


class DeltaOutbox:
    """Sends deltas to routers' inboxes; any thread may send (one at a time)."""

    def __init__(self, keys: CurveKeys | None = None) -> None:
        """keys: the cluster's CurveZMQ keys when the router's inbox takes only its workers."""
        self._keys = keys
        self._context: zmq.Context = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()

    def send(self, address: str, delta: StreamDelta) -> None:
        """Queue ``delta`` for the inbox at ``address`` (tcp://HOST:PORT); never waits."""
        frame = encode_delta(delta)
        with self._lock:
            self._socket(address).send(frame, copy=False)

    def _socket(self, address: str) -> zmq.Socket:
        socket = self._sockets.get(address)
        if socket is None:
            if not address.startswith("tcp://"):
                raise ValueError(f"a router inbox is a tcp:// address, got {address!r}")
            if len(self._sockets) >= MAX_INBOXES:
                self._sockets.pop(next(iter(self._sockets))).close()
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # unbounded: see the NOTE above
            socket.setsockopt(zmq.LINGER, LINGER_MS)
            if self._keys is not None:
                self._keys.connect(socket)
            socket.connect(address)
            self._sockets[address] = socket
        return socket

    def close(self) -> None:
        with self._lock:
            for socket in self._sockets.values():
                socket.close()
            self._sockets.clear()
