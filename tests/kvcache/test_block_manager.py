"""BlockManager: allocation order, LRU free list, ref counts, slots and prefix caching.

Pure Python, no model: sequences are built by hand and "computed" by moving
``num_computed_tokens`` forward, as the scheduler's ``update`` does.
"""

from __future__ import annotations

import pytest

from tandem.engine.sequence import Sequence
from tandem.kvcache.block_manager import BlockManager, hash_block
from tandem.sampling_params import SamplingParams

BS = 4  # block size of every test here


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival_index=0)


def _compute(bm: BlockManager, seq: Sequence, n: int | None = None, cached: list[int] | None = None) -> None:
    """Allocate for and 'run' the next n tokens (all uncomputed ones by default)."""
    cached = cached or []
    n = seq.num_tokens - seq.num_computed_tokens - len(cached) * BS if n is None else n
    bm.allocate(seq, n, cached)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def _free_list(bm: BlockManager) -> list[int]:
    return list(bm.free_block_ids)


def _toks(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))


# -- allocation, free list, ref counts, slots -------------------------------------------


def test_allocation_takes_blocks_in_order() -> None:
    """Fresh blocks are handed out lowest id first; ref counts and free list follow."""
    bm = BlockManager(8, BS)
    a, b = _seq(_toks(0, 10), "a"), _seq(_toks(100, 5), "b")
    bm.allocate(a, 10)
    assert a.block_ids == [0, 1, 2]
    bm.allocate(b, 5)
    assert b.block_ids == [3, 4]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert _free_list(bm) == [5, 6, 7]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (3, 5)


def test_allocate_grows_a_table_only_at_block_boundaries() -> None:
    """Chunks and decodes add a block only when the next token starts a new one."""
    bm = BlockManager(8, BS)
    seq = _seq(_toks(0, 10))
    _compute(bm, seq, 3)
    assert seq.block_ids == [0]
    _compute(bm, seq, 1)  # fills block 0 exactly
    assert seq.block_ids == [0]
    _compute(bm, seq, 6)  # tokens 4..9
    assert seq.block_ids == [0, 1, 2]
    for expected in ([0, 1, 2], [0, 1, 2], [0, 1, 2, 3]):  # decode tokens 10, 11, 12
        seq.token_ids.append(7)
        assert bm.num_new_blocks(seq, 1) == len(expected) - len(seq.block_ids)
        _compute(bm, seq, 1)
        assert seq.block_ids == expected


def test_free_returns_blocks_tail_first_in_lru_order() -> None:
    """Freed blocks join the end of the free list, each table's tail block first."""
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = _seq(_toks(0, 12), "a"), _seq(_toks(100, 8), "b")
    bm.allocate(a, 12)
    bm.allocate(b, 8)
    bm.free(a)
    assert _free_list(bm) == [5, 6, 7, 2, 1, 0]
    assert a.block_ids == [] and a.block_hashes == []
    bm.free(b)
    assert _free_list(bm) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert bm.ref_counts == [0] * 8
    c = _seq(_toks(200, 16), "c")
    bm.allocate(c, 16)  # least recently freed first
    assert c.block_ids == [5, 6, 7, 2]
    assert _free_list(bm) == [1, 0, 4, 3]


def test_can_allocate_is_false_exactly_when_the_pool_is_short() -> None:
    """can_allocate flips at the last free block; allocate raises then and changes nothing."""
    bm = BlockManager(4, BS)
    seq = _seq(_toks(0, 17))
    assert bm.num_new_blocks(seq, 16) == 4 and bm.can_allocate(seq, 16)
    assert bm.num_new_blocks(seq, 17) == 5 and not bm.can_allocate(seq, 17)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(seq, 17)
    assert seq.block_ids == [] and _free_list(bm) == [0, 1, 2, 3]
    other = _seq(_toks(100, 5), "o")
    bm.allocate(other, 5)  # 2 blocks left
    assert bm.can_allocate(seq, 8) and not bm.can_allocate(seq, 9)
    _compute(bm, seq, 7)  # pool empty; one slot left in seq's last block
    assert bm.num_free_blocks == 0
    assert bm.can_allocate(seq, 1) and not bm.can_allocate(seq, 2)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 2)
    assert seq.block_ids == [2, 3] and _free_list(bm) == []


def test_slot_ids_follow_the_block_table() -> None:
    """A position's slot is block_ids[pos // bs] * bs + pos % bs, across scattered blocks."""
    bm = BlockManager(8, BS)
    a, b = _seq(_toks(0, 6), "a"), _seq(_toks(100, 4), "b")
    _compute(bm, a, 3)  # a: [0]
    _compute(bm, b, 4)  # b: [1]
    _compute(bm, a, 3)  # a: [0, 2]
    assert a.block_ids == [0, 2]
    assert bm.slot_ids(a, 0, 6) == [0, 1, 2, 3, 8, 9]
    assert bm.slot_ids(a, 2, 5) == [2, 3, 8]
    assert bm.slot_ids(b, 0, 4) == [4, 5, 6, 7]
    assert bm.slot_ids(a, 3, 3) == []


# -- prefix caching -----------------------------------------------------------------------


def test_same_prefix_shares_the_exact_blocks() -> None:
    """A second sequence with the same 3-block prefix gets blocks 0,1,2 with ref count 2."""
    bm = BlockManager(8, BS)
    a = _seq(_toks(0, 14), "a")
    _compute(bm, a)
    assert a.block_ids == [0, 1, 2, 3] and len(a.block_hashes) == 3
    b = _seq(_toks(0, 12) + [99, 98, 97], "b")
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1, 2]
    assert bm.num_new_blocks(b, 3, cached) == 1
    bm.allocate(b, 3, cached)
    assert b.block_ids == [0, 1, 2, 4]
    assert b.num_computed_tokens == 12 and b.block_hashes == a.block_hashes
    assert bm.ref_counts[:5] == [2, 2, 2, 1, 1]
    bm.free(a)
    assert bm.ref_counts[:5] == [1, 1, 1, 0, 1] and _free_list(bm) == [5, 6, 7, 3]
    bm.free(b)
    assert _free_list(bm) == [5, 6, 7, 3, 4, 2, 1, 0]


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    """An exact repeat of a block-aligned prompt reuses all blocks but the last."""
    bm = BlockManager(8, BS)
    _compute(bm, a := _seq(_toks(0, 12), "a"))
    assert a.block_ids == [0, 1, 2] and len(a.block_hashes) == 3
    b = _seq(_toks(0, 12), "b")
    assert bm.find_cached_prefix(b) == [0, 1]
    _compute(bm, b, 4, cached=[0, 1])
    assert b.block_ids == [0, 1, 3]
    assert bm.block_hash[3] is None  # same hash as block 2: the first one stays registered
    assert bm.cached_block_ids[b.block_hashes[2]] == 2
    assert bm.find_cached_prefix(_seq(_toks(0, 13), "c")) == [0, 1, 2]


def test_partial_last_block_is_never_shared() -> None:
    """Only full, computed blocks get a hash; a partly filled block is never a hit."""
    bm = BlockManager(8, BS)
    a = _seq(_toks(0, 14), "a")
    _compute(bm, a, 11)
    assert len(a.block_hashes) == 2  # block 2 holds 3 of its 4 tokens
    _compute(bm, a, 3)
    assert len(a.block_hashes) == 3 and bm.block_hash[3] is None
    assert bm.find_cached_prefix(_seq(_toks(0, 15), "b")) == [0, 1, 2]
    assert bm.find_cached_prefix(_seq(_toks(0, 16) + [5], "c")) == [0, 1, 2]


def test_hit_on_a_free_cached_block_takes_it_off_the_free_list() -> None:
    """Freed blocks stay findable; reviving them removes them from the free list."""
    bm = BlockManager(8, BS)
    a = _seq(_toks(0, 12), "a")
    _compute(bm, a)
    bm.free(a)
    assert _free_list(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = _seq(_toks(0, 13), "b")
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1, 2]
    assert bm.num_new_blocks(b, 1, cached) == 4  # 3 revived + 1 new
    bm.allocate(b, 1, cached)
    assert b.block_ids == [0, 1, 2, 3]
    assert _free_list(bm) == [4, 5, 6, 7] and bm.ref_counts == [1, 1, 1, 1, 0, 0, 0, 0]
    # Reviving counts against the pool: with 3 free blocks the same hit no longer fits.
    bm2 = BlockManager(3, BS)
    _compute(bm2, a2 := _seq(_toks(0, 8), "a2"))
    bm2.free(a2)
    b2 = _seq(_toks(0, 12), "b2")
    assert bm2.find_cached_prefix(b2) == [0, 1]
    assert bm2.can_allocate(b2, 4, [0, 1]) and not bm2.can_allocate(b2, 5, [0, 1])


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    """Eviction takes the LRU free block, drops its hash, and leaves the rest findable."""
    bm = BlockManager(4, BS)
    a, b = _seq(_toks(0, 8), "a"), _seq(_toks(100, 8), "b")
    _compute(bm, a)
    _compute(bm, b)
    a_hashes, b_hashes = list(a.block_hashes), list(b.block_hashes)
    bm.free(a)
    bm.free(b)
    assert _free_list(bm) == [1, 0, 3, 2]
    c = _seq(_toks(500, 3), "c")
    bm.allocate(c, 3)
    assert c.block_ids == [1]  # a's tail block goes first
    assert a_hashes[1] not in bm.cached_block_ids and bm.block_hash[1] is None
    assert bm.cached_block_ids == {a_hashes[0]: 0, b_hashes[0]: 2, b_hashes[1]: 3}
    assert bm.find_cached_prefix(_seq(_toks(0, 9), "a'")) == [0]
    d = _seq(_toks(600, 8), "d")
    bm.allocate(d, 8)
    assert d.block_ids == [0, 3]
    assert bm.cached_block_ids == {b_hashes[0]: 2}
    assert bm.find_cached_prefix(_seq(_toks(100, 9), "b'")) == [2]


def test_hash_is_chained_over_the_prefix() -> None:
    """The same block tokens after a different prefix do not hit."""
    x, y, z = _toks(0), _toks(10), _toks(20)
    assert hash_block(b"", y) != hash_block(hash_block(b"", x), y)
    assert hash_block(b"", x) == hash_block(b"", list(x))  # stable, content-only
    bm = BlockManager(8, BS)
    _compute(bm, _seq(x + y + [1], "a"))
    assert bm.find_cached_prefix(_seq(z + y + [1], "b")) == []
    assert bm.find_cached_prefix(_seq(y + [1], "c")) == []
    assert bm.find_cached_prefix(_seq(x + z + [1], "d")) == [0]
    assert bm.find_cached_prefix(_seq(x + y + [1], "e")) == [0, 1]


def test_disabled_prefix_caching_never_hits() -> None:
    """With caching off no hash is kept and identical prompts share nothing."""
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = _seq(_toks(0, 13), "a")
    _compute(bm, a)
    assert a.block_hashes == [] and bm.cached_block_ids == {} and bm.block_hash == [None] * 8
    b = _seq(_toks(0, 13), "b")
    assert bm.find_cached_prefix(b) == []
    _compute(bm, b)
    assert b.block_ids == [4, 5, 6, 7] and max(bm.ref_counts) == 1


def test_duplicate_computation_keeps_the_first_registered_block() -> None:
    """Two sequences computing the same block at once: the first one stays the cached copy."""
    bm = BlockManager(8, BS)
    a, b = _seq(_toks(0, 9), "a"), _seq(_toks(0, 9), "b")
    bm.allocate(a, 9)
    bm.allocate(b, 9)
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.cache_full_blocks(s)
    assert a.block_hashes == b.block_hashes
    assert bm.block_hash[:6] == [a.block_hashes[0], a.block_hashes[1], None, None, None, None]
    bm.free(a)
    bm.free(b)
    assert bm.find_cached_prefix(_seq(_toks(0, 9), "c")) == [0, 1]


# -- truncation (rejected draft tokens) -------------------------------------------------

def test_truncate_gives_back_exactly_the_blocks_past_the_kept_tokens():
    """A sequence that grew by 6 draft tokens and kept 1 of them: the blocks only the
    rejected drafts used go back, first in line, and the cached full block stays cached."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = _seq(_toks(0, 5))
    _compute(bm, seq)  # 5 prompt tokens: blocks 0, 1; block 0 full and cached
    bm.allocate(seq, 1 + 6)  # the last token and 6 drafts: positions 4..11
    assert seq.block_ids == [0, 1, 2]
    seq.token_ids.append(100)  # one accepted draft: 6 tokens kept
    seq.num_computed_tokens = 5
    bm.truncate(seq, seq.num_tokens)
    assert seq.block_ids == [0, 1]
    assert _free_list(bm) == [2, 3, 4, 5, 6, 7]
    assert bm.ref_counts[:3] == [1, 1, 0]
    assert bm.block_hash[0] is not None and bm.block_hash[1] is None
    bm.truncate(seq, 4)  # the block boundary: only block 0 is needed
    assert seq.block_ids == [0]
    assert _free_list(bm) == [1, 2, 3, 4, 5, 6, 7]
    bm.free(seq)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_truncate_keeps_a_shared_block_for_its_other_holder():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = _seq(_toks(0, 3), "a"), _seq(_toks(0, 3), "b")
    bm.allocate(a, 3)
    b.block_ids = list(a.block_ids)  # as a fork would share it
    bm.ref_counts[a.block_ids[0]] += 1
    bm.truncate(a, 0)
    assert a.block_ids == [] and b.block_ids == [0]
    assert bm.ref_counts[0] == 1 and 0 not in bm.free_block_ids


# -- fork and copy-on-write ---------------------------------------------------------------


def _fork(bm: BlockManager, parent: Sequence, rid: str) -> Sequence:
    child = _seq(parent.token_ids, rid)
    child.take_progress(parent)
    bm.fork(parent, child)
    return child


def test_a_fork_shares_every_block_and_copies_the_partly_filled_one_it_writes():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = _seq(_toks(0, 6))  # blocks 0 (full) and 1 (2 of 4 slots)
    _compute(bm, parent)
    assert parent.block_ids == [0, 1]
    child = _fork(bm, parent, "c")
    assert child.block_ids == [0, 1] and bm.ref_counts[:2] == [2, 2] and bm.num_free_blocks == 6
    assert bm.num_new_blocks(child, 1) == 1  # the copy of block 1
    child.token_ids.append(100)
    assert bm.allocate(child, 1) == [(1, 2)]  # copy block 1 into 2, then write there
    assert child.block_ids == [0, 2] and bm.ref_counts[:3] == [2, 1, 1]
    # The parent, now alone on block 1, writes it in place: no copy.
    parent.token_ids.append(200)
    assert bm.allocate(parent, 1) == [] and parent.block_ids == [0, 1]


def test_a_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = _seq(_toks(0, 8))  # blocks 0 and 1, both full
    _compute(bm, parent)
    child = _fork(bm, parent, "c")
    child.token_ids.append(100)
    assert bm.allocate(child, 1) == [] and child.block_ids == [0, 1, 2]
    assert bm.ref_counts[:3] == [2, 2, 1]


def test_freeing_forks_returns_shared_blocks_only_with_the_last_holder():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = _seq(_toks(0, 6))
    _compute(bm, parent)
    forks = [_fork(bm, parent, f"c{i}") for i in range(3)]
    assert bm.ref_counts[:2] == [4, 4]
    for i, fork in enumerate(forks):
        fork.token_ids.append(100 + i)
        bm.allocate(fork, 1)
    assert [f.block_ids for f in forks] == [[0, 2], [0, 3], [0, 4]] and bm.ref_counts[:5] == [4, 1, 1, 1, 1]
    bm.free(parent)
    assert bm.ref_counts[:2] == [3, 0] and 1 in bm.free_block_ids
    for fork in forks:
        bm.free(fork)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)
