"""The host tier: a block's KV back bit for bit, the least recently used block passed on to
the disk tier when the slots run out (and loaded from there), straight to the disk with no
slots, dropped with no disk; its KV events; and the block manager's exact ids through both
tiers. The pool here is a CPU tensor: the tier's bookkeeping is the same for a GPU's."""

from __future__ import annotations

import pytest
import torch
from block_harness import BS, compute, make_seq, toks

from tandem.config import EngineConfig, ModelConfig
from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.disk_tier import DiskTier
from tandem.kvcache.host_tier import HostTier
from tandem.kvcache.kv_events import KVEventLog
from tandem.kvcache.prefix_tier import tiers_of

SHAPE = (3, 2, 10, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
BLOCK_BYTES = 3 * 2 * 4 * 2 * 8 * 4  # float32


def pool(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_a_block_comes_back_bit_for_bit():
    kv = pool()
    tier = HostTier(kv, 4 * BLOCK_BYTES)
    assert tier.capacity_blocks == 4 and tier.store.shape == (4, 3, 2, 4, 2, 8) and tier.store.device.type == "cpu"
    original = kv[:, :, 3].clone()
    tier.offload(3, h(1))
    kv[:, :, 3] = 0  # the block handed out and overwritten
    assert tier.holds(h(1)) and not tier.holds(h(2))
    assert tier.load(h(1), 7) and torch.equal(kv[:, :, 7], original)
    assert not tier.load(h(2), 7)
    c = tier.counters
    assert (c.num_offloaded_blocks, c.num_loaded_blocks, c.num_offloaded_bytes) == (1, 1, BLOCK_BYTES)


def test_the_least_recently_used_block_moves_on_to_the_disk(tmp_path):
    kv = pool()
    originals = {i: kv[:, :, i].clone() for i in range(4)}
    disk = DiskTier(kv, str(tmp_path), 1 << 20, "k")
    tier = HostTier(kv, 2 * BLOCK_BYTES, disk)
    log = KVEventLog("w", "e")
    tier.events = disk.events = log
    tier.offload(0, h(0))
    tier.offload(1, h(1))
    tier.offload(0, h(0))  # offloaded again: the most recently used now
    tier.offload(2, h(2))  # no slot left: h(1), the least recently used, goes to the disk
    assert tier.block_hashes() == [h(0), h(2)]
    disk.flush()
    assert disk.block_hashes() == [h(1)] and tier.holds(h(1))
    batch = log.cut()
    assert batch is not None and [(e.kind.value, e.block_hash, e.tier) for e in batch.events] == [
        ("stored", h(0), "host"), ("stored", h(1), "host"), ("stored", h(1), "disk"), ("removed", h(1), "host"),
        ("stored", h(2), "host")]  # on the disk before it leaves host memory: always somewhere
    kv.zero_()
    for i, block_id in ((1, 5), (0, 6), (2, 7)):  # h(1) from the disk, the others from host memory
        assert tier.load(h(i), block_id) and torch.equal(kv[:, :, block_id], originals[i])
    assert (tier.counters.num_loaded_blocks, disk.counters.num_loaded_blocks) == (2, 1)
    assert tier.counters.num_dropped_blocks == 0 and [t.name for t in tiers_of(tier)] == ["host", "disk"]
    tier.close()


def test_without_slots_blocks_go_straight_to_the_disk_and_without_a_disk_they_are_dropped(tmp_path):
    kv = pool()
    disk = DiskTier(kv, str(tmp_path), 1 << 20, "k")
    straight = HostTier(kv, BLOCK_BYTES - 1, disk)
    assert straight.capacity_blocks == 0
    straight.offload(4, h(4))
    disk.flush()
    assert straight.block_hashes() == [] and disk.block_hashes() == [h(4)]
    alone = HostTier(kv, BLOCK_BYTES)
    alone.offload(1, h(1))
    alone.offload(2, h(2))
    assert alone.block_hashes() == [h(2)] and not alone.holds(h(1)) and alone.counters.num_dropped_blocks == 1
    disk.close()


def test_the_block_manager_restores_through_both_tiers(tmp_path):
    """A 4-block pool over a 2-block host tier and a disk: `b` evicts `a`'s two full blocks
    into host memory; `a` again takes blocks 0 and 1 back, each eviction pushing the least
    recently used host block on to the disk, so the first loads from host memory and the
    second (pushed out by the first's eviction) from the disk, with the KV `a` computed."""
    kv = torch.zeros((1, 2, 4, BS, 1, 2))  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_bytes = kv[:, :, 0].numel() * 4
    bm = BlockManager(4, BS)
    disk = DiskTier(kv, str(tmp_path), 1 << 20, "k")
    host = HostTier(kv, 2 * block_bytes, disk)
    bm.tier = host
    a_hashes = prefix_hashes(toks(0, 2 * BS + 1), BS)
    compute(bm, a := make_seq(toks(0, 2 * BS + 1), "a"))  # 2 full blocks + 1 token
    assert a.block_ids == [0, 1, 2]
    for i in a.block_ids:
        kv[:, :, i] = float(i + 1)  # the KV "computed" into each block
    bm.free(a)
    compute(bm, b := make_seq(toks(100, 4 * BS), "b"))  # the whole pool: a's blocks 1 then 0 evicted
    assert b.block_ids == [3, 2, 1, 0]
    assert host.block_hashes() == [a_hashes[1], a_hashes[0]] and disk.block_hashes() == []
    b_hashes = list(b.block_hashes)
    bm.free(b)
    again = make_seq(toks(0, 2 * BS + 1), "again")
    assert bm.find_cached_prefix(again) == [0, 1]
    assert [kv[0, 0, i, 0, 0].tolist() for i in (0, 1)] == [[1.0, 1.0], [2.0, 2.0]]
    assert (host.counters.num_loaded_blocks, disk.counters.num_loaded_blocks) == (1, 1)
    # Block 0's load made a_hashes[0] the most recent; taking block 1 pushed b's block 3 out.
    assert host.block_hashes() == [a_hashes[0], b_hashes[2]]
    disk.flush()
    assert sorted(disk.block_hashes()) == sorted([a_hashes[1], b_hashes[3]])
    disk.close()


def test_a_cpu_pool_has_no_host_tier():
    model = ModelConfig(name="m", architecture="LlamaForCausalLM", num_layers=2, hidden_size=64,
                        intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100,
                        rms_norm_eps=1e-5, attention_bias=False, tie_word_embeddings=True,
                        max_position_embeddings=512, sliding_window=None, eos_token_ids=(2,))
    with pytest.raises(ValueError, match="kv_offload_host_gib.*the pool is host memory already"):
        EngineConfig.build(model, device="cpu", kv_offload_host_gib=1.0)
    with pytest.raises(ValueError, match="kv_offload_host_gib.*without enable_prefix_caching"):
        EngineConfig.build(model, device="cpu", kv_offload_host_gib=1.0, enable_prefix_caching=False)
