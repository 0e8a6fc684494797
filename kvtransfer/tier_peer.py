"""A worker's tier server: the prefix blocks its pool and disk tier hold, sent to other workers
over the KV transfer layer. How a worker skips what a worker on another host computed (workers
on one host that share the disk tier's folder read each other's files and need none of this).

A worker whose tiers the router may point others at serves them (`TierServer`: a ROUTER
socket on the worker's KV host, loopback by default, under CurveZMQ with the cluster's KV keys
when $TANDEM_KV_SECRET is set, as the KV receivers are). A worker handed a request whose
prefix another worker holds (WorkerRequest.kv_source) fetches the blocks it lacks
(tier_fetch.py) and keeps them in its own tiers; its scheduler then loads them as any tier hit.

The exchange (fetch_messages.py): FETCH names the blocks; the server stages the leading ones
it holds (a prefix is no use past its first gap; a disk block whose checksum fails ends it)
and OFFERs that many; the fetcher reserves them in its receiver and PULLs them to that
Destination; the server sends them with a KVSender, as a prefill worker sends a prompt's KV
(the same handshake, the same grant, the data path the two sides' places allow: NCCL between
GPUs, ZMQ frames with a CRC-32 per layer otherwise), and says when the transfer ended
(PULLED). Staged blocks not pulled within the timeout go back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kvcache.disk_tier import DiskTier
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.fetch_messages import destination_of, fetch_request
from tandem.kvtransfer.fetch_staging import FetchStaging
from tandem.kvtransfer.protocol import (
    Destination,
    MessageKind,
    ProtocolError,
    TransferEvent,
    TransferRefused,
    TransferStatus,
    decode,
    encode,
)
from tandem.kvtransfer.router_socket import RouterSocket
from tandem.kvtransfer.sender import KVSender

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
MAX_BLOCKS_PER_FETCH = 4096
"""A request asks for at most this many blocks (64k tokens at a block size of 16)."""
NUM_STAGED_BLOCKS = 64
"""Blocks a tier server (and a fetcher) stages at once: a longer prefix comes in several
fetches. 47 MB for the default model's blocks, made on the first fetch."""
FETCH_TIMEOUT_S = 5.0
"""How long each step of a fetch waits for the other side: past it, the blocks are recomputed."""

PoolReader = Callable[[list[bytes]], dict[bytes, torch.Tensor]]
"""Block hashes -> copies of the leading ones the worker's pool holds (read between its steps)."""


@dataclass(frozen=True)
class SenderSettings:
    """The worker's KV transfer settings a fetch takes on either side: which data paths the
    tier server's KVSender may take, and the node both it and the fetcher's KVReceiver name."""

    transport: str = "auto"
    node_id: str | None = None
    allow_unencrypted_pairs: bool = False
    checksum: bool = True


@dataclass
class _Offer:
    block_ids: list[int]
    """Staging blocks holding the offered blocks, in prefix order."""
    expires_at: float


class TierServer:
    """Answers fetches from the blocks of ``tier`` and, through ``read_pool``, of the worker's
    pool, on a thread of its own (which alone uses its socket and its sender)."""

    def __init__(self, tier: DiskTier, host: str, curve: CurveKeys | None, read_pool: PoolReader | None = None,
                 settings: SenderSettings | None = None, timeout_s: float = FETCH_TIMEOUT_S,
                 num_staged_blocks: int = NUM_STAGED_BLOCKS) -> None:
        self.tier = tier
        self.read_pool = read_pool
        self.timeout_s = timeout_s
        self.staging = FetchStaging(tier.kv_cache[:, :, 0], num_staged_blocks)
        self.num_served_blocks = 0
        self.num_refused = 0
        """Requests refused: malformed, of another layout, or from a peer without the keys."""
        self._settings = settings or SenderSettings()
        self._curve = curve
        self._sender: KVSender | None = None
        self._offers: dict[str, _Offer] = {}
        self._lock = threading.Lock()
        """Held while a message is answered or offers expire (the offers and the sender are its)."""
        self._socket = RouterSocket(f"tcp://{host}:*", MAX_REQUEST_BYTES, curve, self._count_refused)
        self.address = self._socket.address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-tier-server", daemon=True)
        self._thread.start()

    def _count_refused(self) -> None:
        self.num_refused += 1

    @property
    def num_offered(self) -> int:
        """Offers not yet pulled (nor expired)."""
        return len(self._offers)

    def _run(self) -> None:
        socket = self._socket.socket
        try:
            while not self._stop.is_set():
                self._expire(time.monotonic())
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 2:  # [peer identity, request]
                    self._count_refused()
                    continue
                socket.send_multipart([frames[0], self.answer(frames[1])])
        finally:
            self._expire(float("inf"))
            if self._sender is not None:
                self._sender.close()
            self._socket.close()

    def answer(self, request: bytes) -> bytes:
        """The reply to one message (see the module docstring). Any thread may ask: one at a time."""
        with self._lock:
            return self._answer(request)

    def _answer(self, request: bytes) -> bytes:
        request_id = ""
        try:
            kind, request_id, message = decode(request)
            if kind is MessageKind.FETCH:
                fetch = fetch_request(message, MAX_BLOCKS_PER_FETCH)
                return self._offer(request_id, fetch.layout, list(fetch.block_hashes))
            if kind is MessageKind.PULL:
                return self._send(request_id, destination_of(message))
            raise ProtocolError("malformed", f"a tier server answers FETCH and PULL, not {kind.name}")
        except ProtocolError as e:
            self._count_refused()
            return encode(MessageKind.OFFER, request_id, num_blocks=0, error=f"malformed request: {e}")

    def _offer(self, request_id: str, layout: str, hashes: list[bytes]) -> bytes:
        if layout != self.tier.key:
            self._count_refused()
            return encode(MessageKind.OFFER, request_id, num_blocks=0,
                          error="another KV layout (model, weights, KV dtype or block shape)")
        if request_id in self._offers:
            return encode(MessageKind.OFFER, request_id, num_blocks=0, error="already offered under this id")
        block_ids = self.staging.take(len(hashes))
        if hashes and not block_ids:
            return encode(MessageKind.OFFER, request_id, num_blocks=0, error="busy: every staging block is offered")
        num_staged = self._stage(hashes[:len(block_ids)], block_ids)
        self.staging.give_back(block_ids[num_staged:])
        if num_staged:
            self._offers[request_id] = _Offer(block_ids[:num_staged], time.monotonic() + self.timeout_s)
        return encode(MessageKind.OFFER, request_id, num_blocks=num_staged, error=None)

    def _stage(self, hashes: list[bytes], block_ids: list[int]) -> int:
        """Copy the leading blocks of ``hashes`` the pool or the tier holds into ``block_ids``
        (as many as there are) -> how many."""
        try:
            in_pool = {} if self.read_pool is None else self.read_pool(hashes)
        except Exception as e:  # noqa: BLE001 - the worker's engine stopped or is stuck: its tier answers alone
            logger.warning("kv tier server: the pool's blocks could not be read: %r", e)
            in_pool = {}
        staging = self.staging.kv_cache
        for i, (block_hash, block_id) in enumerate(zip(hashes, block_ids)):
            block = in_pool.get(block_hash)
            if block is None:
                block = self.tier.block(block_hash)  # (checked: a corrupt file is no block)
            if block is None:
                return i
            staging[:, :, block_id].copy_(block)
        return len(block_ids)

    def _send(self, request_id: str, destination: Destination) -> bytes:
        """Send an offer's blocks to ``destination`` -> PULLED, once the receiver has them all
        or the transfer failed; its staging blocks go back only once the sender let go of them."""
        offer = self._offers.pop(request_id, None)
        if offer is None:
            return encode(MessageKind.PULLED, request_id, ok=False, reason="nothing offered under this id")
        if destination.request_id != request_id or destination.num_cached_tokens != 0:
            self.staging.give_back(offer.block_ids)
            return encode(MessageKind.PULLED, request_id, ok=False, reason="not the offer's destination")
        sender = self._sender_of()
        try:
            sender.connect(destination.address, self.timeout_s, destination)  # (a silent fetcher: its timeout)
            sender.begin(destination, offer.block_ids)
        except (TransferRefused, TimeoutError, ValueError) as e:  # nothing in flight: the blocks go back
            self.staging.give_back(offer.block_ids)
            return encode(MessageKind.PULLED, request_id, ok=False, reason=f"not sent: {e}")
        try:
            for layer in range(sender.layout.num_layers):
                if not sender.send_layer(request_id, layer):
                    break
        except ValueError as e:  # (a destination that does not cover the offer)
            logger.warning("kv tier server: %s not sent to %s: %s", request_id, destination.address, e)
            sender.abort(request_id)
        ended = self._wait_for(sender, request_id)
        if ended is None:  # the sender still holds the blocks: they never go back
            logger.warning("kv tier server: %s: its %d staging blocks are held by a stuck transfer",
                           request_id, len(offer.block_ids))
            return encode(MessageKind.PULLED, request_id, ok=False, reason="the transfer did not end")
        self.staging.give_back(offer.block_ids)
        if ended.status is TransferStatus.DONE:
            self.num_served_blocks += len(offer.block_ids)
        return encode(MessageKind.PULLED, request_id, ok=ended.status is TransferStatus.DONE, reason=ended.reason)

    def _wait_for(self, sender: KVSender, request_id: str) -> TransferEvent | None:
        """The transfer's end, released by the sender (None: not within twice the timeout)."""
        deadline = time.monotonic() + 2 * self.timeout_s
        while time.monotonic() < deadline:
            for event in sender.poll():
                if event.request_id == request_id:
                    return event
            if time.monotonic() > deadline - self.timeout_s:
                sender.abort(request_id)  # (no ack within the timeout: it fails, then lets go)
            time.sleep(0.001)
        return None

    def _sender_of(self) -> KVSender:
        if self._sender is None:
            s = self._settings
            self._sender = KVSender(self.staging.kv_cache, self.timeout_s, checksum=s.checksum, node_id=s.node_id,
                                    transport=s.transport, curve=self._curve,
                                    allow_unencrypted_pairs=s.allow_unencrypted_pairs)
        return self._sender

    def _expire(self, now: float) -> None:
        with self._lock:
            for request_id in [r for r, o in self._offers.items() if o.expires_at <= now]:
                self.staging.give_back(self._offers.pop(request_id).block_ids)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
