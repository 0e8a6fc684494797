"""Start and stop a tandem cluster on Ray: the worker actors and the backend over them."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend
from tandem.worker.api import Role
from tandem.worker.host import start_worker, worker_placement_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    colocated: int = 0
    """Colocated workers instead of the two pools (0: disaggregated)."""
    policy: str = "least_loaded"
    address: str | None = None
    """An existing Ray cluster to join; None starts a local one."""
    worker_args: dict[str, Any] = field(default_factory=dict)
    """Model and engine arguments of every worker (model, dtype, kv_cache_memory_gib, ...)."""
    name_prefix: str = ""
    """Prefixed to actor names, so that two clusters can share one Ray."""
    pool_resources: bool = False
    """Each worker asks Ray for its pool's custom resource (worker_host.pool_resource), so
    that it lands on a node started for that pool."""
    prefill_tp: int = 1
    """Tensor-parallel ranks per prefill worker (one CPU, or GPU, each)."""
    decode_tp: int = 1
    """Tensor-parallel ranks per decode (or colocated) worker."""
    num_cpus_per_rank: float = 1.0
    """CPUs Ray reserves for each rank of each worker."""

    @property
    def num_workers(self) -> int:
        return self.colocated or self.num_prefill + self.num_decode

    @property
    def num_ranks(self) -> int:
        """Processes the workers run (each of a worker's tensor-parallel ranks is one)."""
        if self.colocated:
            return self.colocated * self.decode_tp
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp


async def start_cluster(cfg: ClusterConfig) -> RayBackend:
    """Start the workers (each loads the model in its own process) and wait until all serve."""
    if not ray.is_initialized():
        cores = len(os.sched_getaffinity(0))
        # Workers are pinned to their share of cores; declare at least one CPU per worker.
        ray.init(address=cfg.address, num_cpus=None if cfg.address else max(cores, cfg.num_ranks),
                 include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    cores = len(os.sched_getaffinity(0))
    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    args = dict(cfg.worker_args)
    args.setdefault("num_threads", max(1, cores // cfg.num_ranks))
    roles = ([(Role.COLOCATED, cfg.colocated)] if cfg.colocated
             else [(Role.PREFILL, cfg.num_prefill), (Role.DECODE, cfg.num_decode)])
    states: dict[Role, list[WorkerState]] = {Role.PREFILL: [], Role.DECODE: [], Role.COLOCATED: []}
    for role, count in roles:
        tp = cfg.prefill_tp if role is Role.PREFILL else cfg.decode_tp
        if tp < 1:
            raise ValueError(f"the {role.value} workers' tensor-parallel size must be >= 1, got {tp}")
        resources = dict(num_cpus=cfg.num_cpus_per_rank, num_gpus=1 if has_gpu else 0)
        for i in range(count):
            instance = f"{cfg.name_prefix}{role.value}-{i}"
            group = worker_placement_group(role, tp, pool_resources=cfg.pool_resources, **resources) if tp > 1 else None
            handle = start_worker(role, instance, pool_resources=cfg.pool_resources, placement_group=group,
                                  **resources, **args, **({"tensor_parallel_size": tp} if tp > 1 else {}))
            states[role].append(WorkerState(instance, handle, placement_group=group))
    everyone = [w for ws in states.values() for w in ws]
    logger.info("starting %d workers (each loads the model)...", len(everyone))
    await asyncio.gather(*(w.handle.is_ready.remote() for w in everyone))
    spec = await (states[Role.DECODE] or states[Role.COLOCATED])[0].handle.tokenizer_spec.remote()
    backend = RayBackend(states[Role.PREFILL], states[Role.DECODE], states[Role.COLOCATED], cfg.policy, spec)
    await backend.loads()
    logger.info("cluster ready: %s", ", ".join(w.instance for w in everyone))
    return backend


def stop_cluster(backend: RayBackend) -> None:
    for w in backend.workers:
        ray.kill(w.handle, no_restart=True)  # its other tensor-parallel ranks go with it (owned actors)
        if w.placement_group is not None:
            remove_placement_group(w.placement_group)
