"""The fetching side of reuse across hosts (tier_peer.py has the serving side): the prefix
blocks another worker's tiers hold, received over the KV transfer layer into staging blocks
and handed back as copies, for the worker's own tiers.

One fetch (`TierFetcher.fetch`) is a few exchanges on one DEALER socket to the tier server,
in chunks of at most the staging's size: FETCH the chunk's hashes, take the OFFER, reserve that
many staging blocks in the receiver (`KVReceiver.expect`: a Destination with its own grant),
PULL them there, and wait for the server's PULLED and the receiver's DONE. A chunk the server
holds only part of ends the fetch (a prefix is no use past its first gap). Any failure (a peer
gone, refused, slow, a layer failing its CRC-32) costs only the recompute of what did not
arrive: the reservation is aborted and the staging blocks go back, on every path.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.fetch_messages import destination_fields, offer_of
from tandem.kvtransfer.fetch_staging import FetchStaging
from tandem.kvtransfer.protocol import MessageKind, ProtocolError, TransferEvent, TransferStatus, decode, encode
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.tier_peer import FETCH_TIMEOUT_S, NUM_STAGED_BLOCKS, SenderSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchResult:
    """What one fetch brought back."""

    blocks: list[torch.Tensor]
    """The leading blocks asked for, each [num_layers, 2, block_size, num_kv_heads, head_dim] in
    host memory."""
    error: str | None = None
    """Why it stopped short of every block the server held (None: it did not)."""


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
        self.num_blocks += len(result.blocks)
        self.num_bytes += len(result.blocks) * block_bytes
        self.seconds += time.perf_counter() - started
        self.num_failed += result.error is not None


class _Failed(Exception):
    """A chunk that brought nothing, and why."""


class TierFetcher:
    """Fetches blocks shaped like ``block`` into staging on its device, through a KVReceiver
    bound on ``host`` (made on the first fetch). Thread-safe: fetches may run side by side."""

    def __init__(self, block: torch.Tensor, host: str, curve: CurveKeys | None, settings: SenderSettings | None = None,
                 timeout_s: float = FETCH_TIMEOUT_S, num_staged_blocks: int = NUM_STAGED_BLOCKS) -> None:
        self.staging = FetchStaging(block, num_staged_blocks)
        self.timeout_s = timeout_s
        self._host, self._curve = host, curve
        self._settings = settings or SenderSettings()
        self._receiver: KVReceiver | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._ended = threading.Condition()
        self._waiting: dict[str, TransferEvent | None] = {}
        """Chunks waiting for their receiver event (None: not come yet), filled by the reader."""
        self._stop = threading.Event()

    def fetch(self, address: str, layout: str, block_hashes: list[bytes], request_id: str = "") -> FetchResult:
        """The leading blocks of ``block_hashes`` (a prompt's consecutive blocks) of ``layout``
        that the tier server at ``address`` holds. Never raises for the peer's sake: a peer
        gone, slow or wrong gives fewer blocks and the reason."""
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.connect(socket)
        blocks: list[torch.Tensor] = []
        try:
            socket.connect(address)
            while len(blocks) < len(block_hashes):
                chunk = block_hashes[len(blocks):len(blocks) + self.staging.num_blocks]
                got = self._chunk(socket, f"{request_id}/fetch-{next(self._ids)}", layout, chunk)
                blocks += got
                if len(got) < len(chunk):
                    break
        except _Failed as e:
            return FetchResult(blocks, f"{address}: {e}")
        except zmq.ZMQError as e:  # (an address that cannot be connected to)
            return FetchResult(blocks, f"{address}: {e}")
        finally:
            socket.close()
        return FetchResult(blocks)

    def _chunk(self, socket: zmq.Socket[bytes], fetch_id: str, layout: str, hashes: list[bytes]) -> list[torch.Tensor]:
        block_ids = self.staging.take(len(hashes))
        if not block_ids:
            raise _Failed("no staging block free (too many fetches at once)")
        receiver = self._receiver_of()
        expected = False
        try:
            kind, msg = self._ask(socket, fetch_id, encode(MessageKind.FETCH, fetch_id, layout=layout,
                                                         block_hashes=hashes[:len(block_ids)]))
            num_blocks, error = offer_of(msg) if kind is MessageKind.OFFER else (0, f"a {kind.name} reply")
            if error is not None:
                raise _Failed(f"refused: {error}")
            if not 0 <= num_blocks <= len(block_ids):
                raise _Failed(f"offered {num_blocks} blocks of {len(block_ids)}")
            if num_blocks == 0:
                return []
            held = block_ids[:num_blocks]
            with self._ended:
                self._waiting[fetch_id] = None
            destination = receiver.expect(fetch_id, held, num_blocks * self.staging.block_size, self.timeout_s)
            expected = True
            pull = encode(MessageKind.PULL, fetch_id, **destination_fields(destination))
            kind, msg = self._ask(socket, fetch_id, pull, timeout_s=3 * self.timeout_s)  # (the server may wait 2x)
            if kind is not MessageKind.PULLED or msg.get("ok") is not True:
                raise _Failed(f"not sent: {msg.get('reason', kind.name)}")
            ended = self._event(fetch_id)
            if ended is None or ended.status is not TransferStatus.DONE:
                raise _Failed(f"not received: {'no end in time' if ended is None else ended.reason}")
            expected = False  # (DONE: the receiver holds nothing of it)
            staging = self.staging.kv_cache
            return [staging[:, :, b].to("cpu", copy=True) for b in held]
        except ProtocolError as e:
            raise _Failed(f"a malformed reply: {e}") from None
        finally:
            with self._ended:
                self._waiting.pop(fetch_id, None)
            if expected:
                receiver.abort(fetch_id)  # NOTE: a private pool: FENCED, nothing writes any more
            self.staging.give_back(block_ids)

    def _ask(self, socket: zmq.Socket[bytes], fetch_id: str, message: bytes, timeout_s: float | None = None
             ) -> tuple[MessageKind, dict]:
        socket.send(message)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not socket.poll(int(timeout_s * 1000)):
            raise _Failed(f"no reply in {timeout_s:.0f} s")
        kind, request_id, msg = decode(socket.recv())
        if request_id != fetch_id:
            raise ProtocolError("malformed", f"a reply to {request_id!r}, not {fetch_id!r}")
        return kind, msg

    def _event(self, fetch_id: str) -> TransferEvent | None:
        """The receiver's event for ``fetch_id`` (None: none within the timeout)."""
        with self._ended:
            self._ended.wait_for(lambda: self._waiting.get(fetch_id) is not None, self.timeout_s)
            return self._waiting.get(fetch_id)

    def _receiver_of(self) -> KVReceiver:
        with self._lock:
            if self._receiver is None:
                s = self._settings
                self._receiver = KVReceiver(self.staging.kv_cache, f"tcp://{self._host}:0", self.timeout_s,
                                            node_id=s.node_id, curve=self._curve,
                                            allow_unencrypted_pairs=s.allow_unencrypted_pairs)
                threading.Thread(target=self._read_events, args=(self._receiver,), name="kv-fetch-events",
                                 daemon=True).start()
            return self._receiver

    def _read_events(self, receiver: KVReceiver) -> None:
        while not self._stop.is_set():
            event = receiver.get_event(timeout=0.1)
            if event is not None:
                with self._ended:
                    if event.request_id in self._waiting:
                        self._waiting[event.request_id] = event
                        self._ended.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._receiver is not None:
                self._receiver.close()
