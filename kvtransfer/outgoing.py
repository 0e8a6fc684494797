"""What a sender keeps per request on its way, and the frames of a layer in host memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from tandem.kvtransfer.in_place import InPlaceWrites
from tandem.kvtransfer.payload import frame_of, layer_rows
from tandem.kvtransfer.peer import Peer
from tandem.kvtransfer.protocol import Destination, TransferEvent
from tandem.kvtransfer.slots import contiguous_runs
from tandem.kvtransfer.staging import StagedLayer

MAX_VIEW_FRAMES = 8  # more runs than this per layer and the rows are gathered into one frame


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
    """The request's writes into the receiver's pool, on the shared-memory path."""
    num_staged: int = 0
    """Its layers still on their way to the host (a pool on a GPU): its blocks are read until none is."""


@dataclass
class StagedMessage:
    """A LAYER message waiting for its rows to reach the host (staging.py)."""

    request_id: str
    peer: Peer
    header: dict
    rows: StagedLayer
    num_bytes: int


def host_frames(kv_cache: torch.Tensor, layer: int, src_slots: np.ndarray,
                rows: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[list[int], list[memoryview]]:
    """-> (frame_tokens, the K frames then the V frames) of a layer's rows: `rows` when given,
    else cache slots `src_slots` of a pool in host memory (views of it where they run side by side)."""
    if rows is not None:
        return [len(rows[0])], [frame_of(r) for r in rows]
    k_rows, v_rows = layer_rows(kv_cache, layer, 0), layer_rows(kv_cache, layer, 1)
    runs = contiguous_runs(src_slots)
    if len(runs) <= MAX_VIEW_FRAMES:  # a few long runs: frames are views of the pool itself
        return [n for _, n in runs], [frame_of(r[first:first + n]) for r in (k_rows, v_rows) for first, n in runs]
    # Scattered blocks: one gathered frame each for K and V beats many small ones.
    index = torch.from_numpy(src_slots).to(kv_cache.device)
    return [len(src_slots)], [frame_of(r.index_select(0, index)) for r in (k_rows, v_rows)]
