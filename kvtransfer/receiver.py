"""The receiving side: KV for reserved blocks arrives layer by layer and is written in place.

A background thread owns the ROUTER socket: it answers handshakes, checks every message
against the request's reservation before writing a byte, acks finished requests to their
sender, and fails requests whose deadline passes (the sweep runs on a timer, traffic or
not). The owner (the decode worker) reserves blocks, calls `expect`, and frees the blocks
when `get_event` reports the request DONE and done with, or FAILED.

How each sender's rows come in is its connector's (connectors/), settled in its handshake:
in the frames, by its torch.distributed pair, or written by the sender itself into this pool
(in shared memory, shared_pool.py, or on a GPU by CUDA IPC, cuda_ipc.py), whose headers are
checked all the same, and whose grant is revoked under the fence (fence.py) whenever its
reservation ends.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import torch
import zmq

from tandem.kvtransfer.connectors.base import CorruptPayload, PathBroken, ReceivePath, ReceiverSide
from tandem.kvtransfer.connectors.zmq_frames import FRAMES
from tandem.kvtransfer.cuda_ipc import device_identity
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.dist_pairs import ReceiverPairs
from tandem.kvtransfer.fence import granted_blocks
from tandem.kvtransfer.handshake import SharedPool, answer_hello
from tandem.kvtransfer.placement import host_identity
from tandem.kvtransfer.protocol import (
    MAX_HEADER_BYTES,
    AbortOutcome,
    Destination,
    KVLayout,
    LayerHeader,
    MessageKind,
    ProtocolError,
    TransferEvent,
    TransferStatus,
    decode,
    encode,
    grant_of,
    layer_header,
)
from tandem.kvtransfer.reservation import (
    RecentlyEnded,
    Reservation,
    check_layer,
    check_reservation,
    is_granted,
    layer_slots,
    new_grant,
)
from tandem.kvtransfer.revoker import Revoker
from tandem.kvtransfer.router_socket import RouterSocket
from tandem.kvtransfer.sink import KVSink, PoolSink

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "tcp://127.0.0.1:0"  # loopback unless told otherwise; port 0 picks a free one
SWEEP_INTERVAL_S = 0.05


class KVReceiver:
    def __init__(self, kv_cache: torch.Tensor | None, address: str = DEFAULT_ADDRESS, timeout_s: float = 30.0,
                 model: str | None = None, sink: KVSink | None = None, shared_pool: SharedPool | None = None,
                 node_id: str | None = None, curve: CurveKeys | None = None,
                 allow_unencrypted_pairs: bool = False) -> None:
        """kv_cache: the pool written into, [layers, 2, blocks, block_size, kv_heads, head_dim]
        (or None with a sink that takes the rows instead).
        timeout_s: a request fails when its KV has not all arrived this long after its latest
        layer message (not after `expect`: the prompt may wait in the prefill queue before that).
        model: the weights' identity (model_fingerprint): senders must name the same one.
        shared_pool: kv_cache offered to same-node senders to write in place: its file in
        shared memory (HostSharedPool), or its CUDA IPC export (cuda_ipc.DevicePoolExport).
        node_id: this worker's node, which Destinations name (default: placement.host_identity()).
        curve: the cluster's CurveZMQ keys: the socket is encrypted and admits only its senders.
        allow_unencrypted_pairs: with `curve`, torch.distributed pairs (never encrypted) are
        taken all the same (path_choice.ALLOW_UNENCRYPTED_FLAG); else refused.
        """
        if shared_pool is not None and (sink is not None or kv_cache is None
                                        or kv_cache.data_ptr() != shared_pool.kv_cache.data_ptr()):
            raise ValueError("a shared pool must be the very pool written into (kv_cache, no sink)")
        self.shared_pool = shared_pool
        self.unencrypted_pairs_refused = curve is not None and not allow_unencrypted_pairs
        self.node_id = host_identity() if node_id is None else node_id
        self.device = (shared_pool.device if shared_pool is not None
                       else "" if kv_cache is None else device_identity(kv_cache.device, self.node_id))
        """The pool's CUDA device identity, which Destinations name ("" in host memory)."""
        self._paths: dict[bytes, ReceivePath] = {}
        """How each sender's rows come in, by its ZMQ identity (the I/O thread's; frames when
        it never shook hands)."""
        self.model = model
        self.kv_cache = kv_cache
        if sink is None:
            assert kv_cache is not None, "a receiver without a sink writes into kv_cache"
            sink = PoolSink(kv_cache)
        self.sink: KVSink = sink
        self.layout: KVLayout = self.sink.layout
        self.timeout_s = timeout_s
        layout = self.layout
        self.max_frame_bytes = max(MAX_HEADER_BYTES, layout.num_blocks * layout.block_size * layout.row_bytes)
        """The largest frame taken: a header, or one layer's K (or V) rows for the whole pool."""
        self.dropped: collections.Counter[str] = collections.Counter()
        """Messages dropped, by reason (malformed, unknown_request, wrong_dtype, ...)."""
        self.num_bytes_received = 0
        """KV payload bytes written into the pool (K and V), for the metrics."""
        self._expected: dict[str, Reservation] = {}
        self._ended = RecentlyEnded()
        self._lock = threading.Lock()
        self._events: queue.Queue[TransferEvent] = queue.Queue()
        self._outbox: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._router = RouterSocket(address, self.max_frame_bytes, curve, self._count_unauthenticated)
        self._socket = self._router.socket
        self.address: str = self._router.address
        self._pairs = ReceiverPairs(self.address, timeout_s)
        """torch.distributed pairs, with the senders that asked for one (the I/O thread's)."""
        self._side = ReceiverSide(layout, self.device, kv_cache.device if kv_cache is not None else torch.device("cpu"),
                                  shared_pool, self._pairs, self.unencrypted_pairs_refused)
        self._revoker = None if shared_pool is None else Revoker(shared_pool.fence, self._events)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    # -- the owner's side -------------------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], num_tokens: int,
               timeout_s: float | None = None, num_cached_tokens: int = 0) -> Destination:
        """Wait for the KV of tokens [num_cached_tokens, num_tokens) into `block_ids`
        (reserved by the caller; their first num_cached_tokens tokens already hold theirs)."""
        check_reservation(request_id, block_ids, num_tokens, num_cached_tokens, self.layout)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        pool = self.shared_pool
        granted = None if pool is None else granted_blocks(block_ids, self.layout.block_size, num_cached_tokens)
        with self._lock:
            if request_id in self._expected:
                raise ValueError(f"{request_id}: already expected")
            self._ended.discard(request_id)
            dest = Destination(request_id, self.address, tuple(block_ids), num_tokens, num_cached_tokens, self.node_id,
                               "" if pool is None else pool.name,
                               0 if pool is None or granted is None else pool.fence.grant(granted),
                               grant=new_grant(), device=self.device)
            self._expected[request_id] = Reservation(dest, timeout_s, [num_cached_tokens] * self.layout.num_layers,
                                                     granted)
        return dest

    def abort(self, request_id: str) -> AbortOutcome:
        """Stop waiting for a request and tell its sender at once (never waits for a writer).

        -> NOT_PENDING (nothing to do), FENCED (no byte is written into its blocks any more,
        no event follows), or REVOKING: a same-node writer is inside a write (or stopped
        there); its ABORTED event comes once its grant is revoked, and until then the blocks
        must stay out of the pool.
        """
        with self._lock:
            exp = self._expected.get(request_id)
            fenced = exp is not None and self._close(request_id, TransferEvent(request_id, TransferStatus.ABORTED,
                                                                               "aborted by its owner"))
        if exp is None:  # (ended already: its end may still wait for a revoke)
            revoking = self._revoker is not None and self._revoker.is_revoking(request_id)
            return AbortOutcome.REVOKING if revoking else AbortOutcome.NOT_PENDING
        if exp.sender is not None:
            self._outbox.put((exp.sender, encode(MessageKind.ABORT, request_id)))
        return AbortOutcome.FENCED if fenced else AbortOutcome.REVOKING

    def all_sent(self, request_id: str) -> None:
        """The sender has sent every layer (e.g. the prompt's first token, sampled after its
        last chunk, is here): the rest of the KV is due within timeout_s from now, even if
        none of it has arrived yet (a sender that died with its layers still queued)."""
        with self._lock:
            exp = self._expected.get(request_id)
            if exp is not None and exp.deadline is None:
                exp.deadline = time.monotonic() + exp.timeout_s

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
        if self._revoker is not None:
            self._revoker.close()
        self._router.close()
        self._pairs.close()

    # -- the I/O thread ---------------------------------------------------------------
    def _count_unauthenticated(self) -> None:  # (on the ZAP handler's thread)
        self.dropped["unauthenticated"] += 1
        logger.warning("kv receiver refused a sender whose CURVE key is not the cluster's")

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
            self._receive_layer(sender, layer_header(request_id, msg), frames[1:], msg)
        elif kind is MessageKind.ABORT:
            with self._lock:
                exp = self._expected.get(request_id)
                if exp is not None and not is_granted(exp, grant_of(msg)):
                    raise ProtocolError("no_grant", f"ABORT of {request_id} without its grant")
                if exp is not None:
                    self._report(request_id, TransferEvent(request_id, TransferStatus.FAILED, "aborted by the sender"))
        else:
            raise ProtocolError("malformed", f"a receiver does not expect {kind.name}")

    def _handshake(self, sender: bytes, msg: dict) -> None:
        self._forget_path(sender)  # (a sender shaking hands again starts afresh)
        try:
            why, reply, path = answer_hello(msg, self._side, self.model, sender)
        except ProtocolError as e:
            self._socket.send_multipart([sender, encode(MessageKind.REFUSED, reason=str(e))])
            raise
        if why is not None:
            logger.warning("kv receiver refused a sender: %s", why)
            self._socket.send_multipart([sender, encode(MessageKind.REFUSED, reason=why)])
            return
        assert path is not None  # (not refused: a path answered)
        self._paths[sender] = path
        self._socket.send_multipart([sender, encode(MessageKind.HELLO_OK, **reply)])

    def _forget_path(self, sender: bytes) -> None:
        self._paths.pop(sender, FRAMES).forget()

    def _receive_layer(self, sender: bytes, h: LayerHeader, frames: list[zmq.Frame], msg: dict) -> None:
        with self._lock:
            exp = self._expected.get(h.request_id)
            granted = exp is not None and is_granted(exp, h.grant)
        k_parts, v_parts = self._payload(sender, h, frames, msg, granted)
        with self._lock:
            exp = self._expected.get(h.request_id)
            if exp is None:
                if h.request_id in self._ended:
                    self._socket.send_multipart([sender, encode(MessageKind.ABORT, h.request_id)])
                    raise ProtocolError("ended_request", f"{h.request_id} has ended")
                raise ProtocolError("unknown_request", h.request_id)
            if not is_granted(exp, h.grant):  # NOTE: before it counts as the sender at work
                raise ProtocolError("no_grant", f"{h.request_id}: a LAYER without the request's grant")
            exp.deadline = time.monotonic() + exp.timeout_s  # the sender is at work: a stall is timed
            check_layer(h, exp, self.layout)
            exp.sender = sender
            if not h.in_place:  # (in place: the sender wrote them already)
                slots = layer_slots(h, self.layout)
                for kv, parts in ((0, k_parts), (1, v_parts)):
                    self.sink.write(h.layer, kv, slots, parts)
            exp.received[h.layer] += h.num_tokens
            self.num_bytes_received += 2 * h.num_tokens * self.layout.row_bytes
            complete = all(n == exp.destination.num_tokens for n in exp.received)
            if complete:  # nothing more may be written: its blocks are the decoder's now
                self._report(h.request_id, TransferEvent(h.request_id, TransferStatus.DONE))
        if complete:
            self._socket.send_multipart([sender, encode(MessageKind.DONE, h.request_id)])

    def _payload(self, sender: bytes, h: LayerHeader, frames: list[zmq.Frame], msg: dict, granted: bool
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """-> the K and the V rows the message carries, by the sender's path, as pieces
        ([n_i, *row_shape]) in token order. granted: the message carries its request's grant
        (else it fails no request)."""
        try:
            return self._paths.get(sender, FRAMES).rows(h, frames, msg, self.layout)
        except PathBroken as e:  # out of step for good: the sender must shake hands again
            self._forget_path(sender)
            self._fail_sender(sender, h.request_id if granted else None, e.detail)
            raise
        except CorruptPayload:  # this request's KV can never be whole, the others are unharmed
            if granted:
                self._fail_request(sender, h.request_id, "checksum mismatch: the KV was corrupted in transit")
            raise

    def _fail_request(self, sender: bytes, request_id: str, reason: str) -> None:
        """Fail one request that is expected (nothing when it is not) and tell its sender."""
        with self._lock:
            if request_id not in self._expected:
                return
            self._socket.send_multipart([sender, encode(MessageKind.FAILED, request_id, reason=reason)])
            self._report(request_id, TransferEvent(request_id, TransferStatus.FAILED, reason))

    def _fail_sender(self, sender: bytes, request_id: str | None, reason: str) -> None:
        """Fail `request_id` and every pending request of a sender whose data path broke
        (its stream is out of step)."""
        with self._lock:
            lost = [rid for rid, e in self._expected.items() if e.sender == sender or rid == request_id]
            for rid in lost:
                self._report(rid, TransferEvent(rid, TransferStatus.FAILED, reason))

    def _sweep_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            ended = [(rid, e) for rid, e in self._expected.items() if e.deadline is not None and e.deadline <= now]
            for rid, exp in ended:
                logger.warning("kv transfer %s timed out: nothing for %.1f s", rid, exp.timeout_s)
                self.dropped["timeout"] += 1
                self._report(rid, TransferEvent(rid, TransferStatus.FAILED, "timed out waiting for KV"))
        for rid, exp in ended:
            if exp.sender is not None:
                self._socket.send_multipart([exp.sender, encode(MessageKind.FAILED, rid, reason="timeout")])

    def _report(self, request_id: str, event: TransferEvent) -> None:
        """Under self._lock: close the request and report its end, once its grant is revoked."""
        if self._close(request_id, event):
            self._events.put(event)

    def _close(self, request_id: str, event: TransferEvent) -> bool:
        """Under self._lock: the request is expected no more. -> whether its blocks are fenced
        now; else `event` is reported once a same-node writer inside a write lets go.
        NOTE: the fence: frames are written under self._lock, so none lands after this; an
        in-place write lands only under its grant, which the revoke takes back."""
        exp = self._expected.pop(request_id, None)
        self._ended.add(request_id)
        if exp is None or exp.granted is None:
            return True
        assert self._revoker is not None  # (a grant comes only with a shared pool)
        return self._revoker.close_then_report(exp.granted, event)
