"""Where a worker fetches the prefix blocks it lacks (precise_prefix only): another worker
whose pool or disk tier, by the KV index, holds the blocks that follow what this worker holds. The
fetch itself is the workers' (kvtransfer/tier_peer.py); the router only points.

precise_prefix already sends a request to the worker that holds most of its prefix unless
that worker is crowded; this is for the one it sends it to instead, and for the worker of
the other pool (a decode worker that can load a conversation's history instead of receiving
it again). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.kv_events import POOL_TIER
from tandem.router.kv_index import DISK_TIER, KVBlockIndex
from tandem.router.policy import WorkerState
from tandem.worker.api import KVSource

SERVED_TIERS = frozenset((POOL_TIER, DISK_TIER))
"""What a worker's tier server serves: its pool's cached blocks (a tensor-parallel pool's are
not: it then serves fewer, and the fetcher computes the rest) and its disk tier (a host
tier's blocks go to disk when it fills)."""
MIN_FETCH_BLOCKS = 2
"""Fewer blocks than this are recomputed: a fetch's round trip would cost about as much."""


def kv_source_for(index: KVBlockIndex, tier_addresses: Mapping[str, str], worker: WorkerState,
                  prompt_token_ids: list[int], cache_salt: str | None) -> KVSource | None:
    """The worker ``worker`` should fetch the prompt's next prefix blocks from (``tier_addresses``:
    instance -> its tier server), or None: none holds at least MIN_FETCH_BLOCKS more."""
    if worker.load is None or not tier_addresses:
        return None
    bs = worker.load.block_size  # never the last token's block: the worker always computes one
    hashes = prefix_hashes(prompt_token_ids, bs, (len(prompt_token_ids) - 1) // bs, cache_salt)
    num_held = index.match(worker.instance, hashes).num_blocks
    best: tuple[int, str] | None = None
    for instance, address in tier_addresses.items():
        if instance != worker.instance:
            n = index.num_leading_in(instance, hashes[num_held:], SERVED_TIERS)
            if n >= MIN_FETCH_BLOCKS and (best is None or n > best[0]):
                best = (n, address)
    return None if best is None else KVSource(best[1], num_held + best[0])
