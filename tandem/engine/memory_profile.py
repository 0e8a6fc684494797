"""The KV pool sized by ``gpu_memory_utilization``: the weights and the peak of one
full-budget step measured on the device, the decode CUDA graphs' memory estimated, then the
pool gets the rest of the budget (tandem/kvcache/memory_plan.py)."""

from __future__ import annotations

import dataclasses

import torch

from tandem.config import EngineConfig
from tandem.engine.cuda_graphs import planned_graph_bytes
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kvcache.memory_plan import DeviceMemoryPlan, estimated_step_peak_bytes
from tandem.model.llama import LlamaModel
from tandem.model.loader import LoadedModel
from tandem.sampling_params import SamplingParams


def measured_memory_plan(loaded: LoadedModel, config: EngineConfig, utilization: float) -> DeviceMemoryPlan:
    """The plan for ``config``'s CUDA device, ``loaded`` being on it already (and nothing else
    of this engine yet), or whole on the host at tensor_parallel_size > 1."""
    device, tp = config.device, config.tensor_parallel_size
    torch.cuda.synchronize(device)
    _, total = torch.cuda.mem_get_info(device)
    block_bytes = config.block_size * config.model.kv_bytes_per_token(config.kv_cache_dtype_name, tp)
    if tp > 1:  # the weights are still whole, on the host: a rank's share from the shapes, as tandem plan does
        num_tokens = min(config.max_num_batched_tokens, config.max_model_len)
        peak = estimated_step_peak_bytes(config.model, num_tokens, config.max_num_seqs, config.dtype_bytes, tp)
        return DeviceMemoryPlan(total, utilization, -(-loaded.weights.num_bytes // tp), peak, block_bytes,
                                measured=False, graph_bytes=planned_graph_bytes(config))
    weight_bytes = torch.cuda.memory_allocated(device)
    # The decode graphs' memory estimated: they can be captured (and measured) only over the KV
    # pool this plan sizes; the capture logs what they took against this estimate.
    return DeviceMemoryPlan(total, utilization, weight_bytes, step_peak_bytes(loaded, config), block_bytes,
                            measured=True, graph_bytes=planned_graph_bytes(config))


def step_peak_bytes(loaded: LoadedModel, config: EngineConfig) -> int:
    """Device memory one prefill step of the whole token budget takes beyond what is
    allocated now, its own KV blocks left out (a throwaway engine's forward on token 0)."""
    device = config.device
    num_tokens = min(config.max_num_batched_tokens, config.max_model_len)
    num_blocks = -(-num_tokens // config.block_size)
    probe = dataclasses.replace(config, num_kv_blocks=num_blocks)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(probe, LlamaModel(loaded.config, loaded.weights, config.max_model_len), pad_decode=False)
    seq = Sequence("memory-profile", [0] * num_tokens, SamplingParams(max_tokens=1), 0)
    seq.block_ids = list(range(num_blocks))
    runner.forward(ScheduledBatch([seq], [num_tokens]), None, None)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - runner.kv_cache.nbytes
    del runner
    torch.cuda.empty_cache()
    return peak
