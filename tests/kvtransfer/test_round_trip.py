"""Round trips in one process: every byte of a request's KV lands in its reserved blocks,
whatever the two sides' block sizes and block orders, and nothing else changes."""

from __future__ import annotations

import random

import pytest
import torch
from kv_pools import pair, pick_blocks, random_pool, token_rows
from sender_wait import wait

from tandem.kvtransfer.protocol import TransferRefused, TransferStatus
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("src_block_size, dst_block_size", [(16, 16), (16, 4), (5, 16), (1, 7)])
def test_bytes_equal_for_block_layouts(dtype, src_block_size, dst_block_size):
    rng = random.Random(src_block_size * 100 + dst_block_size)
    src = random_pool(3, 128, src_block_size, 2, 8, dtype, seed=1)
    dst = random_pool(3, 96, dst_block_size, 2, 8, dtype, seed=2)
    before = dst.clone()
    sender, receiver = pair(src, dst)
    src_free, dst_free = list(range(128)), list(range(96))
    reserved: list[int] = []
    try:
        for i, num_tokens in enumerate([1, 15, 16, 17, 40]):
            src_ids = pick_blocks(rng, src_free, num_tokens, src_block_size)
            dst_ids = pick_blocks(rng, dst_free, num_tokens, dst_block_size)
            reserved += dst_ids
            dest = receiver.expect(f"r{i}", dst_ids, num_tokens)
            sender.begin(dest, src_ids)
            split = rng.randint(1, num_tokens)  # layers also go in two chunks, as chunked prefill sends them
            for layer in range(3):
                sender.send_layer(f"r{i}", layer, 0, split)
                if split < num_tokens:
                    sender.send_layer(f"r{i}", layer, split)
            assert wait(sender, f"r{i}", 10).status is TransferStatus.DONE
            received = receiver.get_event(10)
            assert received is not None and received.status is TransferStatus.DONE
            assert torch.equal(token_rows(dst, dst_ids, num_tokens), token_rows(src, src_ids, num_tokens))
        untouched = [b for b in range(96) if b not in reserved]
        assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
        assert not receiver.dropped and receiver.num_pending == 0 and sender.num_pending == 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("field, dst_shape, dst_dtype", [
    ("head_dim", (2, 8, 4, 2, 16), torch.float32),
    ("num_kv_heads", (2, 8, 4, 4, 8), torch.float32),
    ("num_layers", (3, 8, 4, 2, 8), torch.float32),
    ("dtype", (2, 8, 4, 2, 8), torch.bfloat16),
])
def test_handshake_refuses_incompatible_layouts(field, dst_shape, dst_dtype):
    layers, blocks, block_size, heads, dim = dst_shape
    receiver = KVReceiver(random_pool(layers, blocks, block_size, heads, dim, dst_dtype, seed=0))
    sender = KVSender(random_pool(2, 8, 16, 2, 8, torch.float32, seed=0))
    try:
        with pytest.raises(TransferRefused, match=field):
            sender.connect(receiver.address)
        # A compatible sender still gets through afterwards.
        ok = KVSender(random_pool(layers, 4, 16, heads, dim, dst_dtype, seed=1))
        assert ok.connect(receiver.address).block_size == block_size
        ok.close()
    finally:
        sender.close()
        receiver.close()


def test_many_requests_in_flight_interleaved():
    """Layers of 20 requests interleaved on one connection all arrive and all complete."""
    rng = random.Random(0)
    src = random_pool(2, 200, 16, 1, 4, torch.float32, seed=3)
    dst = random_pool(2, 200, 8, 1, 4, torch.float32, seed=4)
    sender, receiver = pair(src, dst)
    src_free, dst_free = list(range(200)), list(range(200))
    try:
        requests = {}
        for i in range(20):
            n = rng.randint(1, 70)
            src_ids, dst_ids = pick_blocks(rng, src_free, n, 16), pick_blocks(rng, dst_free, n, 8)
            sender.begin(receiver.expect(f"r{i}", dst_ids, n), src_ids)
            requests[f"r{i}"] = (n, src_ids, dst_ids)
        for layer in range(2):
            for rid in requests:
                sender.send_layer(rid, layer)
        assert {wait(sender, rid, 10).status for rid in requests} == {TransferStatus.DONE}
        for n, src_ids, dst_ids in requests.values():
            assert torch.equal(token_rows(dst, dst_ids, n), token_rows(src, src_ids, n))
    finally:
        sender.close()
        receiver.close()
