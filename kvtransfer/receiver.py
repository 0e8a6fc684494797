"""The receiving side: KV for reserved blocks arrives layer by layer and is written in place.

A background thread owns the ROUTER socket: it answers handshakes, checks every message
against the request's reservation before writing a byte, acks finished requests to their
sender, and fails requests whose deadline passes (the sweep runs on a timer, traffic or
not). The owner (the decode worker) reserves blocks, calls `expect`, and frees the blocks
when `get_event` reports the request DONE and done with, or FAILED.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from tandem.kvtransfer.payload import TORCH_DTYPES, DistPayload, rows_of
from tandem.kvtransfer.protocol import (
    Destination, KVLayout, LayerHeader, MessageKind, ProtocolError, TransferEvent, TransferStatus, decode, encode,
    layer_header, payload_crc32,
)
from tandem.kvtransfer.sink import KVSink, PoolSink
from tandem.kvtransfer.slots import covering_blocks, token_slots

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "tcp://127.0.0.1:0"  # loopback unless told otherwise; port 0 picks a free one
SWEEP_INTERVAL_S = 0.05
MAX_ENDED = 100_000  # ended request ids remembered, so late messages are told to stop


@dataclass
class _Expected:
    destination: Destination
    timeout_s: float
    received: list[int]
    """Tokens in place so far, per layer (they arrive in order after the cached prefix)."""
    sender: bytes | None = None
    """ZMQ identity of the sender, once it has sent a layer."""
    deadline: float | None = None
    """When the KV is overdue: timeout_s after the sender's latest layer message, so that a
    reservation whose prompt waits in the prefill queue, or between its chunks, never times
    out; before the first one its owner ends it (NOTE: timeouts count from work, not from
    queues)."""


class KVReceiver:
    def __init__(self, kv_cache: torch.Tensor | None, address: str = DEFAULT_ADDRESS, timeout_s: float = 30.0,
                 dist_payload: DistPayload | None = None, model: str | None = None,
                 sink: KVSink | None = None) -> None:
        """kv_cache: the pool written into, [layers, 2, blocks, block_size, kv_heads, head_dim]
        (or None with a sink that takes the rows instead).
        timeout_s: a request fails when its KV has not all arrived this long after its latest
        layer message (not after `expect`: the prompt may wait in the prefill queue before that).
        model: the weights' identity (model_fingerprint): senders must name the same one.
        """
        self.model = model
        self.kv_cache = kv_cache
        self.sink: KVSink = sink if sink is not None else PoolSink(kv_cache)
        self.layout: KVLayout = self.sink.layout
        self.timeout_s = timeout_s
        self.dist_payload = dist_payload
        self.dropped: collections.Counter[str] = collections.Counter()
        """Messages dropped, by reason (malformed, unknown_request, wrong_dtype, ...)."""
        self.num_bytes_received = 0
        """KV payload bytes written into the pool (K and V), for the metrics."""
        self._expected: dict[str, _Expected] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._events: queue.Queue[TransferEvent] = queue.Queue()
        self._outbox: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    # -- the owner's side -------------------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], num_tokens: int,
               timeout_s: float | None = None, num_cached_tokens: int = 0) -> Destination:
        """Wait for the KV of tokens [num_cached_tokens, num_tokens) into `block_ids`
        (reserved by the caller; their first num_cached_tokens tokens already hold theirs)."""
        if num_tokens < 1 or len(block_ids) != -(-num_tokens // self.layout.block_size):
            raise ValueError(f"{request_id}: {len(block_ids)} blocks cannot hold exactly {num_tokens} tokens")
        if any(not 0 <= b < self.layout.num_blocks for b in block_ids):
            raise ValueError(f"{request_id}: block ids outside the pool of {self.layout.num_blocks}")
        # Whole blocks only: a block that is part cached, part written would be shared while written.
        if not 0 <= num_cached_tokens < num_tokens or num_cached_tokens % self.layout.block_size:
            raise ValueError(f"{request_id}: {num_cached_tokens} cached tokens is not a whole number of "
                             f"blocks of {self.layout.block_size} below {num_tokens}")
        dest = Destination(request_id, self.address, tuple(block_ids), num_tokens, num_cached_tokens)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if request_id in self._expected:
                raise ValueError(f"{request_id}: already expected")
            self._ended.pop(request_id, None)
            self._expected[request_id] = _Expected(dest, timeout_s, [num_cached_tokens] * self.layout.num_layers)
        return dest

    def abort(self, request_id: str) -> bool:
        """Stop waiting for a request and tell its sender; no event follows. -> whether it was pending.

        NOTE: once this returns, no byte is written into the request's blocks any more.
        """
        with self._lock:  # the writer holds the lock while it writes
            exp = self._expected.pop(request_id, None)
            self._remember_ended(request_id)
        if exp is not None and exp.sender is not None:
            self._outbox.put((exp.sender, encode(MessageKind.ABORT, request_id)))
        return exp is not None

    def get_event(self, timeout: float | None = None) -> TransferEvent | None:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    @property
    def num_pending(self) -> int:
        return len(self._expected)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()

    # -- the I/O thread ---------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_sweep = time.monotonic()
        while not self._stop.is_set():
            if poller.poll(timeout=int(SWEEP_INTERVAL_S * 1000) // 5):
                frames = self._socket.recv_multipart(copy=False)
                try:
                    self._handle(frames[0].bytes, frames[1:])
                except ProtocolError as e:
                    self.dropped[e.reason] += 1
                    # Layers already in flight when a request ended are expected (one per layer): not a warning.
                    logger.log(logging.DEBUG if e.reason == "ended_request" else logging.WARNING,
                               "kv receiver dropped a message: %s", e)
                except Exception:  # NOTE: the thread must outlive any message, or deadlines stop
                    self.dropped["internal_error"] += 1
                    logger.exception("kv receiver failed on a message")
            while not self._outbox.empty():
                self._socket.send_multipart(self._outbox.get())
            if time.monotonic() >= next_sweep:
                self._sweep_deadlines()
                next_sweep = time.monotonic() + SWEEP_INTERVAL_S

    def _handle(self, sender: bytes, frames: list[zmq.Frame]) -> None:
        if not frames:
            raise ProtocolError("malformed", "empty message")
        kind, request_id, msg = decode(frames[0].buffer)
        if kind is MessageKind.HELLO:
            self._handshake(sender, msg)
        elif kind is MessageKind.LAYER:
            self._receive_layer(sender, layer_header(request_id, msg), frames[1:], msg.get("dist_rank"))
        elif kind is MessageKind.ABORT:
            with self._lock:
                exp = self._expected.pop(request_id, None)
                self._remember_ended(request_id)
            if exp is not None:
                self._events.put(TransferEvent(request_id, TransferStatus.FAILED, "aborted by the sender"))
        else:
            raise ProtocolError("malformed", f"a receiver does not expect {kind.name}")

    def _handshake(self, sender: bytes, msg: dict) -> None:
        try:
            theirs = KVLayout.from_dict(msg.get("layout"))
        except ProtocolError as e:
            self._socket.send_multipart([sender, encode(MessageKind.REFUSED, reason=str(e))])
            raise
        why = self.layout.incompatibility(theirs)
        if why is None and self.model is not None and msg.get("model") != self.model:
            why = f"model differs: receiver serves {self.model!r}, sender {msg.get('model')!r}"
        if why is None and ("dist_rank" in msg) != (self.dist_payload is not None):
            why = "one side sends KV on torch.distributed, the other expects it in ZMQ frames"
        if why is not None:
            logger.warning("kv receiver refused a sender: %s", why)
            self._socket.send_multipart([sender, encode(MessageKind.REFUSED, reason=why)])
            return
        reply = {"layout": self.layout.as_dict()}
        if self.dist_payload is not None:
            reply["dist_rank"] = self.dist_payload.rank
        self._socket.send_multipart([sender, encode(MessageKind.HELLO_OK, **reply)])

    def _receive_layer(self, sender: bytes, h: LayerHeader, frames: list[zmq.Frame], dist_rank: object) -> None:
        k_parts, v_parts = self._payload(sender, h, frames, dist_rank)
        with self._lock:
            exp = self._expected.get(h.request_id)
            if exp is None:
                if h.request_id in self._ended:
                    self._socket.send_multipart([sender, encode(MessageKind.ABORT, h.request_id)])
                    raise ProtocolError("ended_request", f"{h.request_id} has ended")
                raise ProtocolError("unknown_request", h.request_id)
            exp.deadline = time.monotonic() + exp.timeout_s  # the sender is at work: a stall is timed
            slots = self._check(h, exp)
            exp.sender = sender
            for kv, parts in ((0, k_parts), (1, v_parts)):
                self.sink.write(h.layer, kv, slots, parts)
            exp.received[h.layer] += h.num_tokens
            self.num_bytes_received += 2 * h.num_tokens * self.layout.row_bytes
            complete = all(n == exp.destination.num_tokens for n in exp.received)
            if complete:
                del self._expected[h.request_id]
                self._remember_ended(h.request_id)
        if complete:
            self._socket.send_multipart([sender, encode(MessageKind.DONE, h.request_id)])
            self._events.put(TransferEvent(h.request_id, TransferStatus.DONE))

    def _payload(self, sender: bytes, h: LayerHeader, frames: list[zmq.Frame], dist_rank: object
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """-> the K and the V rows the message carries, as pieces ([n_i, *row_shape]) in token order."""
        dist_parts = None
        if self.dist_payload is not None:
            # Drained before any check (see DistPayload), as the header claims it.
            if not isinstance(dist_rank, int) or frames or h.dtype not in TORCH_DTYPES:
                raise ProtocolError("malformed", "a torch.distributed LAYER has dist_rank, a dtype and no frames")
            try:
                k, v = self.dist_payload.recv(dist_rank, h.num_tokens, h.row_shape, h.dtype)
            except RuntimeError as e:  # the peer died between header and tensors
                self._fail_sender(sender, h.request_id, f"torch.distributed peer lost: {e}")
                raise ProtocolError("peer_lost", f"{h.request_id}: {e}") from None
            dist_parts = ([k], [v])
        if h.dtype != self.layout.dtype:
            raise ProtocolError("wrong_dtype", f"{h.request_id}: {h.dtype}, the pool holds {self.layout.dtype}")
        if h.row_shape != (self.layout.num_kv_heads, self.layout.head_dim):
            raise ProtocolError("wrong_shape", f"{h.request_id}: rows of {h.row_shape}")
        if dist_parts is not None:
            return dist_parts
        if len(frames) != 2 * len(h.frame_tokens) or sum(h.frame_tokens) != h.num_tokens \
                or min(h.frame_tokens, default=0) < 1:
            raise ProtocolError("truncated", f"{h.request_id}: {len(frames)} frames for {h.frame_tokens}")
        parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, (frame, n) in enumerate(zip(frames, h.frame_tokens * 2)):
            if len(frame.buffer) != n * self.layout.row_bytes:
                raise ProtocolError("truncated", f"{h.request_id}: {len(frame.buffer)} bytes for {n} rows")
            parts[i // len(h.frame_tokens)].append(rows_of(frame.buffer, h.dtype, h.row_shape))
        if h.crc32 is not None and payload_crc32(f.buffer for f in frames) != h.crc32:
            # Corrupted on the way: this request's KV can never be whole, the others are unharmed.
            self._fail_request(sender, h.request_id, "checksum mismatch: the KV was corrupted in transit")
            raise ProtocolError("checksum", f"{h.request_id}: layer {h.layer}")
        return parts

    def _check(self, h: LayerHeader, exp: _Expected) -> np.ndarray:
        """The destination slots of a LAYER message, once it is proven to touch only its own blocks."""
        layout, dest = self.layout, exp.destination
        if h.layer >= layout.num_layers:
            raise ProtocolError("layer_out_of_range", f"{h.request_id}: layer {h.layer}")
        if h.token_start < exp.received[h.layer]:
            raise ProtocolError("duplicate_layer", f"{h.request_id}: layer {h.layer} tokens from {h.token_start} again")
        if h.token_start > exp.received[h.layer] or h.num_tokens == 0 \
                or h.token_start + h.num_tokens > dest.num_tokens:
            raise ProtocolError("bad_token_range", f"{h.request_id}: layer {h.layer} tokens "
                                f"[{h.token_start}, {h.token_start + h.num_tokens}) after {exp.received[h.layer]}")
        if any(not 0 <= b < layout.num_blocks for b in h.block_ids):
            raise ProtocolError("block_out_of_range", f"{h.request_id}: {h.block_ids}")
        end = h.token_start + h.num_tokens
        if list(h.block_ids) != covering_blocks(dest.block_ids, layout.block_size, h.token_start, end):
            raise ProtocolError("foreign_block", f"{h.request_id}: blocks {h.block_ids} are not its own")
        return token_slots(h.block_ids, layout.block_size, h.token_start, end, h.token_start // layout.block_size)

    def _fail_request(self, sender: bytes, request_id: str, reason: str) -> None:
        """Fail one request that is expected (nothing when it is not) and tell its sender."""
        with self._lock:
            if self._expected.pop(request_id, None) is None:
                return
            self._remember_ended(request_id)
        self._socket.send_multipart([sender, encode(MessageKind.FAILED, request_id, reason=reason)])
        self._events.put(TransferEvent(request_id, TransferStatus.FAILED, reason))

    def _fail_sender(self, sender: bytes, request_id: str, reason: str) -> None:
        """Fail `request_id` and every pending request of a sender whose data path broke
        (its stream is out of step)."""
        with self._lock:
            lost = [rid for rid, e in self._expected.items() if e.sender == sender or rid == request_id]
            for rid in lost:
                del self._expected[rid]
                self._remember_ended(rid)
        for rid in lost:
            self._events.put(TransferEvent(rid, TransferStatus.FAILED, reason))

    def _sweep_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, e in self._expected.items() if e.deadline is not None and e.deadline <= now]
            ended = [(rid, self._expected.pop(rid)) for rid in expired]
            for rid in expired:
                self._remember_ended(rid)
        for rid, exp in ended:
            logger.warning("kv transfer %s timed out: nothing for %.1f s", rid, exp.timeout_s)
            self.dropped["timeout"] += 1
            if exp.sender is not None:
                self._socket.send_multipart([exp.sender, encode(MessageKind.FAILED, rid, reason="timeout")])
            self._events.put(TransferEvent(rid, TransferStatus.FAILED, "timed out waiting for KV"))

    def _remember_ended(self, request_id: str) -> None:
        self._ended[request_id] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
