"""BlockManager with a tier: an evicted prefix block goes to the tier as it is handed out,
and a later prefix lookup loads it back into a free block (exact ids), keeping the hits
found before it; a failed load ends the prefix there, its block first in line again."""

from __future__ import annotations

from block_harness import BS, compute, free_list, make_seq, toks

from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.kv_events import KVEventLog
from tandem.kvcache.prefix_tier import PrefixTier, TierCounters


class RecordingTier:
    """A PrefixTier that holds what it is given in a dict (block id -> the hash it held), and
    records every call; `corrupt` hashes fail their load, as a file failing its checksum does."""

    name = "recording"
    events: KVEventLog | None = None
    next_tier: PrefixTier | None = None

    def __init__(self) -> None:
        self.counters = TierCounters()
        self.stored: dict[bytes, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.corrupt: set[bytes] = set()

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.stored

    def offload(self, block_id: int, block_hash: bytes) -> None:
        self.calls.append(("offload", block_id))
        self.stored[block_hash] = block_id

    def offload_copy(self, block_hash: bytes, kv) -> None:
        raise AssertionError("the block manager hands a tier pool blocks, never copies")

    def load(self, block_hash: bytes, block_id: int) -> bool:
        self.calls.append(("load", block_id))
        if block_hash in self.corrupt:
            del self.stored[block_hash]
            return False
        return True

    def block_hashes(self) -> list[bytes]:
        return list(self.stored)

    def close(self) -> None:
        pass


def pool_with_tier(num_blocks: int) -> tuple[BlockManager, RecordingTier]:
    bm = BlockManager(num_blocks, BS)
    tier = RecordingTier()
    bm.tier = tier
    return bm, tier


def test_evicted_prefix_blocks_go_to_the_tier_and_come_back() -> None:
    bm, tier = pool_with_tier(6)
    a = make_seq(toks(0, 13), "a")  # 3 full blocks + 1 token
    compute(bm, a)
    bm.free(a)
    assert free_list(bm) == [4, 5, 3, 2, 1, 0]
    b = make_seq(toks(100, 20), "b")  # 5 blocks: evicts a's blocks 2, 1 and 0 (3 held no hash)
    compute(bm, b)
    assert b.block_ids == [4, 5, 3, 2, 1]
    assert tier.calls == [("offload", 2), ("offload", 1)]
    hashes = prefix_hashes(toks(0, 13), BS)
    assert tier.stored == {hashes[2]: 2, hashes[1]: 1}
    bm.free(b)
    # a again: block 0 still cached in the pool, blocks 1 and 2 come back from the tier into
    # free blocks other than 0, which stays (moved to the back of the line first).
    tier.calls.clear()
    again = make_seq(toks(0, 13), "a2")
    assert bm.find_cached_prefix(again) == [0, 1, 2]
    assert tier.calls == [("offload", 1), ("load", 1), ("offload", 2), ("load", 2)]
    assert [bm.cached_block_ids[h] for h in hashes] == [0, 1, 2] and bm.ref_counts[:3] == [0, 0, 0]
    assert bm.num_free_blocks == 6
    compute(bm, again, cached=[0, 1, 2])
    assert again.block_ids[:3] == [0, 1, 2] and again.num_computed_tokens == 13


def test_a_failed_load_ends_the_prefix_and_frees_its_block_first() -> None:
    bm, tier = pool_with_tier(4)
    compute(bm, a := make_seq(toks(0, 9), "a"))  # 2 full blocks + 1
    bm.free(a)
    compute(bm, b := make_seq(toks(50, 16), "b"))  # every block: a's 2 full ones to the tier
    bm.free(b)
    hashes = prefix_hashes(toks(0, 9), BS)
    assert set(tier.stored) == set(hashes)
    tier.corrupt.add(hashes[1])
    tier.calls.clear()
    again = make_seq(toks(0, 9), "a2")
    hits = bm.find_cached_prefix(again)
    assert len(hits) == 1 and tier.calls[1::2] == [("load", hits[0]), ("load", tier.calls[-1][1])]
    failed = tier.calls[-1][1]
    assert free_list(bm)[0] == failed and bm.block_hash[failed] is None
    assert hashes[1] not in tier.stored and bm.num_free_blocks == 4


def test_no_load_without_a_free_block_beyond_the_hits() -> None:
    bm, tier = pool_with_tier(3)
    compute(bm, a := make_seq(toks(0, 9), "a"))
    bm.free(a)
    compute(bm, make_seq(toks(50, 5), "b"))  # takes blocks 2 and 1: a's block 1 to the tier
    assert tier.calls == [("offload", 1)]
    # Only block 0 (a's first, cached) is free: it must not be taken to load a's second.
    assert bm.find_cached_prefix(make_seq(toks(0, 9), "a2")) == [0]
    assert tier.calls == [("offload", 1)]


def test_a_probe_finds_the_pools_blocks_and_loads_nothing() -> None:
    """find_cached_prefix(restore=False), as the engine's room check asks: the pool's hits
    alone, the tier left untouched and the free list as it was."""
    bm, tier = pool_with_tier(6)
    compute(bm, a := make_seq(toks(0, 13), "a"))
    bm.free(a)
    compute(bm, b := make_seq(toks(100, 20), "b"))  # a's blocks 2 and 1 to the tier; block 0 stays cached
    bm.free(b)
    tier.calls.clear()
    before = free_list(bm)
    assert bm.find_cached_prefix(make_seq(toks(0, 13), "probe"), restore=False) == [0]
    assert tier.calls == [] and free_list(bm) == before
    assert bm.find_cached_prefix(make_seq(toks(0, 13), "a2")) == [0, 1, 2]  # restoring: both loaded
