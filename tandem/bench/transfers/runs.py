"""The measurements of ``tandem bench transfer``.

The decode side is a spawned process (remote.py) that owns a KV pool and one KVReceiver
per transport; the prefill side (this process) sends from its own pool, either all layers
at once or from a real prefill's on_layer_stored hook. Times cross the process boundary as
``time.perf_counter()`` readings: on Linux it reads CLOCK_MONOTONIC, one clock for every
process of the machine.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from tandem.bench.transfers.remote import RemoteReceiver, kv_digest
from tandem.bench.transfers.sender_events import SenderEvents
from tandem.config import ModelConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence as Seq
from tandem.kvtransfer.protocol import TransferStatus
from tandem.kvtransfer.sender import KVSender
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
TIMEOUT_S = 120.0


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


def block_tables(order: str, num_blocks: int, pool_blocks: int,
                 rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """-> (source, destination) tables of `num_blocks` blocks: one run of blocks, as a fresh
    pool hands them out, or shuffled, as a busy one does."""
    if order == "contiguous":
        return list(range(num_blocks)), list(range(num_blocks))
    src, dst = (rng.permutation(pool_blocks)[:num_blocks].tolist() for _ in range(2))
    return src, dst


def one_transfer(remote: RemoteReceiver, sender: KVSender, transport: str, request_id: str,
                 src: list[int], dst: list[int], num_tokens: int, check: bool) -> dict:
    """Send every layer of a request at once; -> its timeline (seconds from the first send),
    the data path the sender took and, when `check`ed, the digests of the rows at both ends."""
    dest = remote.expect(transport, request_id, dst, num_tokens, digest=check)
    path = sender.begin(dest, src)
    start = time.perf_counter()
    for layer in range(sender.layout.num_layers):
        sender.send_layer(request_id, layer)
    sent = time.perf_counter()
    event = SenderEvents(sender).wait(request_id, TIMEOUT_S)
    acked = time.perf_counter()
    arrival = remote.arrival(TIMEOUT_S)
    if event.status is not TransferStatus.DONE or arrival.status != "DONE":
        raise RuntimeError(f"{request_id} over {transport} failed: {event.reason or arrival.reason}")
    timeline = {"latency_s": arrival.done_at - start, "send_calls_s": sent - start, "ack_s": acked - start}
    if not check:
        return timeline
    digests = {"sent_digest": kv_digest(sender.kv_cache, src, num_tokens), "received_digest": arrival.digest}
    if digests["sent_digest"] != digests["received_digest"]:
        raise RuntimeError(f"{request_id} over {transport}: the received KV differs from the sent KV")
    return {**timeline, **digests, "path": path}


def bench_transfers(remote: RemoteReceiver, senders: dict[str, KVSender], cfg: ModelConfig, prompt_lens: list[int],
                    transports: list[str], block_orders: list[str], repeats: int,
                    rng: np.random.Generator) -> list[dict]:
    """Every transport x block order x prompt length: a checked warm-up, then `repeats` timed
    transfers, each right after a copy of the same bytes here, with all of this process's
    threads and with one; medians kept."""
    copier = CopyTimer(kv_bytes(cfg, max(prompt_lens)))
    threads = torch.get_num_threads()
    pool_blocks = senders["default"].layout.num_blocks
    rows = []
    points = [(t, o, n) for t in transports for o in block_orders for n in prompt_lens]
    for transport, order, n in tqdm(points, desc="transfers", unit="point"):
        num_bytes = kv_bytes(cfg, n)
        src, dst = block_tables(order, -(-n // BLOCK_SIZE), pool_blocks, rng)
        sender = senders["gloo" if transport == "gloo" else "default"]
        checked = one_transfer(remote, sender, transport, f"{transport}-{order}-{n}-check", src, dst, n, check=True)
        runs = []
        for i in range(repeats):
            copy_s, copy_1t_s = copier.time(num_bytes, threads), copier.time(num_bytes, 1)
            run = one_transfer(remote, sender, transport, f"{transport}-{order}-{n}-{i}", src, dst, n, check=False)
            runs.append({**run, "copy_s": copy_s, "copy_1t_s": copy_1t_s})
        row = {"transport": transport, "block_order": order, "num_tokens": n, "bytes": num_bytes,
               **{k: checked[k] for k in ("path", "sent_digest", "received_digest")},
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
    transfer_s (first layer stored -> receiver DONE), tail_s (prefill step end -> DONE) and
    tail_after_last_stored_s (last layer stored -> DONE), the tails also as fractions of transfer_s.
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
    event = SenderEvents(sender).wait(request_id, TIMEOUT_S)
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
               "prefill_alone_s": statistics.median(alone),
               **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        logger.info("prefill of %d tokens: %.2f s (%.2f s alone), transfer %.3f s, tail %.1f%%", n, row["prefill_s"],
                    row["prefill_alone_s"], row["transfer_s"], 100 * row["tail_fraction"])
        rows.append(row)
    sender.close()
    return rows
