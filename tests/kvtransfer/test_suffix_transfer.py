"""A receiver that caches a prompt's prefix gets only the suffix: byte-exact, its cached
blocks untouched (even by a sender that tries), and only the suffix counted."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from kv_pools import pair, pick_blocks, random_pool, token_rows
from sender_wait import wait

from tandem.kvtransfer.protocol import TransferStatus

NUM_LAYERS, NUM_TOKENS = 3, 30


@pytest.mark.parametrize("src_block_size, dst_block_size, num_cached", [(16, 4, 12), (4, 16, 16), (5, 5, 25)])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_only_the_suffix_travels(src_block_size, dst_block_size, num_cached, chunked):
    rng = random.Random(num_cached)
    src = random_pool(NUM_LAYERS, 32, src_block_size, 2, 8, torch.float32, seed=1)
    dst = random_pool(NUM_LAYERS, 32, dst_block_size, 2, 8, torch.float32, seed=2)
    before = dst.clone()
    src_ids = pick_blocks(rng, list(range(32)), NUM_TOKENS, src_block_size)
    dst_ids = pick_blocks(rng, list(range(32)), NUM_TOKENS, dst_block_size)
    sender, receiver = pair(src, dst)
    try:
        dest = receiver.expect("r", dst_ids, NUM_TOKENS, num_cached_tokens=num_cached)
        assert dest.num_cached_tokens == num_cached
        sender.begin(dest, src_ids)
        for layer in range(NUM_LAYERS):
            if chunked:  # as chunked prefill sends it: a chunk from the suffix's start, then the rest
                assert sender.send_layer("r", layer, num_cached, num_cached + 3)
                assert sender.send_layer("r", layer, num_cached + 3)
            else:
                assert sender.send_layer("r", layer)
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        received = receiver.get_event(10)
        assert received is not None and received.status is TransferStatus.DONE
        row_bytes = 2 * 8 * 4
        assert receiver.num_bytes_received == sender.num_bytes_sent == \
            2 * NUM_LAYERS * (NUM_TOKENS - num_cached) * row_bytes
        got, want = token_rows(dst, dst_ids, NUM_TOKENS), token_rows(src, src_ids, NUM_TOKENS)
        assert torch.equal(got[:, :, num_cached:], want[:, :, num_cached:])
        cached_blocks = dst_ids[:num_cached // dst_block_size]
        untouched = [b for b in range(32) if b not in dst_ids or b in cached_blocks]
        assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
        assert not receiver.dropped and receiver.num_pending == 0 and sender.num_pending == 0
    finally:
        sender.close()
        receiver.close()


def test_the_sender_refuses_to_send_the_cached_prefix():
    src = random_pool(NUM_LAYERS, 8, 16, 2, 8, torch.float32, seed=1)
    dst = random_pool(NUM_LAYERS, 8, 16, 2, 8, torch.float32, seed=2)
    sender, receiver = pair(src, dst)
    try:
        sender.begin(receiver.expect("r", [3, 4], NUM_TOKENS, num_cached_tokens=16), [0, 1])
        with pytest.raises(ValueError, match="outside"):
            sender.send_layer("r", 0, 0)
        assert sender.abort("r")
    finally:
        sender.close()
        receiver.close()


def test_the_receiver_drops_writes_into_its_cached_prefix():
    """A sender that ignores num_cached_tokens writes nothing: its layers are dropped."""
    src = random_pool(NUM_LAYERS, 8, 16, 2, 8, torch.float32, seed=1)
    dst = random_pool(NUM_LAYERS, 8, 16, 2, 8, torch.float32, seed=2)
    before = dst.clone()
    sender, receiver = pair(src, dst, timeout_s=0.5)
    try:
        dest = receiver.expect("r", [3, 4], NUM_TOKENS, num_cached_tokens=16)
        sender.begin(dataclasses.replace(dest, num_cached_tokens=0), [0, 1])
        for layer in range(NUM_LAYERS):
            sender.send_layer("r", layer)
        event = receiver.get_event(5)
        assert event is not None
        assert event.status is TransferStatus.FAILED  # timed out: the suffix never came
        assert receiver.dropped["duplicate_layer"] == NUM_LAYERS
        assert torch.equal(dst, before) and receiver.num_bytes_received == 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("num_cached", [-16, 5, 32, 48])
def test_expect_takes_whole_cached_blocks_below_the_prompt(num_cached):
    dst = random_pool(NUM_LAYERS, 8, 16, 2, 8, torch.float32, seed=2)
    _, receiver = pair(dst, dst)
    try:
        with pytest.raises(ValueError, match="cached tokens"):
            receiver.expect("r", [3, 4], 32, num_cached_tokens=num_cached)
    finally:
        receiver.close()
