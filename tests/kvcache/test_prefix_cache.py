"""BlockManager's prefix caching: chained block hashes, shared blocks with exact ids, the
partly filled last block never shared, LRU eviction of cached free blocks."""

from __future__ import annotations

from block_harness import BS, compute, free_list, make_seq, toks

from tandem.kvcache.block_manager import BlockManager, hash_block

# -- prefix caching -----------------------------------------------------------------------


def test_same_prefix_shares_the_exact_blocks() -> None:
    """A second sequence with the same 3-block prefix gets blocks 0,1,2 with ref count 2."""
    bm = BlockManager(8, BS)
    a = make_seq(toks(0, 14), "a")
    compute(bm, a)
    assert a.block_ids == [0, 1, 2, 3] and len(a.block_hashes) == 3
    b = make_seq(toks(0, 12) + [99, 98, 97], "b")
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1, 2]
    assert bm.num_new_blocks(b, 3, cached) == 1
    bm.allocate(b, 3, cached)
    assert b.block_ids == [0, 1, 2, 4]
    assert b.num_computed_tokens == 12 and b.block_hashes == a.block_hashes
    assert bm.ref_counts[:5] == [2, 2, 2, 1, 1]
    bm.free(a)
    assert bm.ref_counts[:5] == [1, 1, 1, 0, 1] and free_list(bm) == [5, 6, 7, 3]
    bm.free(b)
    assert free_list(bm) == [5, 6, 7, 3, 4, 2, 1, 0]


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    """An exact repeat of a block-aligned prompt reuses all blocks but the last."""
    bm = BlockManager(8, BS)
    compute(bm, a := make_seq(toks(0, 12), "a"))
    assert a.block_ids == [0, 1, 2] and len(a.block_hashes) == 3
    b = make_seq(toks(0, 12), "b")
    assert bm.find_cached_prefix(b) == [0, 1]
    compute(bm, b, 4, cached=[0, 1])
    assert b.block_ids == [0, 1, 3]
    assert bm.block_hash[3] is None  # same hash as block 2: the first one stays registered
    assert bm.cached_block_ids[b.block_hashes[2]] == 2
    assert bm.find_cached_prefix(make_seq(toks(0, 13), "c")) == [0, 1, 2]


def test_partial_last_block_is_never_shared() -> None:
    """Only full, computed blocks get a hash; a partly filled block is never a hit."""
    bm = BlockManager(8, BS)
    a = make_seq(toks(0, 14), "a")
    compute(bm, a, 11)
    assert len(a.block_hashes) == 2  # block 2 holds 3 of its 4 tokens
    compute(bm, a, 3)
    assert len(a.block_hashes) == 3 and bm.block_hash[3] is None
    assert bm.find_cached_prefix(make_seq(toks(0, 15), "b")) == [0, 1, 2]
    assert bm.find_cached_prefix(make_seq(toks(0, 16) + [5], "c")) == [0, 1, 2]


def test_hit_on_a_free_cached_block_takes_it_off_the_free_list() -> None:
    """Freed blocks stay findable; reviving them removes them from the free list."""
    bm = BlockManager(8, BS)
    a = make_seq(toks(0, 12), "a")
    compute(bm, a)
    bm.free(a)
    assert free_list(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_seq(toks(0, 13), "b")
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1, 2]
    assert bm.num_new_blocks(b, 1, cached) == 4  # 3 revived + 1 new
    bm.allocate(b, 1, cached)
    assert b.block_ids == [0, 1, 2, 3]
    assert free_list(bm) == [4, 5, 6, 7] and bm.ref_counts == [1, 1, 1, 1, 0, 0, 0, 0]
    # Reviving counts against the pool: with 3 free blocks the same hit no longer fits.
    bm2 = BlockManager(3, BS)
    compute(bm2, a2 := make_seq(toks(0, 8), "a2"))
    bm2.free(a2)
    b2 = make_seq(toks(0, 12), "b2")
    assert bm2.find_cached_prefix(b2) == [0, 1]
    assert bm2.can_allocate(b2, 4, [0, 1]) and not bm2.can_allocate(b2, 5, [0, 1])


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    """Eviction takes the LRU free block, drops its hash, and leaves the rest findable."""
    bm = BlockManager(4, BS)
    a, b = make_seq(toks(0, 8), "a"), make_seq(toks(100, 8), "b")
    compute(bm, a)
    compute(bm, b)
    a_hashes, b_hashes = list(a.block_hashes), list(b.block_hashes)
    bm.free(a)
    bm.free(b)
    assert free_list(bm) == [1, 0, 3, 2]
    c = make_seq(toks(500, 3), "c")
    bm.allocate(c, 3)
    assert c.block_ids == [1]  # a's tail block goes first
    assert a_hashes[1] not in bm.cached_block_ids and bm.block_hash[1] is None
    assert bm.cached_block_ids == {a_hashes[0]: 0, b_hashes[0]: 2, b_hashes[1]: 3}
    assert bm.find_cached_prefix(make_seq(toks(0, 9), "a'")) == [0]
    d = make_seq(toks(600, 8), "d")
    bm.allocate(d, 8)
    assert d.block_ids == [0, 3]
    assert bm.cached_block_ids == {b_hashes[0]: 2}
    assert bm.find_cached_prefix(make_seq(toks(100, 9), "b'")) == [2]


def test_hash_is_chained_over_the_prefix() -> None:
    """The same block tokens after a different prefix do not hit."""
    x, y, z = toks(0), toks(10), toks(20)
    assert hash_block(b"", y) != hash_block(hash_block(b"", x), y)
    assert hash_block(b"", x) == hash_block(b"", list(x))  # stable, content-only
    bm = BlockManager(8, BS)
    compute(bm, make_seq(x + y + [1], "a"))
    assert bm.find_cached_prefix(make_seq(z + y + [1], "b")) == []
    assert bm.find_cached_prefix(make_seq(y + [1], "c")) == []
    assert bm.find_cached_prefix(make_seq(x + z + [1], "d")) == [0]
    assert bm.find_cached_prefix(make_seq(x + y + [1], "e")) == [0, 1]


def test_disabled_prefix_caching_never_hits() -> None:
    """With caching off no hash is kept and identical prompts share nothing."""
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(toks(0, 13), "a")
    compute(bm, a)
    assert a.block_hashes == [] and bm.cached_block_ids == {} and bm.block_hash == [None] * 8
    b = make_seq(toks(0, 13), "b")
    assert bm.find_cached_prefix(b) == []
    compute(bm, b)
    assert b.block_ids == [4, 5, 6, 7] and max(bm.ref_counts) == 1


def test_duplicate_computation_keeps_the_first_registered_block() -> None:
    """Two sequences computing the same block at once: the first one stays the cached copy."""
    bm = BlockManager(8, BS)
    a, b = make_seq(toks(0, 9), "a"), make_seq(toks(0, 9), "b")
    bm.allocate(a, 9)
    bm.allocate(b, 9)
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.cache_full_blocks(s)
    assert a.block_hashes == b.block_hashes
    assert bm.block_hash[:6] == [a.block_hashes[0], a.block_hashes[1], None, None, None, None]
    bm.free(a)
    bm.free(b)
    assert bm.find_cached_prefix(make_seq(toks(0, 9), "c")) == [0, 1]


def test_a_cache_salt_shares_blocks_only_with_the_same_salt() -> None:
    """The same 3-block prefix under salts: found only by its own salt; unsalted requests
    neither see salted blocks nor are seen by them. The salted chain differs from block 0 on."""
    bm = BlockManager(16, BS)
    compute(bm, a := make_seq(toks(0, 14), "a", cache_salt="acme"))
    compute(bm, u := make_seq(toks(0, 14), "u"))
    assert a.block_ids == [0, 1, 2, 3] and u.block_ids == [4, 5, 6, 7]
    assert not set(a.block_hashes) & set(u.block_hashes)
    assert bm.find_cached_prefix(make_seq(toks(0, 13), "a2", cache_salt="acme")) == [0, 1, 2]
    assert bm.find_cached_prefix(make_seq(toks(0, 13), "b", cache_salt="bobs")) == []
    assert bm.find_cached_prefix(make_seq(toks(0, 13), "u2")) == [4, 5, 6]
