"""The sending side: a request's KV leaves the pool layer by layer, as soon as each is computed.

One DEALER socket per receiver address, used only from the owner's thread (the prefill
worker's step loop): `send_layer` hands zero-copy frames to ZMQ and returns at once, and
`poll` collects the receivers' acks and times out requests nobody acks. The owner keeps a
request's source blocks until its event arrives, which is never before ZMQ has stopped
reading them (message trackers), whether the request ended well, failed or was aborted.

A receiver on this sender's node whose pool is in shared memory gets the rows another way:
`send_layer` copies them straight into its reserved slots (in_place.py) and sends the
header alone. The path is chosen once per receiver, in the handshake.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import zmq

from tandem.kvtransfer.in_place import InPlaceWrites
from tandem.kvtransfer.payload import DistPayload, frame_of, layer_rows, layout_of
from tandem.kvtransfer.peer import Peer, connect_peer
from tandem.kvtransfer.placement import host_identity
from tandem.kvtransfer.protocol import (
    Destination, KVLayout, MessageKind, ProtocolError, TransferEvent, TransferStatus, decode, encode, payload_crc32,
)
from tandem.kvtransfer.slots import contiguous_runs, covering_blocks, token_slots

logger = logging.getLogger(__name__)

MAX_VIEW_FRAMES = 8  # more runs than this per layer and the rows are gathered into one frame
POOL_CHECK_S = 1.0  # how often poll looks for shared pools whose owner is gone


@dataclass
class _Outgoing:
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
    in_place: InPlaceWrites | None = None
    """The request's writes into the receiver's pool, on the shared-memory path."""


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, timeout_s: float = 30.0, dist_payload: DistPayload | None = None,
                 model: str | None = None, checksum: bool = False, layout: KVLayout | None = None,
                 node_id: str | None = None) -> None:
        """kv_cache: the pool read from, [layers, 2, blocks, block_size, kv_heads, head_dim].
        layout: the pool as receivers see it, when send_layer is given every row (a
        tensor-parallel worker's pool holds only some heads per rank; default: kv_cache's).
        timeout_s: a request fails when its receiver has not acked it this long after its
        latest layer was sent (not after `begin`: the prompt may wait in a queue before that).
        model: the weights' identity (model_fingerprint), which a receiver that names one
        must share. checksum: a CRC-32 of every layer's payload goes with it (ZMQ frames only).
        node_id: this sender's node (default: placement.host_identity(); empty: none): a
        receiver on the same one with a shared pool gets the rows in place.
        """
        self.node_id = host_identity() if node_id is None else node_id
        self.model = model
        self.checksum = checksum
        self.kv_cache = kv_cache
        self.layout = layout if layout is not None else layout_of(kv_cache)
        self.timeout_s = timeout_s
        self.dist_payload = dist_payload
        self._peers: dict[str, Peer] = {}
        self._outgoing: dict[str, _Outgoing] = {}
        self._events: list[TransferEvent] = []
        self._next_pool_check = 0.0
        self.num_bytes_sent = 0
        """KV payload bytes handed to the transport (K and V), for the metrics."""

    def connect(self, address: str, timeout_s: float = 10.0, shm_pool: str = "") -> KVLayout:
        """Handshake with a receiver (once per address). -> its layout.

        shm_pool: the receiver's pool file (Destination.shm_pool), to write into in place
        when this sender can map it and the receiver agrees; else the sockets.
        Raises TransferRefused when the layouts cannot exchange KV, TimeoutError when it
        does not answer.
        """
        if address in self._peers:
            return self._peers[address].layout
        hello = {"layout": self.layout.as_dict()}
        if self.model is not None:
            hello["model"] = self.model
        if self.dist_payload is not None:
            hello["dist_rank"] = self.dist_payload.rank
        peer = connect_peer(address, hello, timeout_s, shm_pool)
        self._peers[address] = peer
        return peer.layout

    def begin(self, destination: Destination, src_block_ids: list[int] = ()) -> str:
        """Start sending a request's KV (held in `src_block_ids` here, or given to each
        `send_layer` as the blocks come) to its destination.

        -> the data path it takes: "shm" (written in place: same node, shared pool), "dist"
        (torch.distributed) or "zmq" (frames over the socket).
        """
        if destination.request_id in self._outgoing:
            raise ValueError(f"{destination.request_id}: its KV is being sent already")
        first = destination.address not in self._peers
        why_not = ("the receiver's pool is private" if not destination.shm_pool
                   else "the receiver is on another node" if not self.node_id or destination.node_id != self.node_id
                   else "this pool is not in host memory" if self.kv_cache.device.type != "cpu" else "")
        self.connect(destination.address, shm_pool="" if why_not else destination.shm_pool)
        peer = self._peers[destination.address]
        if first:
            logger.info("kv sender: KV to %s goes by %s%s", destination.address, peer.path,
                        f" ({why_not})" if why_not else "")
        in_place = InPlaceWrites(peer.shm, destination, self.layout.block_size) if peer.shm is not None else None
        self._outgoing[destination.request_id] = _Outgoing(destination, list(src_block_ids), in_place=in_place)
        return peer.path

    def send_layer(self, request_id: str, layer: int, token_start: int | None = None, token_end: int | None = None,
                   src_block_ids: list[int] | None = None,
                   rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Send layer `layer`'s K and V of tokens [token_start, token_end) (default: from the
        first token the receiver does not hold, to the end), read from `src_block_ids`
        (default: those given before), or given as `rows` (K, V: [tokens, kv_heads,
        head_dim], not on torch.distributed; they must not change until the request's event).

        -> False when the request is no longer being sent (aborted or failed): skip it.
        """
        out = self._outgoing.get(request_id)
        if out is None or out.ended is not None:
            return False
        out.deadline = time.monotonic() + self.timeout_s
        dest = out.destination
        start = dest.num_cached_tokens if token_start is None else token_start
        end = dest.num_tokens if token_end is None else token_end
        if src_block_ids is not None:
            out.src_block_ids = list(src_block_ids)
        if not dest.num_cached_tokens <= start < end <= min(dest.num_tokens,
                                                            len(out.src_block_ids) * self.layout.block_size):
            raise ValueError(f"{request_id}: token range [{start}, {end}) outside [{dest.num_cached_tokens}, "
                             f"{dest.num_tokens}) or the {len(out.src_block_ids)} source blocks")
        peer = self._peers[dest.address]
        header = dict(layer=layer, token_start=start, num_tokens=end - start,
                      block_ids=covering_blocks(dest.block_ids, peer.layout.block_size, start, end),
                      dtype=self.layout.dtype, row_shape=[self.layout.num_kv_heads, self.layout.head_dim])
        k_rows, v_rows = layer_rows(self.kv_cache, layer, 0), layer_rows(self.kv_cache, layer, 1)
        num_bytes = 2 * (end - start) * self.layout.row_bytes
        if rows is not None and (self.dist_payload is not None or any(len(r) != end - start for r in rows)):
            raise ValueError(f"{request_id}: given rows go in ZMQ frames, exactly {end - start} of them")
        if out.in_place is not None:
            # K and V together: one copy op for both where the slots run side by side.
            src, src_blocks = ((torch.stack(rows), None) if rows is not None
                               else (self.kv_cache[layer].flatten(1, 2), out.src_block_ids))
            if not out.in_place.write(layer, start, end, src, src_blocks):
                self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED,
                                                    "the receiver revoked its grant"))
                return False
            header.update(frame_tokens=[], in_place=True)
            sent = self._send(request_id, peer, [encode(MessageKind.LAYER, request_id, **header)])
            self.num_bytes_sent += num_bytes if sent else 0
            return sent
        src_slots = token_slots(out.src_block_ids, self.layout.block_size, start, end)
        if self.dist_payload is not None:
            header.update(frame_tokens=[], dist_rank=self.dist_payload.rank)
            if not self._send(request_id, peer, [encode(MessageKind.LAYER, request_id, **header)]):
                return False
            index = torch.from_numpy(src_slots).to(self.kv_cache.device)
            self.dist_payload.send(peer.dist_rank, k_rows.index_select(0, index), v_rows.index_select(0, index))
            self.num_bytes_sent += num_bytes
            return True
        runs = contiguous_runs(src_slots)
        if rows is not None:
            header["frame_tokens"] = [end - start]
            frames = [frame_of(r) for r in rows]
        elif len(runs) <= MAX_VIEW_FRAMES:  # a few long runs: frames are views of the pool itself
            header["frame_tokens"] = [n for _, n in runs]
            frames = [frame_of(rows[first:first + n]) for rows in (k_rows, v_rows) for first, n in runs]
        else:  # scattered blocks: one gathered frame each for K and V beats many small ones
            index = torch.from_numpy(src_slots).to(self.kv_cache.device)
            header["frame_tokens"] = [len(src_slots)]
            frames = [frame_of(rows.index_select(0, index)) for rows in (k_rows, v_rows)]
        if self.checksum:
            header["crc32"] = payload_crc32(frames)
        sent = self._send(request_id, peer, [encode(MessageKind.LAYER, request_id, **header), *frames])
        self.num_bytes_sent += num_bytes if sent else 0
        return sent

    def _send(self, request_id: str, peer: Peer, frames: list) -> bool:
        """Never blocks: a receiver that cannot take the message fails the request."""
        try:
            tracker = peer.socket.send_multipart(frames, copy=False, track=True, flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.warning("kv transfer %s: the receiver is not accepting messages", request_id)
            self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, "receiver not accepting messages"))
            return False
        self._outgoing[request_id].trackers.append(tracker)
        return True

    def _end(self, request_id: str, event: TransferEvent) -> None:
        """Stop sending; the event is reported once ZMQ has let go of the request's frames."""
        out = self._outgoing.get(request_id)
        if out is not None and out.ended is None:
            out.ended = event

    def abort(self, request_id: str) -> bool:
        """Stop sending a request and tell its receiver (which then frees its blocks).

        -> whether it was being sent; if so a FAILED event follows (its blocks are the
        owner's again only then).
        """
        out = self._outgoing.get(request_id)
        if out is None or out.ended is not None:
            return False
        try:  # best effort: a receiver that is gone times the request out itself
            self._peers[out.destination.address].socket.send(encode(MessageKind.ABORT, request_id), zmq.DONTWAIT)
        except zmq.Again:
            pass
        self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, "aborted by the sender"))
        return True

    def poll(self) -> list[TransferEvent]:
        """Requests that ended since the last call: acked, refused, timed out or aborted (never blocks)."""
        now = time.monotonic()
        if now >= self._next_pool_check:  # a syscall per shared pool now and then, not every tick
            self._next_pool_check = now + POOL_CHECK_S
            for address, peer in self._peers.items():
                peer.unmap_if_orphaned(address)
        for address, peer in self._peers.items():
            while peer.socket.poll(0):
                try:
                    kind, request_id, msg = decode(peer.socket.recv())
                except ProtocolError as e:
                    logger.warning("kv sender dropped a message from %s: %s", address, e)
                    continue
                if kind in (MessageKind.DONE, MessageKind.FAILED, MessageKind.ABORT):
                    status = TransferStatus.DONE if kind is MessageKind.DONE else TransferStatus.FAILED
                    reason = "" if kind is MessageKind.DONE else f"receiver: {msg.get('reason', 'aborted')}"
                    self._end(request_id, TransferEvent(request_id, status, reason))
        now = time.monotonic()
        for request_id, out in self._outgoing.items():
            if out.ended is None and out.deadline is not None and out.deadline <= now:
                logger.warning("kv transfer %s: no ack within %.1f s", request_id, self.timeout_s)
                self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, "timed out waiting for the receiver"))
        released = [r for r, o in self._outgoing.items() if o.ended is not None and all(t.done for t in o.trackers)]
        for request_id in released:
            self._events.append(self._outgoing.pop(request_id).ended)
        events, self._events = self._events, []
        return events

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferEvent:
        """Poll until `request_id` ends; other requests' events are kept for the next `poll`."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        kept: list[TransferEvent] = []
        found: TransferEvent | None = None
        try:
            while found is None:
                for event in self.poll():
                    if event.request_id == request_id:
                        found = event
                    else:
                        kept.append(event)
                if found is None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{request_id}: not ended within the wait")
                if found is None:
                    time.sleep(0.001)
            return found
        finally:
            self._events = kept + self._events

    @property
    def num_pending(self) -> int:
        return len(self._outgoing)

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
