"""The KV block pool: free list, reference counts, block tables, prefix caching and
copy-on-write for blocks that forked sequences share.

Mechanism only: the scheduler decides who gets blocks; this module keeps the books.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence as Seq

from tandem.engine.sequence import Sequence
from tandem.kvcache.block_hash import hash_block, root_hash
from tandem.kvcache.kv_events import POOL_TIER, BlockEventKind, KVEventLog
from tandem.kvcache.prefix_tier import PrefixTier


@dataclass(frozen=True)
class PrefixLookup:
    """What a prefix lookup found (:meth:`BlockManager.lookup_prefix`)."""

    block_ids: list[int]
    """The blocks holding the prefix, in order: cached in the pool, or loaded from a tier."""
    num_loaded: int
    """How many of them this lookup loaded from a tier."""
    complete: bool
    """False when the load limit stopped the lookup before a block a tier holds: the prefix
    goes on, and a later lookup loads the rest."""


class BlockManager:
    """Fixed-size KV blocks shared by reference count.

    Free blocks wait in LRU order; a free block that still holds a full, hashed block
    stays findable by its hash until it is handed out again (prefix caching), and then,
    with a tier, goes there and is found there next (prefix_tier.py).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached_block_ids: dict[bytes, int] = {}
        # NOTE: insertion order is eviction order: the least recently freed block goes first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tier: PrefixTier | None = None
        """Where evicted prefix blocks go, and prefix lookups look next (None: forgotten)."""
        self.events: KVEventLog | None = None
        """Where blocks entering and leaving the prefix cache are recorded (None: nowhere)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence, restore: bool = True) -> list[int]:
        """Block ids that already hold a prefix of ``seq``'s tokens, longest first match.

        At least one token is always left to compute (its logits give the next token),
        so a fully cached sequence gives back its last block.
        restore: load blocks the pool lacks from the tier (False: the pool's alone, for a
        probe that must not move blocks; a tier hit needs a free block anyway).
        """
        return self.lookup_prefix(seq, None if restore else 0).block_ids

    def lookup_prefix(self, seq: Sequence, max_loads: int | None = None) -> PrefixLookup:
        """:meth:`find_cached_prefix`, loading at most ``max_loads`` blocks from the tier
        (None: as many as it holds)."""
        if not self.enable_prefix_caching:
            return PrefixLookup([], 0, True)
        block_ids: list[int] = []
        num_loaded = 0
        parent = root_hash(seq.params.cache_salt)
        num_full = (seq.num_tokens - 1) // self.block_size
        for i in range(num_full):
            parent = hash_block(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached_block_ids.get(parent)
            if block_id is None and self.tier is not None:
                if max_loads is not None and num_loaded >= max_loads:
                    return PrefixLookup(block_ids, num_loaded, not self.tier.holds(parent))
                block_id = self._restore(parent, block_ids)
                num_loaded += block_id is not None
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixLookup(block_ids, num_loaded, True)

    def _restore(self, block_hash: bytes, hit_ids: list[int]) -> int | None:
        """Load ``block_hash`` from the tier into a free block, cached as if never evicted
        (no owner, most recently freed). -> its id, or None (not there, or no free block
        beyond the prefix ``hit_ids`` found so far, which must stay)."""
        assert self.tier is not None
        if not self.tier.holds(block_hash):
            return None
        # NOTE: the hits found so far go to the back of the line first, or taking a block
        # for this one could evict them.
        idle_hits = [b for b in hit_ids if self.ref_counts[b] == 0]
        if len(self.free_block_ids) <= len(idle_hits):
            return None
        for b in idle_hits:
            self.free_block_ids.move_to_end(b)
        block_id = self._take_free_block()
        self.ref_counts[block_id] = 0
        if not self.tier.load(block_hash, block_id):
            self.free_block_ids[block_id] = None  # first in line again: it holds nothing
            self.free_block_ids.move_to_end(block_id, last=False)
            return None
        self.free_block_ids[block_id] = None
        self.block_hash[block_id] = block_hash
        self.cached_block_ids[block_hash] = block_id
        if self.events is not None:
            self.events.record(BlockEventKind.STORED, block_hash, POOL_TIER)
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.params.cache_salt)
            block_hash = hash_block(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_hashes.append(block_hash)
            block_id = seq.block_ids[i]
            # Another sequence may have computed the same block first: keep that one.
            if self.block_hash[block_id] is None and block_hash not in self.cached_block_ids:
                self.block_hash[block_id] = block_hash
                self.cached_block_ids[block_hash] = block_id
                if self.events is not None:
                    self.events.record(BlockEventKind.STORED, block_hash, POOL_TIER)

    # -- allocation ---------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, cached_block_ids: Seq[int] = ()) -> int:
        """Free blocks that growing ``seq`` by ``num_new_tokens`` would take from the pool."""
        # NOTE: cached prefix blocks are only given at first admission (nothing computed yet).
        num_computed = seq.num_computed_tokens + len(cached_block_ids) * self.block_size
        num_held = len(seq.block_ids) + len(cached_block_ids)
        needed = self.num_blocks_for(num_computed + num_new_tokens) - num_held
        # Cached blocks with no owner sit in the free list: taking them uses it up too.
        revived = sum(1 for b in cached_block_ids if self.ref_counts[b] == 0)
        return max(needed, 0) + revived + len(self._shared_written(seq))

    def _shared_written(self, seq: Sequence) -> list[int]:
        """Positions in ``seq``'s block table of blocks it shares and will write next (from
        its first uncomputed token on): each must be copied first."""
        first = seq.num_computed_tokens // self.block_size
        return [i for i in range(first, len(seq.block_ids)) if self.ref_counts[seq.block_ids[i]] > 1]

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: Seq[int] = ()) -> bool:
        return self.num_new_blocks(seq, num_new_tokens, cached_block_ids) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: Seq[int] = ()) -> list[tuple[int, int]]:
        """Give ``seq`` the cached prefix blocks (first admission) and enough new blocks
        for ``num_new_tokens`` more tokens; a shared block it will write is replaced by a
        private copy (copy-on-write). Call :meth:`can_allocate` first.

        -> (source, destination) block pairs whose contents must be copied before ``seq``'s
        next forward writes them."""
        if not self.can_allocate(seq, num_new_tokens, cached_block_ids):
            raise RuntimeError(f"not enough free KV blocks for {seq.request_id}")
        assert not cached_block_ids or not seq.block_ids, "prefix hits only at first admission"
        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
            seq.block_ids.append(block_id)
        if cached_block_ids:
            seq.num_computed_tokens = len(seq.block_ids) * self.block_size
            seq.block_hashes = [self.block_hash[b] for b in seq.block_ids]  # type: ignore[misc]
        copies = []
        for i in self._shared_written(seq):
            shared = seq.block_ids[i]
            # NOTE: the other holders keep it, so it cannot be handed out before the copy runs.
            self.ref_counts[shared] -= 1
            seq.block_ids[i] = self._take_free_block()
            copies.append((shared, seq.block_ids[i]))
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        for _ in range(num_needed):
            seq.block_ids.append(self._take_free_block())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` (holding no blocks) share every block of ``parent``: whichever
        then writes a shared block first copies it (see :meth:`allocate`)."""
        assert not child.block_ids, f"{child.request_id} already holds blocks"
        for block_id in parent.block_ids:
            self.ref_counts[block_id] += 1
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go back to the free list."""
        # Tail blocks first, so that eviction takes a prefix's end before its start.
        for block_id in reversed(seq.block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None
        seq.block_ids = []
        seq.block_hashes = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s blocks beyond the first ``num_tokens`` tokens (after rejected
        draft tokens: their KV is dropped, and what a kept block holds past that is
        overwritten later)."""
        num_kept = self.num_blocks_for(num_tokens)
        # NOTE: blocks past the computed tokens were never hashed, so none leaves the prefix cache.
        for block_id in reversed(seq.block_ids[num_kept:]):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                # First in line to be handed out again: it holds nothing worth keeping.
                self.free_block_ids[block_id] = None
                self.free_block_ids.move_to_end(block_id, last=False)
        del seq.block_ids[num_kept:]

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        old_hash = self.block_hash[block_id]
        if old_hash is not None:  # evict: its contents are about to be overwritten
            if self.tier is not None:
                self.tier.offload(block_id, old_hash)
            if self.events is not None:
                self.events.record(BlockEventKind.REMOVED, old_hash, POOL_TIER)
            del self.cached_block_ids[old_hash]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    # -- addressing ---------------------------------------------------------------------

    def slot_ids(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of ``seq``'s token positions [start, end)."""
        bs = self.block_size
        return [seq.block_ids[pos // bs] * bs + pos % bs for pos in range(start, end)]
