"""The sending side: a request's KV leaves the pool layer by layer, as soon as each is computed.

One DEALER socket per receiver address, used only from the owner's thread (the prefill
worker's step loop): `send_layer` hands zero-copy frames to ZMQ and returns at once, and
`poll` collects the receivers' acks and times out requests nobody acks. The owner keeps a
request's source blocks until its event arrives, which is never before ZMQ has stopped
reading them (message trackers), whether the request ended well, failed or was aborted.

A receiver on this sender's node whose pool is in shared memory, or on this sender's GPU
(CUDA IPC), gets the rows another way: `send_layer` copies them straight into its reserved
slots (in_place.py) and sends the header alone. With `transport` gloo or nccl (or auto
between pools on two GPUs) the rows go by torch.distributed in a group of two made in the
handshake (dist_pairs.py), the header by ZMQ. A pool on a GPU sends frames staged through
pinned host memory (staging.py): a layer's message goes out from `poll` or a later
`send_layer`, once its copy is done. The path is chosen once per receiver, in the
handshake, by path_choice.choose_path.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Sequence

import torch
import zmq

from tandem.kvtransfer.cuda_ipc import IpcOffer, device_identity
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.in_place import InPlaceWrites
from tandem.kvtransfer.outgoing import Outgoing, StagedMessage, host_frames
from tandem.kvtransfer.pair_facts import pair_facts
from tandem.kvtransfer.path_choice import (
    CUDA_IPC,
    IN_PLACE_PATHS,
    PAIR_PATHS,
    PathChoice,
    choose_path,
)
from tandem.kvtransfer.payload import DistPayload, frame_of, layer_rows, layout_of
from tandem.kvtransfer.peer import Peer, connect_peer
from tandem.kvtransfer.placement import host_identity
from tandem.kvtransfer.protocol import (
    KV_TRANSPORTS,
    Destination,
    KVLayout,
    MessageKind,
    ProtocolError,
    TransferEvent,
    TransferRefused,
    TransferStatus,
    decode,
    encode,
    payload_crc32,
)
from tandem.kvtransfer.slots import covering_blocks, token_slots
from tandem.kvtransfer.staging import Staging

logger = logging.getLogger(__name__)

POOL_CHECK_S = 1.0  # how often poll looks for shared pools whose owner is gone
RELEASE_GRACE_S = 2.0
"""How long ZMQ may hold frames of ended requests before their peer is closed (see
_drop_pinning_peers): a live receiver drains them in milliseconds."""


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, timeout_s: float = 30.0, dist_payload: DistPayload | None = None,
                 model: str | None = None, checksum: bool = False, layout: KVLayout | None = None,
                 node_id: str | None = None, transport: str = "auto", curve: CurveKeys | None = None,
                 allow_unencrypted_pairs: bool = False) -> None:
        """kv_cache: the pool read from, [layers, 2, blocks, block_size, kv_heads, head_dim].
        layout: the pool as receivers see it, when send_layer is given every row (a
        tensor-parallel worker's pool holds only some heads per rank; default: kv_cache's).
        timeout_s: a request fails when its receiver has not acked it this long after its
        latest layer was sent (not after `begin`: the prompt may wait in a queue before that).
        model: the weights' identity (model_fingerprint), which a receiver that names one
        must share. checksum: a CRC-32 of every layer's payload goes with it (ZMQ frames only).
        node_id: this sender's node (default: placement.host_identity(); empty: none): a
        receiver on the same one with a shared pool gets the rows in place.
        transport: protocol.KV_TRANSPORTS: which data paths begin may take (auto: the best
        each receiver allows; gloo, nccl: a torch.distributed pair with every receiver).
        curve: the cluster's CurveZMQ keys: every socket to a receiver is encrypted with them.
        allow_unencrypted_pairs: with `curve`, torch.distributed pairs (never encrypted) are
        taken all the same (path_choice.ALLOW_UNENCRYPTED_FLAG); else refused.
        """
        if transport not in KV_TRANSPORTS:
            raise ValueError(f"transport must be one of {KV_TRANSPORTS}, got {transport!r}")
        if dist_payload is not None and transport not in ("auto", "gloo", "nccl"):
            raise ValueError("a sender given a torch.distributed world sends by it, not by ZMQ frames")
        self.transport = transport
        self.node_id = host_identity() if node_id is None else node_id
        self.model = model
        self.checksum = checksum
        self.kv_cache = kv_cache
        self.layout = layout if layout is not None else layout_of(kv_cache)
        self.timeout_s = timeout_s
        self.dist_payload = dist_payload
        self.curve = curve
        self.allow_unencrypted_pairs = allow_unencrypted_pairs
        self.device = device_identity(kv_cache.device, self.node_id)
        """This pool's CUDA device identity ("" in host memory)."""
        self._staging = Staging.for_pool(kv_cache)
        """A pool on a GPU: frames are staged through pinned host memory on a side stream."""
        self._staged: collections.deque[StagedMessage] = collections.deque()
        """Messages whose rows are on their way to the host, in the order they go out."""
        self._peers: dict[str, Peer] = {}
        self._outgoing: dict[str, Outgoing] = {}
        self._events: list[TransferEvent] = []
        self._next_pool_check = 0.0
        self.num_bytes_sent = 0
        """KV payload bytes handed to the transport (K and V), for the metrics."""
        self._announced: set[str] = set()
        """Receivers whose data path was logged."""

    def connect(self, address: str, timeout_s: float = 10.0, destination: Destination | None = None) -> KVLayout:
        """Handshake with a receiver (once per address, again after its data path broke).
        -> its layout.

        destination: one of the receiver's (None: a receiver known by address alone): where
        its pool is, for the data path (`choose`).
        Raises TransferRefused when the layouts cannot exchange KV, or the path is refused,
        TimeoutError when it does not answer.
        """
        if self.is_connected(address):
            return self._peers[address].layout
        return self.adopt(address, self.handshake(address, timeout_s, destination))

    def is_connected(self, address: str) -> bool:
        """Whether a handshake with `address` stands (readable from any thread)."""
        peer = self._peers.get(address)
        return peer is not None and not peer.lost

    def choose(self, destination: Destination | None) -> PathChoice:
        """The data path to `destination`'s receiver (None: known by address alone)."""
        return choose_path(pair_facts(self.kv_cache.device, self.node_id, self.device, destination, self.transport,
                                      self.curve is not None, self.allow_unencrypted_pairs))

    def handshake(self, address: str, timeout_s: float = 10.0, destination: Destination | None = None) -> Peer:
        """A new connection to the receiver at `address`, not yet the sender's (see `adopt`),
        by the path `choose` gives (TransferRefused when it refuses the pair).
        NOTE: touches nothing of the sender's state, so any thread may run it: a prefill
        worker shakes hands off its engine loop, which a silent receiver would stall for
        timeout_s."""
        choice = self.choose(destination)
        if choice.refused:
            raise TransferRefused(f"KV to {address}: {choice.reason}")
        hello: dict[str, Any] = {"layout": self.layout.as_dict()}
        if self.model is not None:
            hello["model"] = self.model
        if self.dist_payload is not None:
            hello["dist_rank"] = self.dist_payload.rank
        if self.device:  # (a receiver on this GPU never takes a pair from it)
            hello["device"] = self.device
        shm_pool = destination.shm_pool if destination is not None and choice.path in IN_PLACE_PATHS else ""
        ipc = (IpcOffer(destination.device, self.node_id, peer_access=destination.device != self.device)
               if destination is not None and choice.path == CUDA_IPC else None)
        pair = choice.path if choice.path in PAIR_PATHS and self.dist_payload is None else ""
        peer = connect_peer(address, hello, timeout_s, shm_pool, dist_pair=pair,
                            dist_required=self.transport in PAIR_PATHS, curve=self.curve, ipc=ipc)
        if self.dist_payload is not None:
            peer.dist = self.dist_payload
        return peer

    def adopt(self, address: str, peer: Peer) -> KVLayout:
        """Make a `handshake`'s connection the one to `address` (on the sender's thread); one
        that came second is closed. -> the receiver's layout."""
        old = self._peers.get(address)
        if old is not None and not old.lost:
            peer.close()
            return old.layout
        if old is not None:  # its requests all ended when it broke
            old.close()
        self._peers[address] = peer
        return peer.layout

    def begin(self, destination: Destination, src_block_ids: Sequence[int] = ()) -> str:
        """Start sending a request's KV (held in `src_block_ids` here, or given to each
        `send_layer` as the blocks come) to its destination (shaking hands first, unless a
        handshake was `adopt`ed).

        -> the data path it takes: "shm" (written in place: same node, shared pool),
        "cuda_ipc" (written in place: the receiver's pool on this GPU), "dist"
        (torch.distributed) or "zmq" (frames over the socket).
        """
        if destination.request_id in self._outgoing:
            raise ValueError(f"{destination.request_id}: its KV is being sent already")
        self.connect(destination.address, destination=destination)
        peer = self._peers[destination.address]
        if destination.address not in self._announced:
            self._announced.add(destination.address)
            choice = self.choose(destination)
            taken = "" if peer.path in (choice.path, "dist") else f"; {choice.path} was not to be had"
            logger.info("kv sender: KV to %s goes by %s (%s%s)", destination.address, peer.path, choice.reason, taken)
        in_place = InPlaceWrites(peer.target, destination, self.layout.block_size) if peer.target is not None else None
        self._outgoing[destination.request_id] = Outgoing(destination, list(src_block_ids), in_place=in_place)
        return peer.path

    def send_layer(self, request_id: str, layer: int, token_start: int | None = None, token_end: int | None = None,
                   src_block_ids: list[int] | None = None,
                   rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Send layer `layer`'s K and V of tokens [token_start, token_end) (default: from the
        first token the receiver does not hold, to the end), read from `src_block_ids`
        (default: those given before), or given as `rows` (K, V: [tokens, kv_heads,
        head_dim]; they must not change until the request's event).

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
        header = dict(layer=layer, token_start=start, num_tokens=end - start, grant=dest.grant,
                      block_ids=covering_blocks(dest.block_ids, peer.layout.block_size, start, end),
                      dtype=self.layout.dtype, row_shape=[self.layout.num_kv_heads, self.layout.head_dim])
        num_bytes = 2 * (end - start) * self.layout.row_bytes
        if rows is not None and any(len(r) != end - start for r in rows):
            raise ValueError(f"{request_id}: given rows must be exactly {end - start} of them")
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
        if peer.dist is not None:
            return self._send_dist(request_id, dest.address, peer, header, src_slots, rows, num_bytes)
        if self._staging is not None and rows is None:  # sent by _flush_staged once on the host
            header["frame_tokens"] = [len(src_slots)]
            staged = self._staging.stage(self.kv_cache, layer, src_slots)
            self._staged.append(StagedMessage(request_id, peer, header, staged, num_bytes))
            out.num_staged += 1
            self._flush_staged()
            return True
        header["frame_tokens"], frames = host_frames(self.kv_cache, layer, src_slots, rows)
        if self.checksum:
            header["crc32"] = payload_crc32(frames)
        sent = self._send(request_id, peer, [encode(MessageKind.LAYER, request_id, **header), *frames])
        self.num_bytes_sent += num_bytes if sent else 0
        return sent

    def _flush_staged(self) -> None:
        """Send the staged messages whose rows are on the host, in order (never blocks)."""
        while self._staged and self._staged[0].rows.ready():
            s = self._staged.popleft()
            out = self._outgoing[s.request_id]  # (kept while it has staged layers)
            out.num_staged -= 1
            if out.ended is not None:  # aborted or failed meanwhile: nothing more goes out
                continue
            frames = [frame_of(s.rows.host[0]), frame_of(s.rows.host[1])]
            if self.checksum:
                s.header["crc32"] = payload_crc32(frames)
            if self._send(s.request_id, s.peer, [encode(MessageKind.LAYER, s.request_id, **s.header), *frames]):
                self.num_bytes_sent += s.num_bytes

    def _send_dist(self, request_id: str, address: str, peer: Peer, header: dict, src_slots, rows, num_bytes: int
                   ) -> bool:
        """The header by ZMQ, then K and V by torch.distributed (blocking until handed over)."""
        assert peer.dist is not None and peer.dist_rank is not None  # (a torch.distributed peer: its path)
        header.update(frame_tokens=[], dist_rank=peer.dist.rank)
        if not self._send(request_id, peer, [encode(MessageKind.LAYER, request_id, **header)]):
            return False
        if rows is None:
            index = torch.from_numpy(src_slots).to(self.kv_cache.device)
            layer = header["layer"]
            rows = tuple(layer_rows(self.kv_cache, layer, kv).index_select(0, index) for kv in (0, 1))
        try:
            peer.dist.send(peer.dist_rank, *rows)
        except RuntimeError as e:  # the receiver is gone (or stuck past the timeout)
            self._lose(address, peer, f"torch.distributed peer lost: {e}")
            return False
        self.num_bytes_sent += num_bytes
        return True

    def _lose(self, address: str, peer: Peer, reason: str) -> None:
        """A peer's data path broke: every request to it fails (its stream is out of step);
        the next `begin` for it shakes hands anew."""
        logger.warning("kv sender: %s: %s", address, reason)
        peer.lost = reason
        for request_id, out in self._outgoing.items():
            if out.destination.address == address:
                self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, reason))

    def _send(self, request_id: str, peer: Peer, frames: list) -> bool:
        """Never blocks: a receiver that cannot take the message fails the request."""
        try:
            tracker = peer.socket.send_multipart(frames, copy=False, track=True, flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.warning("kv transfer %s: the receiver is not accepting messages", request_id)
            self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, "receiver not accepting messages"))
            return False
        assert tracker is not None  # (track=True: always a tracker)
        self._outgoing[request_id].trackers.append(tracker)
        return True

    def _end(self, request_id: str, event: TransferEvent) -> None:
        """Stop sending; the event is reported once ZMQ has let go of the request's frames."""
        out = self._outgoing.get(request_id)
        if out is not None and out.ended is None:
            out.ended = event
            out.ended_at = time.monotonic()

    def _drop_pinning_peers(self, now: float) -> None:
        """A peer whose socket still holds frames of ended requests RELEASE_GRACE_S after they
        ended (a stopped or vanished receiver: nothing drains its queue) is closed: ZMQ drops
        the queued frames, which are views of the pool, and lets go of their blocks. Its other
        requests fail; the next `begin` for it shakes hands anew."""
        for address, peer in list(self._peers.items()):
            if any(o.destination.address == address and o.ended_at is not None and now - o.ended_at >= RELEASE_GRACE_S
                   and not all(t.done for t in o.trackers) for o in self._outgoing.values()):
                self._lose(address, peer, f"frames still queued {RELEASE_GRACE_S:.0f} s after their requests ended")
                peer.close()
                del self._peers[address]

    def abort(self, request_id: str) -> bool:
        """Stop sending a request and tell its receiver (which then frees its blocks).

        -> whether it was being sent; if so a FAILED event follows (its blocks are the
        owner's again only then).
        """
        out = self._outgoing.get(request_id)
        if out is None or out.ended is not None:
            return False
        peer = self._peers.get(out.destination.address)
        try:  # best effort: a receiver that is gone times the request out itself
            if peer is not None:
                peer.socket.send(encode(MessageKind.ABORT, request_id, grant=out.destination.grant), zmq.DONTWAIT)
        except zmq.Again:
            pass
        self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, "aborted by the sender"))
        return True

    def poll(self) -> list[TransferEvent]:
        """Requests that ended since the last call: acked, refused, timed out or aborted (never blocks)."""
        self._flush_staged()
        now = time.monotonic()
        if now >= self._next_pool_check:  # a syscall per shared pool now and then, not every tick
            self._next_pool_check = now + POOL_CHECK_S
            for address, peer in self._peers.items():
                if peer.unmap_if_orphaned(address):  # NOTE: its transfers end before their next write
                    self._lose(address, peer, "the receiver's shared pool has no owner any more")
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
                self._end(request_id,
                          TransferEvent(request_id, TransferStatus.FAILED, "timed out waiting for the receiver"))
        self._drop_pinning_peers(now)
        released = [r for r, o in self._outgoing.items()
                    if o.ended is not None and not o.num_staged and all(t.done for t in o.trackers)]
        for request_id in released:
            ended = self._outgoing.pop(request_id).ended
            assert ended is not None  # (released: only ended ones)
            self._events.append(ended)
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
