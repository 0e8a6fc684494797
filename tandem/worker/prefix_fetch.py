"""A worker's side of reuse across hosts (kvtransfer/tier_peer.py, kvtransfer/tier_fetch.py: over
the KV transfer layer): it serves its pool's cached blocks and its disk tier to the other
workers, and fetches the prefix blocks that a request's ``kv_source`` holds and it lacks into
its first tier (an accelerator pool's host tier, else the disk) before admitting the request,
so that its scheduler loads them (charged to its step budget like any tier hit) instead of
computing them."""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from tandem.config.kv_transfer_config import KVTransferConfig
from tandem.engine.engine import LLMEngine
from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.disk_tier import DiskTier
from tandem.kvcache.host_tier import HostTier
from tandem.kvcache.prefix_tier import PrefixTier, tiers_of
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.tier_fetch import PeerFetchCounters, TierFetcher
from tandem.kvtransfer.tier_peer import SenderSettings, TierServer
from tandem.parallel.rank_tier import RankTier
from tandem.parallel.runner import TensorParallelRunner
from tandem.worker.api import WorkerRequest
from tandem.worker.engine_loop import EngineLoop
from tandem.worker.kv_events_publisher import events_host

logger = logging.getLogger(__name__)

POOL_READ_TIMEOUT_S = 10.0
"""How long a peer's fetch waits for the engine loop to copy its pool's blocks (between steps)."""


def disk_tier_of(tier: PrefixTier | None) -> DiskTier | None:
    """The disk tier of a chain (a tensor-parallel pool's chain starts with a RankTier over it)."""
    for t in tiers_of(tier):
        inner = t.first if isinstance(t, RankTier) else t
        if isinstance(inner, DiskTier):
            return inner
    return None


class PrefixFetcher:
    """Serves the pool and disk tier of ``loop``'s engine (when ``serve``), and fetches into
    its host tier, or its disk tier when it has none, both over the KV transfer layer with the
    worker's settings (``kv_transfer``: where it listens, which data paths it may take)."""

    def __init__(self, loop: EngineLoop, kv_transfer: KVTransferConfig, serve: bool) -> None:
        engine = loop.engine
        self.loop = loop
        self.disk = disk_tier_of(engine.block_manager.tier)
        first = engine.block_manager.tier
        self.host = first if isinstance(first, HostTier) and self.disk is not None else None
        """Where fetched blocks go, ahead of the disk (None: to the disk)."""
        self.block_size = engine.config.block_size
        self.counters = PeerFetchCounters()
        host, curve = events_host(kv_transfer), CurveKeys.from_env()
        settings = SenderSettings(kv_transfer.transport, kv_transfer.node_id, kv_transfer.allow_unencrypted_pairs)
        # A tensor-parallel pool holds a share of each block's heads: only its tier is served.
        read_pool = None if isinstance(engine.runner, TensorParallelRunner) else (
            lambda hashes: loop.submit(lambda e: _pool_blocks(e, hashes)).result(POOL_READ_TIMEOUT_S))
        self.server = None if self.disk is None or not serve else TierServer(self.disk, host, curve, read_pool,
                                                                            settings)
        """None: no disk tier to serve, or nobody to serve it to (no KV events: no router index)."""
        self.fetcher = None if self.disk is None else TierFetcher(self.disk.kv_cache[:, :, 0], host, curve, settings)

    @property
    def address(self) -> str | None:
        return None if self.server is None else self.server.address

    async def fetch(self, request: WorkerRequest) -> int:
        """Fetch what ``request.kv_source`` holds of its prefix and this worker lacks -> the
        number of blocks fetched. A fetch that fails costs only the recompute."""
        source, disk = request.kv_source, self.disk
        if source is None or disk is None:
            return 0
        num_blocks = min(source.num_blocks, (len(request.prompt_token_ids) - 1) // self.block_size)
        hashes = await self.loop.call(lambda engine: _missing(engine, request, num_blocks))
        if not hashes:
            return 0
        started = time.perf_counter()
        # NOTE: off the engine loop: a slow peer delays only this request's admission.
        assert self.fetcher is not None  # (made with the disk tier)
        result = await asyncio.to_thread(self.fetcher.fetch, source.address, disk.key, hashes, request.request_id)
        blocks = list(zip(hashes, result.blocks))
        host = self.host
        if host is None:
            _keep_in(disk, blocks)  # (off the engine loop: queued writes)
        elif blocks:  # NOTE: on the loop thread: the host tier's slots are the engine's
            await self.loop.call(lambda engine: _keep_in(host, blocks))
        self.counters.fetched(result, disk.block_bytes, started)
        logger.debug("%s: fetched %d of %d prefix blocks from %s%s", request.request_id, len(blocks),
                     len(hashes), source.address, "" if result.error is None else f" ({result.error})")
        return len(blocks)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.fetcher is not None:
            self.fetcher.close()


def _keep_in(tier: PrefixTier, blocks: list[tuple[bytes, torch.Tensor]]) -> None:
    for block_hash, kv in blocks:
        tier.offload_copy(block_hash, kv)


def _pool_blocks(engine: LLMEngine, block_hashes: list[bytes]) -> dict[bytes, torch.Tensor]:
    """Copies of the leading ``block_hashes`` the pool caches, on its device (on the loop
    thread, between steps: the tier server stages them from there)."""
    bm, kv_cache = engine.block_manager, engine.runner.kv_cache
    blocks = {}
    for block_hash in block_hashes:
        block_id = bm.cached_block_ids.get(block_hash)
        if block_id is None:
            break
        blocks[block_hash] = kv_cache[:, :, block_id].clone()
    if kv_cache.is_cuda:  # NOTE: the tier server's thread copies them on a stream of its own
        torch.cuda.current_stream(kv_cache.device).synchronize()
    return blocks


def _missing(engine: LLMEngine, request: WorkerRequest, num_blocks: int) -> list[bytes]:
    """The hashes of the prompt's first ``num_blocks`` blocks from the first that neither the
    pool nor a tier holds (on the loop thread: the block manager is its own)."""
    hashes = prefix_hashes(request.prompt_token_ids, engine.config.block_size, num_blocks,
                           request.params.cache_salt)
    bm, tier = engine.block_manager, engine.block_manager.tier
    for i, block_hash in enumerate(hashes):
        if block_hash not in bm.cached_block_ids and not (tier is not None and tier.holds(block_hash)):
            return hashes[i:]
    return []
