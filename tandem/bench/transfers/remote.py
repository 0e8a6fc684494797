"""The receiver process of ``tandem bench transfer``: a spawned process that owns a KV pool
shaped for the model (the layout only: no weights) and one KVReceiver per transport, driven
from the benchmark process over a pipe."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Sequence

import torch

from tandem.kvtransfer.protocol import Destination, TransferStatus

logger = logging.getLogger(__name__)

TRANSPORTS = ("ipc", "tcp", "gloo", "shm")
"""ipc: ZMQ over a Unix socket; tcp: ZMQ over loopback; gloo: ZMQ headers over loopback TCP
and the K/V rows over a torch.distributed gloo pair made in the handshake; shm: the sender
writes the rows straight into the receiver's pool in shared memory, headers over a Unix
socket (same node)."""


@dataclass(frozen=True)
class Arrival:
    """How a transfer ended on the receiving side."""

    status: str
    """DONE or FAILED."""
    reason: str
    done_at: float
    """perf_counter() when the receiver's owner got the event."""
    digest: str | None
    """blake2b of the received K/V rows when asked for (checks the bytes, untimed)."""


def kv_digest(kv_cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int) -> str:
    """blake2b of tokens [0, num_tokens) of a block table, every layer, K then V."""
    rows = kv_cache[:, :, list(block_ids)].flatten(2, 3)[:, :, :num_tokens].contiguous()
    return hashlib.blake2b(rows.view(torch.uint8).numpy().data, digest_size=16).hexdigest()


def _serve(conn: Connection, shape: tuple[int, ...], transports: Sequence[str], ipc_path: str,
           timeout_s: float) -> None:
    """The receiver process: reply to ("expect", ...) with a Destination, then with an Arrival."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s receiver: %(message)s")
    from tandem.kvtransfer.receiver import KVReceiver
    from tandem.kvtransfer.shared_pool import HostSharedPool

    pool = torch.zeros(shape, dtype=torch.float32)  # zeroed: every page faulted in before timing
    receivers: dict[str, KVReceiver] = {}
    if "ipc" in transports:
        receivers["ipc"] = KVReceiver(pool, f"ipc://{ipc_path}", timeout_s)
    if "tcp" in transports:
        receivers["tcp"] = KVReceiver(pool, "tcp://127.0.0.1:0", timeout_s)
    if "gloo" in transports:  # (the pair is the sender's to ask for: transport gloo)
        receivers["gloo"] = KVReceiver(pool, "tcp://127.0.0.1:0", timeout_s)
    shared = HostSharedPool.create(shape, torch.float32) if "shm" in transports else None
    if "shm" in transports:  # a pool of its own, in /dev/shm (zeroed and faulted in like the other)
        if shared is None:
            raise RuntimeError("the shm transport needs room for the pool in /dev/shm (see the log)")
        receivers["shm"] = KVReceiver(shared.kv_cache, f"ipc://{ipc_path}.shm", timeout_s, shared_pool=shared)
    conn.send({name: r.address for name, r in receivers.items()})
    try:
        while True:
            command = conn.recv()
            if command[0] == "close":
                break
            _, transport, request_id, block_ids, num_tokens, want_digest = command
            receiver = receivers[transport]
            conn.send(receiver.expect(request_id, block_ids, num_tokens))
            event = receiver.get_event(timeout_s + 5)
            done_at = time.perf_counter()
            if event is None:
                conn.send(Arrival("FAILED", "no event from the receiver", done_at, None))
                continue
            ok = event.status is TransferStatus.DONE
            digest = None
            if want_digest and ok:
                assert receiver.kv_cache is not None  # every receiver above writes into a pool
                digest = kv_digest(receiver.kv_cache, block_ids, num_tokens)
            conn.send(Arrival("DONE" if ok else "FAILED", event.reason, done_at, digest))
    finally:
        for r in receivers.values():
            r.close()
        if shared is not None:
            shared.close()


class RemoteReceiver:
    """The benchmark process's handle on the receiver process."""

    def __init__(self, shape: tuple[int, ...], transports: Sequence[str], ipc_dir: str, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name="kv-receiver",
                                 args=(child, shape, tuple(transports), os.path.join(ipc_dir, "kv.sock"), timeout_s),
                                 daemon=True)
        self._proc.start()
        child.close()
        self.gloo = "gloo" in transports
        self.addresses: dict[str, str] = self._recv(120.0)
        logger.info("receiver process %d listening on %s", self._proc.pid, self.addresses)

    def _recv(self, timeout_s: float):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the receiver process did not answer within {timeout_s} s")
        return self._conn.recv()

    def expect(self, transport: str, request_id: str, block_ids: Sequence[int], num_tokens: int,
               digest: bool = False) -> Destination:
        """Have the receiver reserve `block_ids` for the request; -> where to send it."""
        self._conn.send(("expect", transport, request_id, list(block_ids), num_tokens, digest))
        return self._recv(30.0)

    def arrival(self, timeout_s: float) -> Arrival:
        """Wait for the request announced by the last `expect` to end on the receiver."""
        return self._recv(timeout_s)

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("close",))
        self._proc.join(30)
        if self._proc.is_alive():
            logger.warning("receiver process %d did not exit; terminating it", self._proc.pid)
            self._proc.terminate()
