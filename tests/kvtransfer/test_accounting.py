"""Thousands of transfers with aborts from either side at random moments: every block is
freed exactly once on both sides, nothing stays pending, completed transfers are exact."""

from __future__ import annotations

import random
import time

import pytest
import torch
from kv_pools import pair, random_pool, token_rows

from tandem.kvtransfer.protocol import TransferStatus

LAYERS = 3


class Pool:
    """An owner's block bookkeeping: refuses a double free or a leak."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = set(range(num_blocks))
        self.held: dict[str, list[int]] = {}

    def take(self, rid: str, n: int, rng: random.Random) -> list[int] | None:
        if n > len(self.free_ids):
            return None
        ids = rng.sample(sorted(self.free_ids), n)
        self.free_ids -= set(ids)
        self.held[rid] = ids
        return ids

    def release(self, rid: str) -> None:
        ids = self.held.pop(rid)  # KeyError: freed twice
        assert not self.free_ids & set(ids)
        self.free_ids |= set(ids)


@pytest.mark.slow
def test_random_transfers_and_aborts_leak_nothing():
    rng = random.Random(2026)
    src = random_pool(LAYERS, 512, 16, 1, 4, torch.float32, seed=1)
    dst = random_pool(LAYERS, 1024, 8, 1, 4, torch.float32, seed=2)
    sender, receiver = pair(src, dst)
    src_pool, dst_pool = Pool(512), Pool(1024)
    active: dict[str, int] = {}  # request id -> layers sent
    outcome = {"done": 0, "sender_abort": 0, "receiver_abort": 0}
    checked = 0

    def settle() -> None:
        """Free blocks as the owners would on each event."""
        nonlocal checked
        for event in sender.poll():
            src_ids = src_pool.held[event.request_id]
            # Spot-check the bytes while the receiver's owner still holds the blocks.
            if event.status is TransferStatus.DONE and checked < 50 and event.request_id in dst_pool.held:
                n = active_tokens[event.request_id]
                assert torch.equal(token_rows(dst, dst_pool.held[event.request_id], n), token_rows(src, src_ids, n))
                checked += 1
            src_pool.release(event.request_id)
            active.pop(event.request_id, None)
        while (received := receiver.get_event(0)) is not None:
            outcome["done" if received.status is TransferStatus.DONE else "sender_abort"] += 1
            dst_pool.release(received.request_id)

    active_tokens: dict[str, int] = {}
    try:
        for i in range(2000):
            rid, n = f"r{i}", rng.randint(1, 60)
            src_ids = src_pool.take(rid, -(-n // 16), rng)
            dst_ids = dst_pool.take(rid, -(-n // 8), rng) if src_ids is not None else None
            if dst_ids is None:  # a pool is full: give back what was taken
                if src_ids is not None:
                    src_pool.release(rid)
            else:
                assert src_ids is not None  # (dst_ids are taken only after src_ids)
                sender.begin(receiver.expect(rid, dst_ids, n), src_ids)
                active[rid], active_tokens[rid] = 0, n
            for other in rng.sample(sorted(active), min(len(active), 8)):
                roll = rng.random()
                if roll < 0.05 and sender.abort(other):
                    active.pop(other)  # its blocks come back with the FAILED event
                elif roll < 0.10 and receiver.abort(other):
                    outcome["receiver_abort"] += 1
                    dst_pool.release(other)
                elif active.get(other, LAYERS) < LAYERS:
                    sender.send_layer(other, active[other])
                    active[other] += 1
            settle()
        for rid in list(active):  # finish what is left
            while active.get(rid, LAYERS) < LAYERS:
                sender.send_layer(rid, active[rid])
                active[rid] += 1
        deadline = time.monotonic() + 30
        while (src_pool.held or dst_pool.held) and time.monotonic() < deadline:
            settle()
            time.sleep(0.005)
        assert not src_pool.held and not dst_pool.held, (len(src_pool.held), len(dst_pool.held))
        assert sender.num_pending == 0 and receiver.num_pending == 0
        # Every ending was exercised, many times over.
        assert outcome["done"] > 500 and outcome["sender_abort"] > 100 and outcome["receiver_abort"] > 100, outcome
        assert checked == 50
    finally:
        sender.close()
        receiver.close()
