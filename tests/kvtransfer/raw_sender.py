"""A hand-driven KV sender for message-level tests, and the small pool they share."""

from __future__ import annotations

import uuid

import msgpack
import torch
import zmq
from kv_pools import random_pool

from tandem.kvtransfer.payload import frame_of, layer_rows
from tandem.kvtransfer.protocol import Destination, MessageKind, encode
from tandem.kvtransfer.receiver import KVReceiver

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 8, 4, 2, 8
DST_BLOCKS = [5, 2]  # the request's reservation: 8 tokens in blocks 5 and 2
NUM_TOKENS = 8


class RawSender:
    """A hand-driven peer that can put any bytes on the wire after a proper handshake."""

    def __init__(self, receiver: KVReceiver, dtype: torch.dtype = torch.float32) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        self.socket.connect(receiver.address)
        self.src = random_pool(LAYERS, 2, 8, HEADS, DIM, dtype, seed=7)  # tokens 0..7 in block 0
        layout = dict(num_layers=LAYERS, num_blocks=2, block_size=8, num_kv_heads=HEADS, head_dim=DIM,
                      dtype=str(dtype).removeprefix("torch."))
        self.socket.send(encode(MessageKind.HELLO, layout=layout))
        assert self.socket.poll(5000)
        assert msgpack.unpackb(self.socket.recv())["kind"] == MessageKind.HELLO_OK
        self.grants: dict[str, str] = {}
        """The grants of the Destinations this sender was handed, by request id."""

    def handed(self, destination: Destination) -> None:
        """The router chose this sender for `destination`: its messages carry the grant."""
        self.grants[destination.request_id] = destination.grant

    def header(self, request_id: str = "req", layer: int = 0, **changes) -> dict:
        h = dict(layer=layer, token_start=0, num_tokens=NUM_TOKENS, block_ids=DST_BLOCKS, dtype="float32",
                 row_shape=[HEADS, DIM], frame_tokens=[NUM_TOKENS], grant=self.grants.get(request_id, ""))
        h.update(changes)
        return h

    def frames(self, layer: int = 0) -> list:
        return [frame_of(layer_rows(self.src, layer, kv)[:NUM_TOKENS]) for kv in (0, 1)]

    def send(self, header: dict | bytes, frames: list, request_id: str = "req") -> None:
        first = header if isinstance(header, bytes) else encode(MessageKind.LAYER, request_id, **header)
        self.socket.send_multipart([first, *frames])

    def send_all_layers(self, request_id: str = "req") -> None:
        for layer in range(LAYERS):
            self.send(self.header(request_id, layer), self.frames(layer), request_id)

    def next_kind(self, timeout_s: float = 5.0) -> MessageKind:
        assert self.socket.poll(int(timeout_s * 1000)), "no answer from the receiver"
        return MessageKind(msgpack.unpackb(self.socket.recv())["kind"])
