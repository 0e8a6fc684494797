"""The measurements of ``tandem bench transfer``.

The decode side is a spawned process that owns a KV pool and one KVReceiver per
transport, driven from the benchmark process over a pipe; the prefill side (this
process) sends from its own pool, either all layers at once or from a real prefill's
on_layer_stored hook. Times cross the process boundary as ``time.perf_counter()``
readings: on Linux it reads CLOCK_MONOTONIC, one clock for every process of the machine.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from tandem.config import ModelConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence as Seq
from tandem.kvtransfer.protocol import Destination, TransferStatus
from tandem.kvtransfer.sender import KVSender
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TRANSPORTS = ("ipc", "tcp", "gloo")
"""ipc: ZMQ over a Unix socket; tcp: ZMQ over loopback; gloo: ZMQ headers over loopback TCP
and the K/V rows over a torch.distributed gloo process group (DistPayload)."""
GLOO_SENDER_RANK, GLOO_RECEIVER_RANK = 0, 1
BLOCK_SIZE = 16
TIMEOUT_S = 120.0


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_digest(kv_cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int) -> str:
    """blake2b of tokens [0, num_tokens) of a block table, every layer, K then V."""
    rows = kv_cache[:, :, list(block_ids)].flatten(2, 3)[:, :, :num_tokens].contiguous()
    return hashlib.blake2b(memoryview(rows.view(torch.uint8).numpy()), digest_size=16).hexdigest()


def _serve(conn: Connection, shape: tuple[int, ...], transports: Sequence[str], ipc_path: str,
           gloo_port: int | None, timeout_s: float) -> None:
    """The receiver process: reply to ("expect", ...) with a Destination, then with an Arrival."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s receiver: %(message)s")
    from tandem.kvtransfer.payload import DistPayload
    from tandem.kvtransfer.receiver import KVReceiver

    pool = torch.zeros(shape, dtype=torch.float32)  # zeroed: every page faulted in before timing
    receivers: dict[str, KVReceiver] = {}
    if "ipc" in transports:
        receivers["ipc"] = KVReceiver(pool, f"ipc://{ipc_path}", timeout_s)
    if "tcp" in transports:
        receivers["tcp"] = KVReceiver(pool, "tcp://127.0.0.1:0", timeout_s)
    if gloo_port is not None:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}",
                                rank=GLOO_RECEIVER_RANK, world_size=2)
        receivers["gloo"] = KVReceiver(pool, "tcp://127.0.0.1:0", timeout_s, dist_payload=DistPayload())
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
            digest = kv_digest(pool, block_ids, num_tokens) if want_digest and ok else None
            conn.send(Arrival("DONE" if ok else "FAILED", event.reason, done_at, digest))
    finally:
        for r in receivers.values():
            r.close()
        if gloo_port is not None:
            dist.destroy_process_group()


class RemoteReceiver:
    """The benchmark process's handle on the receiver process.

    With "gloo" among the transports this process joins the gloo group as the sender rank.
    """

    def __init__(self, shape: tuple[int, ...], transports: Sequence[str], ipc_dir: str, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        gloo_port = free_port() if "gloo" in transports else None
        self._proc = ctx.Process(target=_serve, name="kv-receiver",
                                 args=(child, shape, tuple(transports), os.path.join(ipc_dir, "kv.sock"),
                                       gloo_port, timeout_s), daemon=True)
        self._proc.start()
        child.close()
        self.gloo = gloo_port is not None
        if self.gloo:
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}",
                                    rank=GLOO_SENDER_RANK, world_size=2)
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
        if self.gloo:
            import torch.distributed as dist
            dist.destroy_process_group()


def kv_bytes(cfg: ModelConfig, num_tokens: int) -> int:
    """K and V of `num_tokens` tokens in every layer (float32)."""
    return 2 * cfg.num_layers * num_tokens * cfg.num_kv_heads * cfg.head_dim * 4


class CopyTimer:
    """Times a plain copy of the first `num_bytes` of one buffer into another, to pair with
    each transfer: the machine's state (other tenants, caches) changes between runs."""

    def __init__(self, max_bytes: int) -> None:
        self.src = torch.randn(max_bytes // 4)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # every page faulted in, outside the timing

    def time(self, num_bytes: int, threads: int, tries: int = 3) -> float:
        """Seconds of dst.copy_(src) over `num_bytes` with `threads` torch threads: the best of
        `tries` back-to-back copies after an untimed one (which wakes the threads up)."""
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            src, dst = self.src[:num_bytes // 4], self.dst[:num_bytes // 4]
            dst.copy_(src)
            times = []
            for _ in range(tries):
                start = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - start)
            return min(times)
        finally:
            torch.set_num_threads(before)


def block_tables(order: str, num_blocks: int, pool_blocks: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """-> (source, destination) tables of `num_blocks` blocks: one run of blocks, as a fresh
    pool hands them out, or shuffled, as a busy one does."""
    if order == "contiguous":
        return list(range(num_blocks)), list(range(num_blocks))
    src, dst = (rng.permutation(pool_blocks)[:num_blocks].tolist() for _ in range(2))
    return src, dst


def one_transfer(remote: RemoteReceiver, sender: KVSender, transport: str, request_id: str,
                 src: list[int], dst: list[int], num_tokens: int, check: bool) -> dict:
    """Send every layer of a request at once; -> its timeline (seconds from the first send)."""
    dest = remote.expect(transport, request_id, dst, num_tokens, digest=check)
    sender.begin(dest, src)
    start = time.perf_counter()
    for layer in range(sender.layout.num_layers):
        sender.send_layer(request_id, layer)
    sent = time.perf_counter()
    event = sender.wait(request_id, TIMEOUT_S)
    acked = time.perf_counter()
    arrival = remote.arrival(TIMEOUT_S)
    if event.status is not TransferStatus.DONE or arrival.status != "DONE":
        raise RuntimeError(f"{request_id} over {transport} failed: {event.reason or arrival.reason}")
    if check and arrival.digest != kv_digest(sender.kv_cache, src, num_tokens):
        raise RuntimeError(f"{request_id} over {transport}: the received KV differs from the sent KV")
    return {"latency_s": arrival.done_at - start, "send_calls_s": sent - start, "ack_s": acked - start}


def bench_transfers(remote: RemoteReceiver, senders: dict[str, KVSender], cfg: ModelConfig, prompt_lens: list[int],
                    transports: list[str], block_orders: list[str], repeats: int, rng: np.random.Generator) -> list[dict]:
    """Every transport x block order x prompt length: a checked warm-up, then `repeats` timed
    transfers, each right after a copy of the same bytes here, with all of this process's
    threads and with one; medians kept."""
    copier = CopyTimer(kv_bytes(cfg, max(prompt_lens)))
    threads = torch.get_num_threads()
    pool_blocks = senders["zmq"].layout.num_blocks
    rows = []
    points = [(t, o, n) for t in transports for o in block_orders for n in prompt_lens]
    for transport, order, n in tqdm(points, desc="transfers", unit="point"):
        num_bytes = kv_bytes(cfg, n)
        src, dst = block_tables(order, -(-n // BLOCK_SIZE), pool_blocks, rng)
        sender = senders["gloo" if transport == "gloo" else "zmq"]
        runs = []
        for i in range(repeats + 1):
            copy_s, copy_1t_s = copier.time(num_bytes, threads), copier.time(num_bytes, 1)
            run = one_transfer(remote, sender, transport, f"{transport}-{order}-{n}-{i}", src, dst, n, check=i == 0)
            runs.append({**run, "copy_s": copy_s, "copy_1t_s": copy_1t_s})
        runs = runs[1:]  # the warm-up (and check) run
        row = {"transport": transport, "block_order": order, "num_tokens": n, "bytes": num_bytes,
               **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
               "latencies_s": [r["latency_s"] for r in runs], "copy_threads": threads}
        row["bytes_per_s"] = num_bytes / row["latency_s"]
        row["copy_bytes_per_s"], row["copy_1t_bytes_per_s"] = num_bytes / row["copy_s"], num_bytes / row["copy_1t_s"]
        # The goal's ratio is to the faster copy: on a busy machine either can lose its threads.
        row["copy_ratio"] = row["bytes_per_s"] / max(row["copy_bytes_per_s"], row["copy_1t_bytes_per_s"])
        row["copy_1t_ratio"] = row["bytes_per_s"] / row["copy_1t_bytes_per_s"]
        logger.info("%s, %s blocks, %d tokens: %.2f GB/s, %.1f ms (%.0f%% of copy)", transport, order, n,
                    row["bytes_per_s"] / 1e9, row["latency_s"] * 1e3, 100 * row["copy_ratio"])
        rows.append(row)
    return rows


def one_prefill(runner: ModelRunner, remote: RemoteReceiver | None, sender: KVSender, request_id: str,
                token_ids: list[int]) -> dict:
    """Prefill one prompt; with `remote`, send each layer over ipc from on_layer_stored.

    -> its timeline: prefill_s (the step), first_stored_s (step start -> layer 0 stored),
    transfer_s (first layer stored -> receiver DONE), tail_s (prefill step end -> DONE) and tail_after_last_stored_s (last layer
    stored -> DONE), the tails also as fractions of transfer_s.
    """
    n = len(token_ids)
    seq = Seq(request_id, token_ids, SamplingParams(temperature=0, max_tokens=1), 0)
    seq.block_ids = list(range(-(-n // BLOCK_SIZE)))
    stored: list[float] = []

    def on_layer_stored(layer: int) -> None:
        stored.append(time.perf_counter())
        if remote is not None:
            sender.send_layer(request_id, layer)

    if remote is not None:
        sender.begin(remote.expect("ipc", request_id, seq.block_ids, n), seq.block_ids)
    start = time.perf_counter()
    runner.run(ScheduledBatch([seq], [n]), on_layer_stored=on_layer_stored)
    end = time.perf_counter()
    if remote is None:
        return {"prefill_s": end - start}
    arrival = remote.arrival(TIMEOUT_S)
    event = sender.wait(request_id, TIMEOUT_S)
    if event.status is not TransferStatus.DONE or arrival.status != "DONE":
        raise RuntimeError(f"{request_id} failed: {event.reason or arrival.reason}")
    transfer = arrival.done_at - stored[0]
    return {"prefill_s": end - start, "first_stored_s": stored[0] - start, "transfer_s": transfer,
            "tail_s": arrival.done_at - end,
            "tail_fraction": (arrival.done_at - end) / transfer,
            "tail_after_last_stored_s": arrival.done_at - stored[-1],
            "tail_after_last_stored_fraction": (arrival.done_at - stored[-1]) / transfer}


def bench_overlap(runner: ModelRunner, remote: RemoteReceiver, lens: list[int], repeats: int, vocab: int,
                  seed: int) -> list[dict]:
    """Per prompt length: an untimed warm-up prefill (sending), then `repeats` times a
    prefill alone and one sending each layer over ipc; medians kept."""
    sender = KVSender(runner.kv_cache, TIMEOUT_S)
    rng = np.random.default_rng(seed)
    rows = []
    for n in tqdm(lens, desc="prefill + transfer", unit="prompt"):
        tokens = rng.integers(0, vocab, n).tolist()
        one_prefill(runner, remote, sender, f"warm-up-{n}", tokens)  # first-call costs at this length
        alone, runs = [], []
        for i in range(repeats):
            alone.append(one_prefill(runner, None, sender, f"alone-{n}-{i}", tokens)["prefill_s"])
            runs.append(one_prefill(runner, remote, sender, f"prefill-{n}-{i}", tokens))
        row = {"num_tokens": n, "transport": "ipc", "bytes": kv_bytes(runner.config.model, n),
               "prefill_alone_s": statistics.median(alone), **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        logger.info("prefill of %d tokens: %.2f s (%.2f s alone), transfer %.3f s, tail %.1f%%", n, row["prefill_s"],
                    row["prefill_alone_s"], row["transfer_s"], 100 * row["tail_fraction"])
        rows.append(row)
    sender.close()
    return rows
