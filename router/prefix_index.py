"""The router's approximate index of which worker holds which prefix blocks.

Prompts are hashed in full blocks of each worker's own block size with the block
manager's chained hash (tandem/kvcache/block_hash.py), so a match here is the match that the
worker's `find_cached_prefix` would make, as long as the worker has not evicted the
blocks meanwhile: the index only learns what the router sent where, never evictions.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from tandem.kvcache.block_hash import prefix_hashes
from tandem.worker.api import WorkerLoad

MAX_BLOCKS_PER_WORKER = 1_000_000
"""Bound on remembered hashes per worker, whatever pool size it reports."""


class PrefixIndex:
    """Per worker, the block hashes of the prompts routed to it, least recently routed first."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, instance: str, load: WorkerLoad | None, token_ids: Sequence[int],
               cache_salt: str | None = None) -> None:
        """The worker `instance` (last reported `load`) now computes or holds these tokens
        (under `cache_salt`: the worker's hashes start from it, see block_hash.root_hash)."""
        if load is None:  # block size unknown: nothing to hash with
            return
        held = self._held.setdefault(instance, OrderedDict())
        for h in prefix_hashes(token_ids, load.block_size, cache_salt=cache_salt):
            held[h] = None
            held.move_to_end(h)
        # A worker caches at most its pool's blocks and evicts the least recently used
        # first: forget the oldest guesses the same way.
        while len(held) > min(load.num_blocks, MAX_BLOCKS_PER_WORKER):
            held.popitem(last=False)

    def num_cached_tokens(self, instance: str, load: WorkerLoad | None, token_ids: Sequence[int],
                          cache_salt: str | None = None) -> int:
        """Leading prompt tokens the worker probably holds: whole blocks, and never the last
        token (its block manager always leaves one to compute, see find_cached_prefix)."""
        held = self._held.get(instance)
        if load is None or not held:
            return 0
        num_blocks = 0
        for h in prefix_hashes(token_ids, load.block_size, (len(token_ids) - 1) // load.block_size, cache_salt):
            if h not in held:
                break
            num_blocks += 1
        return num_blocks * load.block_size
