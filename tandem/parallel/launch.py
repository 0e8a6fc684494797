"""An engine's model and runner: in this process alone, or as rank 0 of tensor-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.model_runner import KVAllocator, ModelRunner, private_pool
from tandem.model.llama import LlamaModel
from tandem.model.loader import LoadedModel
from tandem.model.placement import weights_on
from tandem.parallel.executor import rank_model
from tandem.parallel.ranks import RankGroup
from tandem.parallel.runner import TensorParallelRunner
from tandem.parallel.shard import rank_shards


@dataclass
class EngineModel:
    """What LLMEngine runs: ``model`` through ``runner``; ``ranks`` holds the other
    tensor-parallel ranks (None at tp=1), to stop when the engine goes."""

    model: LlamaModel
    runner: ModelRunner
    ranks: RankGroup | None


def start_engine_model(loaded: LoadedModel, config: EngineConfig, model: str | None, num_threads: int | None,
                       placement_group: Any = None, allocate_kv: KVAllocator = private_pool,
                       revision: str | None = None) -> EngineModel:
    """``loaded`` (quantized as config says) as this process's model, and with
    config.tensor_parallel_size > 1 the ranks beside it, which load ``model`` (at ``revision``) themselves
    (placed in ``placement_group``'s bundles 1.., see RankGroup). allocate_kv: where the
    KV pool lives at tp=1 (each rank of a tensor-parallel engine holds a private share).
    Weights go onto config.device here (none move where they are already); at tp > 1 give
    host weights: each rank's share is cut on the host, and only it goes to the rank's device."""
    tp = config.tensor_parallel_size
    if tp == 1:
        part = LlamaModel(loaded.config, weights_on(loaded.weights, config.device), config.max_model_len)
        return EngineModel(part, ModelRunner(config, part, allocate_kv), None)
    rank_shards(loaded.config, tp)  # refuses a tp the heads do not split by, before any rank starts
    rank_args = dict(device=config.device_name, dtype=config.dtype_name, kv_cache_dtype=config.kv_cache_dtype_name,
                     block_size=config.block_size,
                     num_kv_blocks=config.num_kv_blocks, num_swap_blocks=config.num_swap_blocks,
                     max_model_len=config.max_model_len, quantization=config.quantization, tensor_parallel_size=tp)
    ranks = RankGroup(tp, model, rank_args, num_threads, placement_group, revision)
    part = rank_model(loaded, tp, 0, config.max_model_len, ranks.groups.collectives, ranks.device)
    runner = TensorParallelRunner(config, part, ranks.groups.collectives, ranks.groups.step_group)
    return EngineModel(part, runner, ranks)
