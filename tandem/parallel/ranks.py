"""The other ranks of a tensor-parallel worker: Ray actors placed beside the first rank (one
placement-group bundle per device), joined to it in a torch.distributed group (gloo on
CPUs), each executing the first rank's step messages until it stops them."""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.model.dtypes import DTYPES
from tandem.model.loader import load_model, quantized
from tandem.model.source import resolve_model_source
from tandem.parallel.executor import RankExecutor, rank_model
from tandem.parallel.step_message import StepMessage, StepOp, broadcast_step, receive_step

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0
"""How long a collective waits for a rank: joining (every rank loads the model first), and
each step afterwards (a rank that is gone fails the worker instead of wedging it)."""


def join_group(init_method: str, rank: int, tp: int) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


class RankProcess:
    """Rank ``rank`` (>= 1) of a tensor-parallel worker, in its own process."""

    def __init__(self, rank: int, tp: int, init_method: str, model: str | None, engine_args: dict[str, Any],
                 num_threads: int | None) -> None:
        """engine_args: the first rank's EngineConfig.build arguments, pool sizes included,
        so that every rank holds the same blocks."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        source = resolve_model_source(model)
        loaded = load_model(source, DTYPES[engine_args["dtype"]])
        config = EngineConfig.build(loaded.config, **engine_args)
        part = rank_model(quantized(loaded, config.quantization, source), tp, rank, config.max_model_len)
        del loaded  # the projections are copied into the part: the whole model's go
        runner = ModelRunner(config, part)
        self.executor = RankExecutor(part, runner.kv_cache, runner.swapper, tp, rank)
        self.row_shape = (config.model.num_kv_heads, config.model.head_dim)
        self.dtype = config.dtype
        self.rank = rank
        join_group(init_method, rank, tp)

    def serve(self) -> int:
        """Execute messages until STOP. -> how many were executed."""
        num_executed = 0
        try:
            while True:
                msg = receive_step(self.row_shape, self.dtype)
                if msg.op is StepOp.STOP:
                    return num_executed
                self.executor.execute(msg)
                num_executed += 1
        finally:
            dist.destroy_process_group()


class RankGroup:
    """Starts ranks 1 .. tp-1 and joins them as rank 0 (the calling process)."""

    def __init__(self, tp: int, model: str | None, engine_args: dict[str, Any], num_threads: int | None,
                 placement_group_: PlacementGroup | None = None, num_cpus: float = 1.0) -> None:
        """placement_group_: the worker's, with one bundle per rank, bundle 0 its own; None:
        a group of tp - 1 bundles is made here for ranks 1 .. tp-1 (removed by stop)."""
        if not ray.is_initialized():  # the LLM API on its own: a local Ray
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        with socket.socket() as s:  # NOTE: loopback: the placement group keeps every rank on this node
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self._own_group = placement_group_ is None
        if placement_group_ is None:
            placement_group_ = placement_group([{"CPU": num_cpus}] * (tp - 1), strategy="STRICT_PACK")
        self.placement_group = placement_group_
        first_bundle = 0 if self._own_group else 1
        actor = ray.remote(RankProcess)
        self.actors = []
        for rank in range(1, tp):
            index = first_bundle + rank - 1
            bundle = placement_group_.bundle_specs[index]
            self.actors.append(actor.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group_, placement_group_bundle_index=index),
            ).remote(rank, tp, init_method, model, engine_args, num_threads))
        logger.info("joining %d more tensor-parallel ranks at %s (each loads the model)", tp - 1, init_method)
        join_group(init_method, 0, tp)
        self._serving = [a.serve.remote() for a in self.actors]

    def stop(self) -> None:
        """Stop the ranks (after the last step) and leave the group."""
        try:
            broadcast_step(StepMessage(StepOp.STOP))
            ray.get(self._serving, timeout=30)
        finally:
            dist.destroy_process_group()
            for a in self.actors:
                ray.kill(a, no_restart=True)
            if self._own_group:
                remove_placement_group(self.placement_group)
