"""BlockManager: allocation order, LRU free list, ref counts, slots, truncation and forks
(prefix caching: test_prefix_cache.py).

Pure Python, no model: sequences are built by hand and "computed" by moving
``num_computed_tokens`` forward, as the scheduler's ``update`` does.
"""

from __future__ import annotations

import pytest
from block_harness import BS, compute, free_list, make_seq, toks

from tandem.engine.sequence import Sequence
from tandem.kvcache.block_manager import BlockManager

# -- allocation, free list, ref counts, slots -------------------------------------------


def test_allocation_takes_blocks_in_order() -> None:
    """Fresh blocks are handed out lowest id first; ref counts and free list follow."""
    bm = BlockManager(8, BS)
    a, b = make_seq(toks(0, 10), "a"), make_seq(toks(100, 5), "b")
    bm.allocate(a, 10)
    assert a.block_ids == [0, 1, 2]
    bm.allocate(b, 5)
    assert b.block_ids == [3, 4]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert free_list(bm) == [5, 6, 7]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (3, 5)


def test_allocate_grows_a_table_only_at_block_boundaries() -> None:
    """Chunks and decodes add a block only when the next token starts a new one."""
    bm = BlockManager(8, BS)
    seq = make_seq(toks(0, 10))
    compute(bm, seq, 3)
    assert seq.block_ids == [0]
    compute(bm, seq, 1)  # fills block 0 exactly
    assert seq.block_ids == [0]
    compute(bm, seq, 6)  # tokens 4..9
    assert seq.block_ids == [0, 1, 2]
    for expected in ([0, 1, 2], [0, 1, 2], [0, 1, 2, 3]):  # decode tokens 10, 11, 12
        seq.token_ids.append(7)
        assert bm.num_new_blocks(seq, 1) == len(expected) - len(seq.block_ids)
        compute(bm, seq, 1)
        assert seq.block_ids == expected


def test_free_returns_blocks_tail_first_in_lru_order() -> None:
    """Freed blocks join the end of the free list, each table's tail block first."""
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = make_seq(toks(0, 12), "a"), make_seq(toks(100, 8), "b")
    bm.allocate(a, 12)
    bm.allocate(b, 8)
    bm.free(a)
    assert free_list(bm) == [5, 6, 7, 2, 1, 0]
    assert a.block_ids == [] and a.block_hashes == []
    bm.free(b)
    assert free_list(bm) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert bm.ref_counts == [0] * 8
    c = make_seq(toks(200, 16), "c")
    bm.allocate(c, 16)  # least recently freed first
    assert c.block_ids == [5, 6, 7, 2]
    assert free_list(bm) == [1, 0, 4, 3]


def test_can_allocate_is_false_exactly_when_the_pool_is_short() -> None:
    """can_allocate flips at the last free block; allocate raises then and changes nothing."""
    bm = BlockManager(4, BS)
    seq = make_seq(toks(0, 17))
    assert bm.num_new_blocks(seq, 16) == 4 and bm.can_allocate(seq, 16)
    assert bm.num_new_blocks(seq, 17) == 5 and not bm.can_allocate(seq, 17)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(seq, 17)
    assert seq.block_ids == [] and free_list(bm) == [0, 1, 2, 3]
    other = make_seq(toks(100, 5), "o")
    bm.allocate(other, 5)  # 2 blocks left
    assert bm.can_allocate(seq, 8) and not bm.can_allocate(seq, 9)
    compute(bm, seq, 7)  # pool empty; one slot left in seq's last block
    assert bm.num_free_blocks == 0
    assert bm.can_allocate(seq, 1) and not bm.can_allocate(seq, 2)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 2)
    assert seq.block_ids == [2, 3] and free_list(bm) == []


def test_slot_ids_follow_the_block_table() -> None:
    """A position's slot is block_ids[pos // bs] * bs + pos % bs, across scattered blocks."""
    bm = BlockManager(8, BS)
    a, b = make_seq(toks(0, 6), "a"), make_seq(toks(100, 4), "b")
    compute(bm, a, 3)  # a: [0]
    compute(bm, b, 4)  # b: [1]
    compute(bm, a, 3)  # a: [0, 2]
    assert a.block_ids == [0, 2]
    assert bm.slot_ids(a, 0, 6) == [0, 1, 2, 3, 8, 9]
    assert bm.slot_ids(a, 2, 5) == [2, 3, 8]
    assert bm.slot_ids(b, 0, 4) == [4, 5, 6, 7]
    assert bm.slot_ids(a, 3, 3) == []


# -- truncation (rejected draft tokens) -------------------------------------------------

def test_truncate_gives_back_exactly_the_blocks_past_the_kept_tokens():
    """A sequence that grew by 6 draft tokens and kept 1 of them: the blocks only the
    rejected drafts used go back, first in line, and the cached full block stays cached."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(toks(0, 5))
    compute(bm, seq)  # 5 prompt tokens: blocks 0, 1; block 0 full and cached
    bm.allocate(seq, 1 + 6)  # the last token and 6 drafts: positions 4..11
    assert seq.block_ids == [0, 1, 2]
    seq.token_ids.append(100)  # one accepted draft: 6 tokens kept
    seq.num_computed_tokens = 5
    bm.truncate(seq, seq.num_tokens)
    assert seq.block_ids == [0, 1]
    assert free_list(bm) == [2, 3, 4, 5, 6, 7]
    assert bm.ref_counts[:3] == [1, 1, 0]
    assert bm.block_hash[0] is not None and bm.block_hash[1] is None
    bm.truncate(seq, 4)  # the block boundary: only block 0 is needed
    assert seq.block_ids == [0]
    assert free_list(bm) == [1, 2, 3, 4, 5, 6, 7]
    bm.free(seq)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_truncate_keeps_a_shared_block_for_its_other_holder():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_seq(toks(0, 3), "a"), make_seq(toks(0, 3), "b")
    bm.allocate(a, 3)
    b.block_ids = list(a.block_ids)  # as a fork would share it
    bm.ref_counts[a.block_ids[0]] += 1
    bm.truncate(a, 0)
    assert a.block_ids == [] and b.block_ids == [0]
    assert bm.ref_counts[0] == 1 and 0 not in bm.free_block_ids


# -- fork and copy-on-write ---------------------------------------------------------------


def _fork(bm: BlockManager, parent: Sequence, rid: str) -> Sequence:
    child = make_seq(parent.token_ids, rid)
    child.take_progress(parent)
    bm.fork(parent, child)
    return child


def test_a_fork_shares_every_block_and_copies_the_partly_filled_one_it_writes():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = make_seq(toks(0, 6))  # blocks 0 (full) and 1 (2 of 4 slots)
    compute(bm, parent)
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
    parent = make_seq(toks(0, 8))  # blocks 0 and 1, both full
    compute(bm, parent)
    child = _fork(bm, parent, "c")
    child.token_ids.append(100)
    assert bm.allocate(child, 1) == [] and child.block_ids == [0, 1, 2]
    assert bm.ref_counts[:3] == [2, 2, 1]


def test_freeing_forks_returns_shared_blocks_only_with_the_last_holder():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = make_seq(toks(0, 6))
    compute(bm, parent)
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
