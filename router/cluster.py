"""Start and stop a tandem cluster on Ray: the worker actors and the backend over them."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray

from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend
from tandem.router.worker_host import start_worker
from tandem.worker_api import Role

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

    @property
    def num_workers(self) -> int:
        return self.colocated or self.num_prefill + self.num_decode


async def start_cluster(cfg: ClusterConfig) -> RayBackend:
    """Start the workers (each loads the model in its own process) and wait until all serve."""
    if not ray.is_initialized():
        cores = len(os.sched_getaffinity(0))
        # Workers are pinned to their share of cores; declare at least one CPU per worker.
        ray.init(address=cfg.address, num_cpus=None if cfg.address else max(cores, cfg.num_workers),
                 include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    cores = len(os.sched_getaffinity(0))
    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    args = dict(cfg.worker_args)
    args.setdefault("num_threads", max(1, cores // cfg.num_workers))
    roles = ([(Role.COLOCATED, cfg.colocated)] if cfg.colocated
             else [(Role.PREFILL, cfg.num_prefill), (Role.DECODE, cfg.num_decode)])
    states: dict[Role, list[WorkerState]] = {Role.PREFILL: [], Role.DECODE: [], Role.COLOCATED: []}
    for role, count in roles:
        for i in range(count):
            instance = f"{cfg.name_prefix}{role.value}-{i}"
            handle = start_worker(role, instance, num_cpus=1, num_gpus=1 if has_gpu else 0,
                                  pool_resources=cfg.pool_resources, **args)
            states[role].append(WorkerState(instance, handle))
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
        ray.kill(w.handle, no_restart=True)
