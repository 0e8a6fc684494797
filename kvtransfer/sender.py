"""The sending side: a request's KV leaves the pool layer by layer, as soon as each is computed.

One DEALER socket per receiver address, used only from the owner's thread (the prefill
worker's step loop): `send_layer` checks the token range, builds the header every path
sends, and hands the rows to the pair's data path (a connector's SendPath, connectors/),
which returns at once or once they are handed over; `poll` collects the receivers' acks and
times out requests nobody acks. The owner keeps a request's source blocks until its event
arrives, which is never before the path has stopped reading them (ZMQ's message trackers,
staged copies), whether the request ended well, failed or was aborted.

The path is chosen once per receiver, in the handshake: path_choice.choose_path names a
registered connector (connectors/registry.py), whose sender half asks the receiver for it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch
import zmq

from tandem.kvtransfer.connectors.base import LayerJob, SenderSide, SendPath
from tandem.kvtransfer.connectors.registry import kv_transports, load_connector
from tandem.kvtransfer.cuda_ipc import device_identity
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.outgoing import Outgoing
from tandem.kvtransfer.pair_facts import pair_facts
from tandem.kvtransfer.path_choice import PathChoice, choose_path
from tandem.kvtransfer.payload import layout_of
from tandem.kvtransfer.peer import Peer, connect_peer
from tandem.kvtransfer.placement import host_identity
from tandem.kvtransfer.protocol import (
    Destination,
    KVLayout,
    MessageKind,
    PairNotFormed,
    ProtocolError,
    TransferEvent,
    TransferRefused,
    TransferStatus,
    decode,
    encode,
)
from tandem.kvtransfer.slots import covering_blocks
from tandem.kvtransfer.staging import Staging

logger = logging.getLogger(__name__)

POOL_CHECK_S = 1.0  # how often poll looks for shared pools whose owner is gone
RELEASE_GRACE_S = 2.0
"""How long ZMQ may hold frames of ended requests before their peer is closed (see
_drop_pinning_peers): a live receiver drains them in milliseconds."""


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, timeout_s: float = 30.0, model: str | None = None,
                 checksum: bool = False, layout: KVLayout | None = None, node_id: str | None = None,
                 transport: str = "auto", curve: CurveKeys | None = None, allow_unencrypted_pairs: bool = False
                 ) -> None:
        """kv_cache: the pool read from, [layers, 2, blocks, block_size, kv_heads, head_dim].
        layout: the pool as receivers see it, when send_layer is given every row (a
        tensor-parallel worker's pool holds only some heads per rank; default: kv_cache's).
        timeout_s: a request fails when its receiver has not acked it this long after its
        latest layer was sent (not after `begin`: the prompt may wait in a queue before that).
        model: the weights' identity (model_fingerprint), which a receiver that names one
        must share. checksum: a CRC-32 of every layer's payload goes with it (ZMQ frames only).
        node_id: this sender's node (default: placement.host_identity(); empty: none): a
        receiver on the same one with a shared pool gets the rows in place.
        transport: one of registry.kv_transports(): which data paths begin may take (auto: the
        best each receiver allows; gloo, nccl: a torch.distributed pair with every receiver).
        curve: the cluster's CurveZMQ keys: every socket to a receiver is encrypted with them.
        allow_unencrypted_pairs: with `curve`, torch.distributed pairs (never encrypted) are
        taken all the same (path_choice.ALLOW_UNENCRYPTED_FLAG); else refused.
        """
        if transport not in kv_transports():
            raise ValueError(f"transport must be one of {kv_transports()}, got {transport!r}")
        self.transport = transport
        self.node_id = host_identity() if node_id is None else node_id
        self.model = model
        self.checksum = checksum
        self.kv_cache = kv_cache
        self.layout = layout if layout is not None else layout_of(kv_cache)
        self.timeout_s = timeout_s
        self.curve = curve
        self.allow_unencrypted_pairs = allow_unencrypted_pairs
        self.device = device_identity(kv_cache.device, self.node_id)
        """This pool's CUDA device identity ("" in host memory)."""
        self.staging = Staging.for_pool(kv_cache)
        """A pool on a GPU: frames are staged through pinned host memory on a side stream."""
        self._peers: dict[str, Peer] = {}
        self._draining: list[SendPath] = []
        """Paths of peers gone while messages still waited in them: flushed until empty."""
        self._outgoing: dict[str, Outgoing] = {}
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
        if self.device:  # (a receiver on this GPU never takes a pair from it)
            hello["device"] = self.device
        side = SenderSide(address, destination, self.node_id, self.device, self.transport, timeout_s)
        try:
            return connect_peer(address, hello, timeout_s, load_connector(choice.path)(choice.path, side), self.curve)
        except PairNotFormed as e:
            # NOTE: a pair agreed to but not formed in time (its other side slow to join on a
            # loaded host) is no reason to fail the request: once more, with a new pair.
            logger.warning("kv sender: %s; shaking hands again", e)
            return connect_peer(address, hello, timeout_s, load_connector(choice.path)(choice.path, side), self.curve)

    def adopt(self, address: str, peer: Peer) -> KVLayout:
        """Make a `handshake`'s connection the one to `address` (on the sender's thread); one
        that came second is closed. -> the receiver's layout."""
        old = self._peers.get(address)
        if old is not None and not old.lost:
            peer.close()
            return old.layout
        if old is not None:  # its requests all ended when it broke
            self._retire(address)
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
        out = Outgoing(destination, list(src_block_ids))
        peer.data.begin(out, self.layout.block_size)
        self._outgoing[destination.request_id] = out
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
        if rows is not None and any(len(r) != end - start for r in rows):
            raise ValueError(f"{request_id}: given rows must be exactly {end - start} of them")
        num_bytes = 2 * (end - start) * self.layout.row_bytes
        return peer.data.send_layer(self, LayerJob(out, layer, start, end, header, rows, num_bytes))

    # -- what the paths use of the sender (connectors.base.SenderLink) ------------------
    def send_message(self, request_id: str, frames: list) -> bool:
        """Never blocks: a receiver that cannot take the message fails the request."""
        out = self._outgoing[request_id]
        try:
            socket = self._peers[out.destination.address].socket
            tracker = socket.send_multipart(frames, copy=False, track=True, flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.warning("kv transfer %s: the receiver is not accepting messages", request_id)
            self.fail(request_id, "receiver not accepting messages")
            return False
        assert tracker is not None  # (track=True: always a tracker)
        out.trackers.append(tracker)
        return True

    def fail(self, request_id: str, reason: str) -> None:
        self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, reason))

    def lose_peer(self, request_id: str, reason: str) -> None:
        address = self._outgoing[request_id].destination.address
        self._lose(address, self._peers[address], reason)

    def count_sent(self, num_bytes: int) -> None:
        self.num_bytes_sent += num_bytes

    # -- the sender's own -----------------------------------------------------------------
    def _flush(self) -> None:
        """Send what waited in the paths (staged rows now on the host)."""
        for path in [*(p.data for p in self._peers.values()), *self._draining]:
            path.flush(self)
        self._draining = [p for p in self._draining if p.busy()]

    def _retire(self, address: str) -> None:
        """Close the peer at `address` (its requests have ended); what waits in its path is
        still flushed (a message of an ended request is dropped there, its blocks let go)."""
        peer = self._peers.pop(address)
        peer.close()
        if peer.data.busy():
            self._draining.append(peer.data)

    def _lose(self, address: str, peer: Peer, reason: str) -> None:
        """A peer's data path broke: every request to it fails (its stream is out of step);
        the next `begin` for it shakes hands anew."""
        logger.warning("kv sender: %s: %s", address, reason)
        peer.lost = reason
        for request_id, out in self._outgoing.items():
            if out.destination.address == address:
                self._end(request_id, TransferEvent(request_id, TransferStatus.FAILED, reason))

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
                self._retire(address)

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
        self._flush()
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
        events = [self._outgoing.pop(request_id).ended for request_id in released]
        return [e for e in events if e is not None]  # (released: only ended ones)

    @property
    def num_pending(self) -> int:
        return len(self._outgoing)

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
