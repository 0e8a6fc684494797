"""A sender's connection to one receiver: its DEALER socket, the handshake, and the data
path the two settle on (a connector's SendPath: connectors/)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from tandem.kvtransfer.connectors.base import KVConnector, SendPath
from tandem.kvtransfer.connectors.zmq_frames import FramesSend
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.protocol import KVLayout, MessageKind, TransferRefused, decode, encode

logger = logging.getLogger(__name__)

SEND_QUEUE_MESSAGES = 100_000


@dataclass
class Peer:
    """A sender's connection to one receiver, owned by the sender's thread."""

    socket: zmq.Socket
    layout: KVLayout
    """The receiver's pool layout, from the handshake."""
    data: SendPath
    """How the rows go (the connector's path the handshake settled on)."""
    lost: str = ""
    """Why the data path broke (a torch.distributed peer gone): nothing more goes by it."""

    @property
    def path(self) -> str:
        """The data path's label: "shm" or "cuda_ipc" (in place), "dist" (torch.distributed), "zmq" (frames)."""
        return self.data.label

    def unmap_if_orphaned(self, address: str) -> bool:
        """Let go of the receiver's pool once its owner is gone: mapped here, a dead
        worker's pool would stay in memory. -> whether it did (then no transfer may write
        into it any more: its fence's descriptor is closed)."""
        if not self.data.orphaned():
            return False
        logger.warning("kv sender: the pool of %s has no owner any more: unmapped", address)
        self.data.close()
        return True

    def close(self) -> None:
        self.socket.close()
        self.data.close()


def connect_peer(address: str, hello: dict[str, Any], timeout_s: float, connector: KVConnector,
                 curve: CurveKeys | None = None) -> Peer:
    """Handshake with the receiver at `address` with `hello` (the sender's fields), asking for
    `connector`'s path; a receiver that declines it (and a path that cannot be offered from
    here) leaves frames over the socket.
    curve: the cluster's CurveZMQ keys, which the receiver must serve with.
    Raises TransferRefused when the receiver refuses (or the path it agreed to cannot be
    made), TimeoutError when it does not answer.
    """
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    # Queue nothing for a receiver that is gone (sends fail at once instead), and allow
    # many layers in flight: queued frames are views of the pool, not copies.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    if curve is not None:
        curve.connect(sock)
    sock.connect(address)
    try:
        msg = _handshake(sock, address, {**hello, **connector.hello()}, timeout_s)
        layout = KVLayout.from_dict(msg.get("layout"))
        data = connector.open(layout, msg)
    except BaseException:
        sock.close()
        connector.abandon()
        raise
    return Peer(sock, layout, data if data is not None else FramesSend())


def _handshake(sock: zmq.Socket, address: str, hello: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """-> the receiver's HELLO_OK."""
    try:
        sock.send(encode(MessageKind.HELLO, **hello))
    except zmq.Again:
        raise TimeoutError(f"no KV receiver accepted a connection at {address} within {timeout_s} s") from None
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no KV receiver answered at {address} within {timeout_s} s")
    kind, _, msg = decode(sock.recv())
    if kind is not MessageKind.HELLO_OK:
        raise TransferRefused(f"KV receiver at {address} refused the transfer: {msg.get('reason')}")
    return msg
