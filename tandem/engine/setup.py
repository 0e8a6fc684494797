"""From loaded weights to what an engine runs with: its frozen config and its weights on
its device. One way for ``LLM(...)`` and every worker."""

from __future__ import annotations

import logging
from typing import Any

from tandem.config import EngineConfig
from tandem.config.engine_options import ENGINE_DEFAULTS as DEFAULTS
from tandem.model.gguf_format import resolve_quantization
from tandem.model.loader import LoadedModel, on_device, quantized
from tandem.model.source import ModelSource

logger = logging.getLogger(__name__)


def engine_config_and_weights(loaded: LoadedModel, engine_args: dict[str, Any],
                              source: ModelSource | None = None) -> tuple[EngineConfig, LoadedModel]:
    """-> (the config built from ``engine_args``, ``loaded`` quantized as it says and on its
    device). ``quantization`` auto keeps the source's own format (model/gguf_format.py).
    With ``gpu_memory_utilization`` the pool is sized by a measurement on the device
    (engine/memory_profile.py) instead of ``kv_cache_memory_gib``.

    source: the files ``loaded`` came from (see loader.quantized)."""
    engine_args = dict(engine_args)
    utilization = engine_args.pop("gpu_memory_utilization", None)
    engine_args["quantization"] = resolve_quantization(engine_args.get("quantization", DEFAULTS["quantization"]),
                                                       source)
    config = EngineConfig.build(loaded.config, **engine_args)
    if utilization is not None and config.device.type != "cuda":
        raise ValueError(f"gpu_memory_utilization sizes a GPU's KV pool; the engine runs on {config.device_name}: "
                         "give kv_cache_memory_gib (--kv-cache-memory-gib) instead")
    loaded = quantized(loaded, config.quantization, source)
    if config.tensor_parallel_size == 1:  # tensor-parallel ranks each put their own shard on their device
        loaded = on_device(loaded, config)
    if utilization is not None and engine_args.get("num_kv_blocks") is None:
        from tandem.engine.memory_profile import measured_memory_plan

        plan = measured_memory_plan(loaded, config, utilization)  # (estimated at tp > 1: the ranks are not up yet)
        for line in plan.lines():
            logger.info("%s", line)
        config = EngineConfig.build(loaded.config, **dict(engine_args, num_kv_blocks=plan.num_blocks))
    return config, loaded
