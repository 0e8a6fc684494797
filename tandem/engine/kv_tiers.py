"""The engine's KV tiers, built from its config: what its pool evicts goes there (see
tandem/kvcache/prefix_tier.py): host memory for an accelerator's pool, then the disk."""

from __future__ import annotations

import logging

import torch

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.kvcache.disk_tier import DiskTier, layout_key
from tandem.kvcache.host_tier import HostTier
from tandem.kvcache.prefix_tier import PrefixTier
from tandem.model.fingerprint import model_fingerprint
from tandem.model.llama import LlamaModel
from tandem.model.loaded import LoadedModel

logger = logging.getLogger(__name__)


def disk_tier_for(config: EngineConfig, model: LlamaModel, kv_cache: torch.Tensor) -> DiskTier:
    """The disk tier of ``config`` over pool ``kv_cache``. Its files are shared only with pools
    whose KV is interchangeable: the same weights to the byte (their fingerprint), KV dtype
    and block shape (every head: a tensor-parallel pool's tiers see whole blocks)."""
    assert config.kv_offload_dir is not None
    fingerprint = model_fingerprint(LoadedModel(config.model, model.weights, None))
    key = layout_key(fingerprint, config.kv_cache_dtype_name, tuple(kv_cache[:, :, 0].shape))
    tier = DiskTier(kv_cache, config.kv_offload_dir, config.kv_offload_disk_bytes, key)
    logger.info("KV disk tier: %s, %.2f GiB (%d blocks of %d KiB)", tier.directory,
                config.kv_offload_disk_bytes / 2**30, tier.capacity_blocks, tier.block_bytes // 1024)
    return tier


def tiers_for(config: EngineConfig, model: LlamaModel, runner: ModelRunner) -> PrefixTier | None:
    """The first of ``config``'s tiers over ``runner``'s pool (host, then disk), or None."""
    if config.kv_offload_dir is None and config.kv_offload_host_bytes == 0:
        return None  # NOTE: a runner standing in for the model (tests) may have no pool to read
    pool = runner.tier_pool()  # a tensor-parallel pool's: one block of every head
    disk = disk_tier_for(config, model, pool) if config.kv_offload_dir is not None else None
    first: PrefixTier | None = disk
    if config.kv_offload_host_bytes > 0:
        host = HostTier(pool, config.kv_offload_host_bytes, disk)
        logger.info("KV host tier: %.2f GiB (%d blocks)", config.kv_offload_host_bytes / 2**30, host.capacity_blocks)
        first = host
    assert first is not None
    return runner.attach_tier(first, pool)
