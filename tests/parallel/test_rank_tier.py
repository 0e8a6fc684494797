"""A tensor-parallel pool's KV tiers (RankTier over a real disk tier): an evicted block is
kept only once the next message has gathered every head of it, a load comes back as KV
writes for every rank's heads, bit for bit, and the two cases where the pool's contents
are not yet what the tier thinks (a block just loaded, a block not yet gathered) are
caught."""

from __future__ import annotations

import torch

from tandem.kvcache.disk_tier import DiskTier, layout_key
from tandem.kvcache.kv_events import KVEventLog
from tandem.kvtransfer.protocol import KVLayout
from tandem.parallel.kv_writes import PendingKVWrites
from tandem.parallel.rank_tier import RankTier

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 10, 4, 3, 8


def h(i: int) -> bytes:
    return bytes([i]) * 16


def apply(writes: PendingKVWrites, pool: torch.Tensor) -> None:
    """What every rank does with a message's KV writes (RankExecutor.execute), all heads at once."""
    taken = writes.take()
    assert taken is not None and taken.rows is not None
    pool.view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(0, taken.index, taken.rows)


def test_blocks_go_to_disk_once_gathered_and_come_back_as_writes(tmp_path):
    # whole: the KV every head of the ranks' pools holds together
    whole = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=torch.Generator()
                        .manual_seed(0))
    staging = torch.zeros(NUM_LAYERS, 2, 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    disk = DiskTier(staging, str(tmp_path), 1 << 20, layout_key("m", tuple(staging[:, :, 0].shape)))
    writes = PendingKVWrites(KVLayout(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "float32"))
    tier = RankTier(disk, staging, writes)
    assert (tier.name, tier.counters, tier.next_tier) == ("disk", disk.counters, None)
    log = KVEventLog("w", "e1")
    tier.events = log
    assert disk.events is log

    block3 = whole[:, :, 3].clone()
    tier.offload(3, h(1))
    assert tier.has_offloads and not tier.holds(h(1))  # not kept before the gather
    offloads = tier.take_offloads()
    assert offloads == [(3, h(1))] and not tier.has_offloads
    whole[:, :, 3] = 0  # the block's next owner writes it later in that message
    tier.store_gathered(offloads, torch.stack([block3], dim=2))  # what the ranks gathered first
    assert tier.holds(h(1)) and tier.block_hashes() == [h(1)]
    disk.flush()

    assert tier.load(h(1), 7)
    tier.offload(7, h(1))
    assert not tier.has_offloads  # just loaded, its rows not in the pool yet: the disk has it already
    apply(writes, whole)
    assert torch.equal(whole[:, :, 7], block3)
    assert disk.counters.num_loaded_blocks == 1 and disk.counters.num_offloaded_blocks == 1

    tier.offload(2, h(2))  # evicted, not gathered yet: a load of it now would read nothing
    disk_calls_before = disk.counters.num_loaded_blocks
    assert not tier.load(h(2), 5) and writes.take() is None
    assert disk.counters.num_loaded_blocks == disk_calls_before
    assert tier.take_offloads() == [(2, h(2))]
    tier.close()
