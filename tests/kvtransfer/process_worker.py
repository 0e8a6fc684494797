"""One side of a KV transfer in its own process, driven by the test through multiprocessing queues.

The test process spawns a `WorkerProcess` per side and calls methods of a `ReceiverWorker` or
`SenderWorker` living in the child, one command at a time. Only test plumbing (commands,
Destinations, events, check results) crosses the queues; the KV itself travels over the
transfer's own sockets (or the gloo group), never through pickle. Imports stay light: torch,
numpy and tandem.kvtransfer, nothing else the children do not need.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from sender_wait import wait

from tandem.kvtransfer.connectors.dist_pair import DistSend
from tandem.kvtransfer.payload import TORCH_DTYPES
from tandem.kvtransfer.protocol import Destination, TransferEvent
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender


@dataclass(frozen=True)
class PoolSpec:
    """A seeded random KV pool: either process rebuilds exactly the same bytes from it."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    seed: int

    def make(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.randn(shape, generator=gen).to(TORCH_DTYPES[self.dtype])


@dataclass(frozen=True)
class Plan:
    """One request: where its tokens live on each side, and the token chunks each layer is sent in."""

    request_id: str
    num_tokens: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]


def _index(pool: torch.Tensor, block_ids: tuple[int, ...], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (block, offset) of each token, by plain arithmetic (not the library's slot helpers)."""
    block_size = pool.shape[3]
    blocks = torch.tensor([block_ids[t // block_size] for t in range(num_tokens)], dtype=torch.long)
    return blocks, torch.arange(num_tokens) % block_size


def request_rows(pool: torch.Tensor, block_ids: tuple[int, ...], num_tokens: int) -> torch.Tensor:
    """-> [layers, 2, num_tokens, heads, dim]: a request's KV as it sits in `pool`."""
    blocks, offsets = _index(pool, block_ids, num_tokens)
    return pool[:, :, blocks, offsets]


class ReceiverWorker:
    """KVReceivers, one per named lane (a pool and an address), with checks run where the pool lives."""

    def __init__(self, pools: dict[str, PoolSpec], addresses: dict[str, str], timeout_s: float) -> None:
        self.pools = {lane: spec.make() for lane, spec in pools.items()}
        self.before = {lane: pool.clone() for lane, pool in self.pools.items()}
        self.receivers = {lane: KVReceiver(self.pools[lane], addresses[lane], timeout_s)
                          for lane in pools}
        self.expected_at: dict[str, float] = {}

    def address(self, lane: str) -> str:
        return self.receivers[lane].address

    def expect(self, lane: str, plan: Plan, timeout_s: float | None = None) -> Destination:
        self.expected_at[plan.request_id] = time.monotonic()
        return self.receivers[lane].expect(plan.request_id, list(plan.dst_block_ids), plan.num_tokens, timeout_s)

    def wait_events(self, lane: str, count: int, timeout_s: float) -> list[tuple[TransferEvent, float]]:
        """-> `count` events (fewer if the time runs out), each with seconds since its `expect`."""
        deadline = time.monotonic() + timeout_s
        events: list[tuple[TransferEvent, float]] = []
        while len(events) < count and time.monotonic() < deadline:
            event = self.receivers[lane].get_event(timeout=max(0.0, deadline - time.monotonic()))
            if event is not None:
                events.append((event, time.monotonic() - self.expected_at[event.request_id]))
        return events

    def wait_landed(self, lane: str, src: PoolSpec, plan: Plan, layers: list[int], timeout_s: float) -> bool:
        """Whether `layers` of the request hold the sender's bytes within the time (the I/O thread writes them)."""
        want = request_rows(src.make(), plan.src_block_ids, plan.num_tokens)[layers]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if torch.equal(request_rows(self.pools[lane], plan.dst_block_ids, plan.num_tokens)[layers], want):
                return True
            time.sleep(0.01)
        return False

    def check(self, lane: str, src: PoolSpec, plans: list[Plan], skip_blocks: tuple[int, ...] = ()) -> list[int]:
        """-> the blocks whose bytes are not what they should be: the sender's KV in every slot of
        `plans`, the pool's first bytes everywhere else (the unused tail of a last block included).
        `skip_blocks` belong to requests that failed part way, whose contents are undefined.
        """
        src_pool, pool = src.make(), self.pools[lane]
        expected = self.before[lane].clone()
        for plan in plans:
            src_blocks, src_offsets = _index(src_pool, plan.src_block_ids, plan.num_tokens)
            dst_blocks, dst_offsets = _index(pool, plan.dst_block_ids, plan.num_tokens)
            expected[:, :, dst_blocks, dst_offsets] = src_pool[:, :, src_blocks, src_offsets]
        # Compare bit patterns: "every byte", not float equality (which would let -0.0 pass for 0.0).
        bits = {2: torch.int16, 4: torch.int32}[pool.element_size()]
        differs = pool.view(bits) != expected.view(bits)
        bad = differs.flatten(3).any(-1).any(1).any(0)  # -> [num_blocks]
        return [b for b in bad.nonzero().flatten().tolist() if b not in skip_blocks]

    def state(self, lane: str) -> dict[str, Any]:
        r = self.receivers[lane]
        return {"num_pending": r.num_pending, "dropped": dict(r.dropped)}

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()


class SenderWorker:
    """KVSenders, one per named lane (a pool), sending what the test tells them to."""

    def __init__(self, pools: dict[str, PoolSpec], timeout_s: float, transport: str = "auto") -> None:
        """transport: KVSender's (gloo: a torch.distributed pair with each receiver)."""
        self.pools = {lane: spec.make() for lane, spec in pools.items()}
        self.senders = {lane: KVSender(self.pools[lane], timeout_s, transport=transport)
                        for lane in pools}
        self.active_at: dict[str, float] = {}
        """When each request was last begun or sent: its sender's timeout runs from then."""

    def begin(self, lane: str, dest: Destination, plan: Plan) -> None:
        self.active_at[dest.request_id] = time.monotonic()
        self.senders[lane].begin(dest, list(plan.src_block_ids))

    def send(self, lane: str, plans: list[Plan], layers: list[int] | None = None) -> list[bool]:
        """Send `layers` (default all) of every plan, chunk by chunk as chunked prefill would:
        chunk i of every layer before chunk i + 1. -> what each send_layer returned."""
        sender = self.senders[lane]
        layers = list(range(sender.layout.num_layers)) if layers is None else layers
        sent = []
        for i in range(max(len(p.chunks) for p in plans)):
            for layer in layers:
                for plan in plans:
                    if i < len(plan.chunks):
                        sent.append(sender.send_layer(plan.request_id, layer, *plan.chunks[i]))
                        self.active_at[plan.request_id] = time.monotonic()
        return sent

    def send_header_only(self, lane: str, plan: Plan, layer: int) -> bool:
        """Send a layer's LAYER header on ZMQ but not its tensors on torch.distributed: what a
        sender that dies between the two leaves behind."""
        sender = self.senders[lane]
        (peer,) = sender._peers.values()
        assert isinstance(peer.data, DistSend)  # (a torch.distributed lane: the pair made in the handshake)
        payload = peer.data.pair
        setattr(payload, "send", lambda peer, k, v: None)  # an instance attribute shadows the method
        try:
            return self.senders[lane].send_layer(plan.request_id, layer)
        finally:
            del payload.send

    def wait(self, lane: str, request_id: str, timeout_s: float) -> tuple[TransferEvent, float]:
        """-> the request's event and the seconds since its `begin` or latest send."""
        event = wait(self.senders[lane], request_id, timeout_s)
        return event, time.monotonic() - self.active_at[request_id]

    def state(self, lane: str) -> dict[str, Any]:
        return {"num_pending": self.senders[lane].num_pending}

    def close(self) -> None:
        for s in self.senders.values():
            s.close()


ROLES = {"receiver": ReceiverWorker, "sender": SenderWorker}


def _error(e: BaseException) -> tuple[str, tuple[str, str, str]]:
    return "error", (type(e).__name__, str(e), traceback.format_exc())


def serve(role: str, setup: dict[str, Any], inbox: multiprocessing.Queue, outbox: multiprocessing.Queue) -> None:
    """The child's main loop: build the worker, then run (method, args) commands until "stop"."""
    torch.set_num_threads(1)  # two children share two cores
    try:
        worker = ROLES[role](**setup)
    except Exception as e:
        outbox.put(_error(e))
        return
    outbox.put(("ok", None))
    try:
        while True:
            name, args = inbox.get()
            if name == "stop":
                break
            try:
                outbox.put(("ok", getattr(worker, name)(*args)))
            except Exception as e:
                outbox.put(_error(e))
    finally:
        worker.close()


class WorkerError(RuntimeError):
    """A command raised in the child: its exception's type name and message (the exception itself
    may not unpickle, so it is not sent)."""

    def __init__(self, type_name: str, message: str, tb: str) -> None:
        super().__init__(f"{type_name}: {message}\n--- in the worker process ---\n{tb}")
        self.type_name = type_name
        self.message = message


class WorkerDied(RuntimeError):
    """The child exited while the test waited for its answer."""


class WorkerProcess:
    """The test's handle on one spawned worker."""

    def __init__(self, role: str, **setup: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.inbox: multiprocessing.Queue = ctx.Queue()
        self.outbox: multiprocessing.Queue = ctx.Queue()
        self.process = ctx.Process(target=serve, args=(role, setup, self.inbox, self.outbox),
                                   name=f"kv-{role}", daemon=True)
        self.process.start()

    def ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the child has built its worker (spawning and importing torch take seconds)."""
        self._reply(timeout_s)

    def call(self, name: str, *args: Any, timeout_s: float = 15.0) -> Any:
        self.inbox.put((name, args))
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, value = self.outbox.get(timeout=0.05)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise WorkerDied(f"{self.process.name} exited with {self.process.exitcode}") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.process.name} did not answer within {timeout_s} s") from None
        if status == "error":
            raise WorkerError(*value)
        return value

    def kill(self) -> None:
        """SIGKILL: no cleanup runs in the child, as when a worker's machine goes away."""
        assert self.process.pid is not None  # (started with the worker)
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    def request_stop(self) -> None:
        """Ask the child to close its sockets and exit (several children then exit side by side)."""
        if self.process.is_alive():
            self.inbox.put(("stop", ()))

    def stop(self) -> None:
        """Ask the child to close its sockets and exit; kill it if it does not."""
        self.request_stop()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()  # never block the test on a pipe nobody reads any more
            q.close()
