"""Prefix blocks fetched from another worker's disk tier over ZMQ: how a worker skips what a
worker on another host computed (workers on one host that share the tier's folder read each
other's files and need none of this).

A worker whose tiers the router may point others at serves its pool and disk tier (`TierServer`: a ROUTER
socket on the worker's KV host, loopback by default, under CurveZMQ with the cluster's KV keys
when $TANDEM_KV_SECRET is set, as the KV receivers are). A worker handed a request whose
prefix another worker holds (WorkerRequest.kv_source) asks it for the blocks it lacks
(`fetch_blocks`) and keeps them in its own tiers; its scheduler then loads them as any tier hit.

Wire: the transfer protocol's messages (protocol.py: a msgpack header, nothing unpickled).
The fetcher sends FETCH (its layout key and the block hashes); the server answers BLOCKS
(``num_blocks``, and ``error`` when it refused) followed by that many frames, each a block
record as the disk tier stores it (magic, the block's hash, length and checksum, then its KV
bytes). Only the leading blocks the server holds go back: a prefix is no use past its first
gap. The fetcher checks every record against the hash it asked for and keeps the blocks
before the first that fails: a flipped byte costs a recompute, never a wrong token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from tandem.kvcache.disk_tier import DiskTier, parse_record
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.protocol import MessageKind, ProtocolError, decode, encode, fetch_request
from tandem.kvtransfer.router_socket import RouterSocket

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
MAX_BLOCKS_PER_FETCH = 4096
"""A request asks for at most this many blocks (64k tokens at a block size of 16)."""
FETCH_TIMEOUT_S = 5.0
"""How long a fetch waits for the reply: past it, the blocks are recomputed."""


@dataclass(frozen=True)
class FetchResult:
    """What one fetch brought back."""

    payloads: list[memoryview]
    """The KV bytes of the leading blocks asked for, each checked against its hash."""
    error: str | None = None
    """Why it stopped short of every block the server held (None: it did not)."""


PoolReader = Callable[[list[bytes]], dict[bytes, bytes]]
"""Block hashes -> the records of those the worker's pool holds (read between its steps)."""


class TierServer:
    """Answers peers' fetches from the blocks of ``tier`` and, through ``read_pool``, of the
    worker's pool, on a thread of its own."""

    def __init__(self, tier: DiskTier, host: str, curve: CurveKeys | None, read_pool: PoolReader | None = None
                 ) -> None:
        self.tier = tier
        self.read_pool = read_pool
        self.num_served_blocks = 0
        self.num_refused = 0
        """Requests refused: malformed, of another layout, or from a peer without the keys."""
        self._socket = RouterSocket(f"tcp://{host}:*", MAX_REQUEST_BYTES, curve, self._count_refused)
        self.address = self._socket.address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-tier-server", daemon=True)
        self._thread.start()

    def _count_refused(self) -> None:
        self.num_refused += 1

    def _run(self) -> None:
        # NOTE: the socket lives on this thread alone (ZMQ sockets are not thread-safe).
        socket = self._socket.socket
        try:
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 2:  # [peer identity, request]
                    self._count_refused()
                    continue
                socket.send_multipart([frames[0], *self.answer(frames[1])], copy=False)
        finally:
            self._socket.close()

    def answer(self, request: bytes) -> list[bytes]:
        """The reply frames to one request (see the module docstring)."""
        request_id = ""
        try:
            kind, request_id, message = decode(request)
            if kind is not MessageKind.FETCH:
                raise ProtocolError("malformed", f"a tier server answers FETCH, not {kind.name}")
            fetch = fetch_request(message, MAX_BLOCKS_PER_FETCH)
        except ProtocolError as e:
            self._count_refused()
            return [_header(request_id, 0, f"malformed request: {e}")]
        if fetch.layout != self.tier.key:
            self._count_refused()
            return [_header(request_id, 0, "another KV layout (model, weights, KV dtype or block shape)")]
        hashes = list(fetch.block_hashes)
        try:
            in_pool = {} if self.read_pool is None else self.read_pool(hashes)
        except Exception as e:  # noqa: BLE001 - the worker's engine stopped or is stuck: its tier answers alone
            logger.warning("kv tier server: the pool's blocks could not be read: %r", e)
            in_pool = {}
        records = []
        for block_hash in hashes:
            record = in_pool.get(block_hash) or self.tier.record(block_hash)
            if record is None:
                break
            records.append(record)
        self.num_served_blocks += len(records)
        return [_header(request_id, len(records), None), *records]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def fetch_blocks(address: str, layout: str, block_hashes: list[bytes], block_bytes: int,
                 curve: CurveKeys | None, timeout_s: float = FETCH_TIMEOUT_S, request_id: str = "") -> FetchResult:
    """Ask the TierServer at ``address`` for ``block_hashes`` (a prompt's consecutive blocks)
    of ``layout``; -> the KV bytes of those it held, from the first on, checked. Never raises
    for the peer's sake: a peer gone, slow or wrong gives fewer blocks and the reason."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.connect(socket)
    try:
        socket.connect(address)
        socket.send(encode(MessageKind.FETCH, request_id, layout=layout, block_hashes=block_hashes))
        if not socket.poll(int(timeout_s * 1000)):
            return FetchResult([], f"no reply from {address} in {timeout_s:.0f} s")
        frames = socket.recv_multipart(copy=False)
    except zmq.ZMQError as e:  # (an address that cannot be connected to)
        return FetchResult([], f"{address}: {e}")
    finally:
        socket.close()
    try:
        kind, _, header = decode(frames[0].buffer)
    except ProtocolError as e:
        return FetchResult([], f"a malformed reply: {e}")
    num_blocks, error = header.get("num_blocks"), header.get("error")
    if kind is not MessageKind.BLOCKS or not isinstance(num_blocks, int) or not isinstance(error, (str, type(None))):
        return FetchResult([], "a malformed reply")
    if error is not None:
        return FetchResult([], f"refused: {error}")
    payloads: list[memoryview] = []
    for block_hash, frame in zip(block_hashes, frames[1:1 + num_blocks]):
        payload = parse_record(frame.buffer, block_hash, block_bytes)
        if payload is None:
            return FetchResult(payloads, f"block {block_hash.hex()} failed its check")
        payloads.append(payload)
    if len(payloads) < min(num_blocks, len(block_hashes)):
        return FetchResult(payloads, "a short reply")
    return FetchResult(payloads)


@dataclass
class PeerFetchCounters:
    """What a worker's fetches from other workers' tiers did (read by its metrics)."""

    num_fetches: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    num_failed: int = 0
    """Fetches that stopped short for a reason other than the peer lacking the blocks."""

    def fetched(self, result: FetchResult, block_bytes: int, started: float) -> None:
        self.num_fetches += 1
        self.num_blocks += len(result.payloads)
        self.num_bytes += len(result.payloads) * block_bytes
        self.seconds += time.perf_counter() - started
        self.num_failed += result.error is not None


def _header(request_id: str, num_blocks: int, error: str | None) -> bytes:
    return encode(MessageKind.BLOCKS, request_id, num_blocks=num_blocks, error=error)
