"""What a sender keeps per request on its way."""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from tandem.kvtransfer.in_place import InPlaceWrites
from tandem.kvtransfer.protocol import Destination, TransferEvent


@dataclass
class Outgoing:
    """A request whose KV a sender is sending (the sender's thread's)."""

    destination: Destination
    src_block_ids: list[int]
    deadline: float | None = None
    """When the receiver's ack is overdue: timeout_s after the latest layer sent, so that a
    request waiting in the prefill queue, or between its chunks, never times out (NOTE:
    timeouts count from work, not from queues)."""
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    """One per message with frames of the pool: done once ZMQ no longer reads them."""
    ended: TransferEvent | None = None
    """Set when the request ended but ZMQ may still read its blocks: reported once it does not."""
    ended_at: float | None = None
    """When it ended (monotonic): frames ZMQ still holds RELEASE_GRACE_S later are dropped
    with their peer's socket, so that a stopped receiver never pins the blocks."""
    in_place: InPlaceWrites | None = None
    """The request's writes into the receiver's pool, on an in-place path."""
    num_staged: int = 0
    """Its layers still waiting in its path (staged to the host from a GPU pool): its blocks are read
    until none is."""
