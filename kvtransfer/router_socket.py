"""A receiver's ROUTER socket, bound where it is told (loopback by default), with what guards
it: CurveZMQ encryption that admits only the cluster's senders, and a frame size limit."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from tandem.kvtransfer.curve import CurveKeys


class RouterSocket:
    def __init__(self, address: str, max_frame_bytes: int, curve: CurveKeys | None,
                 on_unauthenticated: Callable[[], None]) -> None:
        """max_frame_bytes: the largest frame taken; curve: the cluster's keys (None: plain);
        on_unauthenticated: called (on the ZAP handler's thread) for each sender refused."""
        # A context of its own under CURVE: its ZAP handler (one per context) admits the senders.
        self._context = zmq.Context.instance() if curve is None else zmq.Context()
        self._auth = None if curve is None else curve.authenticator(self._context, on_unauthenticated)
        self.socket: zmq.Socket[bytes] = self._context.socket(zmq.ROUTER)
        if curve is not None:
            curve.serve(self.socket)
        self.socket.setsockopt(zmq.LINGER, 0)
        # NOTE: ZMQ disconnects a peer that sends a larger frame, before buffering it whole.
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.bind(address)
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        self.socket.close()
        if self._auth is not None:
            self._auth.stop()
            self._context.term()
