"""The other ranks of a tensor-parallel worker: Ray actors placed beside the first rank (one
placement-group bundle per device), joined to it in two torch.distributed groups: the
device group (NCCL between GPUs, gloo between CPUs) for the forward's all-reduces and KV
gathers on device tensors, and a gloo group for the step messages on host tensors, as vLLM
keeps its metadata off NCCL. Each rank executes the first rank's messages until it stops them."""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass
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
from tandem.parallel.executor import DeviceCollectives, RankExecutor, rank_model
from tandem.parallel.step_message import StepMessage, StepOp, broadcast_step, receive_step
from tandem.parallel.world import world_backend
from tandem.worker.step_priority import actor_runtime_env

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0
"""How long a collective waits for a rank: joining (every rank loads the model first), and
each step afterwards (a rank that is gone fails the worker instead of wedging it)."""


@dataclass(frozen=True)
class RankGroups:
    """A rank's two process groups (every rank of the worker is in both)."""

    collectives: DeviceCollectives
    """The forward's all-reduces and KV gathers, on the device group (device tensors)."""
    step_group: dist.ProcessGroup
    """gloo: the step messages rank 0 broadcasts (host tensors)."""


def rank_device(device_name: str, rank: int) -> torch.device:
    """The device of a rank whose worker runs on ``device_name`` (cpu, cuda or cuda:N): the
    CPU; or the GPU Ray gave this actor, which CUDA_VISIBLE_DEVICES then holds alone, so
    ``cuda:0``; or, where Ray gave it none (a process outside Ray), the local rank's GPU."""
    device = torch.device(device_name)
    if device.type != "cuda":
        return device
    if ray.is_initialized() and ray.get_gpu_ids():
        return torch.device("cuda", 0)
    return torch.device("cuda", rank)


def join_groups(init_method: str, rank: int, tp: int, device: torch.device) -> RankGroups:
    """Join the worker's ranks at ``init_method`` as ``rank`` on ``device``: the device
    group is the default group, the step group a gloo group beside it.

    NOTE: the step group is a group of its own on the CPU too, where the device group is
    gloo as well: the ranks then run the very topology they run on GPUs, and the backend
    (with binding the rank to its GPU) is all that differs."""
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    backend = world_backend(device)
    backend.bind(device)
    dist.init_process_group(backend.name, init_method=init_method, rank=rank, world_size=tp, timeout=timeout)
    step_group = dist.new_group(backend="gloo", timeout=timeout)
    return RankGroups(DeviceCollectives(dist.group.WORLD), step_group)


class RankProcess:
    """Rank ``rank`` (>= 1) of a tensor-parallel worker, in its own process."""

    def __init__(self, rank: int, tp: int, init_method: str, model: str | None, engine_args: dict[str, Any],
                 num_threads: int | None, revision: str | None = None) -> None:
        """engine_args: the first rank's EngineConfig.build arguments, pool sizes and device
        name included, so that every rank holds the same blocks (on its own device)."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        device = rank_device(engine_args.get("device", "cpu"), rank)
        engine_args = {**engine_args, "device": str(device)}
        source = resolve_model_source(model, revision)
        loaded = load_model(source, DTYPES[engine_args["dtype"]])
        config = EngineConfig.build(loaded.config, **engine_args)
        self.groups = join_groups(init_method, rank, tp, device)
        part = rank_model(quantized(loaded, config.quantization, source), tp, rank, config.max_model_len,
                          self.groups.collectives, device)
        del loaded  # the projections are copied into the part: the whole model's go
        runner = ModelRunner(config, part)
        self.executor = RankExecutor(part, runner.kv_cache, runner.swapper, tp, rank, self.groups.collectives)
        self.rank = rank

    def serve(self) -> int:
        """Execute messages until STOP. -> how many were executed."""
        num_executed = 0
        try:
            while True:
                msg = receive_step(self.groups.step_group)
                if msg.op is StepOp.STOP:
                    return num_executed
                self.executor.execute(msg)
                num_executed += 1
        finally:
            dist.destroy_process_group()


class RankGroup:
    """Starts ranks 1 .. tp-1 and joins them as rank 0 (the calling process)."""

    def __init__(self, tp: int, model: str | None, engine_args: dict[str, Any], num_threads: int | None,
                 placement_group_: PlacementGroup | None = None, revision: str | None = None,
                 num_cpus: float = 1.0) -> None:
        """placement_group_: the worker's, with one bundle per rank, bundle 0 its own; None:
        a group of tp - 1 bundles is made here for ranks 1 .. tp-1 (removed by stop)."""
        if not ray.is_initialized():  # the LLM API on its own: a local Ray
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        with socket.socket() as s:  # NOTE: loopback: the placement group keeps every rank on this node
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        device = torch.device(engine_args.get("device", "cpu"))  # this process's: rank 0's
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._own_group = placement_group_ is None
        if placement_group_ is None:
            # NOTE: a GPU per rank on CUDA: Ray hides every GPU from an actor that reserved none.
            bundle = {"CPU": num_cpus, **({"GPU": 1} if device.type == "cuda" else {})}
            placement_group_ = placement_group([bundle] * (tp - 1), strategy="STRICT_PACK")
        self.placement_group = placement_group_
        first_bundle = 0 if self._own_group else 1
        actor = ray.remote(RankProcess)
        # Handles of RankProcess actors: Any, since ray's types give their methods no .remote.
        self.actors: list[Any] = []
        for rank in range(1, tp):
            index = first_bundle + rank - 1
            bundle = placement_group_.bundle_specs[index]
            self.actors.append(actor.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), runtime_env=actor_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group_,
                                                                     placement_group_bundle_index=index),
            ).remote(rank, tp, init_method, model, engine_args, num_threads, revision))
        logger.info("joining %d more tensor-parallel ranks at %s (each loads the model)", tp - 1, init_method)
        self.device = device
        """Rank 0's device (config.device, with its index)."""
        self.groups = join_groups(init_method, 0, tp, device)
        self._serving = [a.serve.remote() for a in self.actors]

    def stop(self) -> None:
        """Stop the ranks (after the last step) and leave the groups."""
        try:
            broadcast_step(StepMessage(StepOp.STOP), self.groups.step_group)
            ray.get(self._serving, timeout=30)
        finally:
            dist.destroy_process_group()
            for a in self.actors:
                ray.kill(a, no_restart=True)
            if self._own_group:
                remove_placement_group(self.placement_group)
