"""A test's own inbox for a worker's streaming calls: a PULL socket on loopback that reads
the deltas a worker's DeltaOutbox sends there (tandem/worker/delta_wire.py), blocking."""

from __future__ import annotations

import zmq

from tandem.worker.api import StreamDelta
from tandem.worker.delta_wire import decode_delta


class DeltaSink:
    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self._socket.bind_to_random_port('tcp://127.0.0.1')}"

    def next(self, timeout_s: float = 30.0) -> StreamDelta:
        """The next delta to arrive; TimeoutError when none comes in time."""
        if not self._socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no delta within {timeout_s} s")
        return decode_delta(self._socket.recv())

    def until_finished(self, timeout_s: float = 30.0) -> list[StreamDelta]:
        """Every delta up to the request's last."""
        deltas = [self.next(timeout_s)]
        while not deltas[-1].request_finished:
            deltas.append(self.next(timeout_s))
        return deltas

    def close(self) -> None:
        self._socket.close()
        self._context.term()
