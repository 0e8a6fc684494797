"""Start and stop a tandem cluster on Ray: the worker actors and the backend over them."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import remove_placement_group

from tandem.config import WorkerConfig
from tandem.kvtransfer.curve import CurveKeys
from tandem.router.delta_inbox import LOOPBACK, DeltaInbox
from tandem.router.disagg import DEFAULT_MAX_LOCAL_STALL_S
from tandem.router.placement import (
    GPU,
    Placement,
    Pool,
    check_memory_share,
    gpus_per_rank,
    local_resources,
    worker_device,
)
from tandem.router.placement_wait import wait_placeable, wait_ready
from tandem.router.policy import WorkerState
from tandem.router.pool_changes import PoolChanges
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
    disagg_policy: str = "auto"
    """Where each prompt is prefilled in a disaggregated cluster (router/disagg.py)."""
    max_local_stall_s: float = DEFAULT_MAX_LOCAL_STALL_S
    """auto's bound on what a local prefill adds to a decode worker's running streams."""
    address: str | None = None
    """An existing Ray cluster to join; None starts a local one."""
    worker: WorkerConfig = WorkerConfig()
    """Every worker's model, engine and KV transfer settings (start_cluster sets, per pool, the
    threads, device and tensor-parallel size it works out on a copy)."""
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
    gpus_per_worker: float | None = None
    """GPUs Ray reserves for each rank of each worker (a fraction shares one GPU); None:
    decided from the device and the cluster's GPUs (see placement.gpus_per_rank)."""
    placement_timeout_s: float = 60.0
    """How long Ray may take to find room for every worker before the start is refused."""
    start_timeout_s: float = 600.0
    """How long the placed workers may take to load the model before the start is refused."""
    log_level: str = "WARNING"
    """The workers' log level (Ray's logging config carries it to every actor of this job;
    their lines reach the driver's console)."""

    @property
    def num_workers(self) -> int:
        return self.colocated or self.num_prefill + self.num_decode

    @property
    def num_ranks(self) -> int:
        """Processes the workers run (each of a worker's tensor-parallel ranks is one)."""
        if self.colocated:
            return self.colocated * self.decode_tp
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def device(self) -> str:
        """The workers' engine device, as configured (auto unless given)."""
        return self.worker.device

    def placement(self, cluster_gpus: float) -> Placement:
        """Every worker's Ray resources on a cluster with ``cluster_gpus`` GPUs; PlacementError
        (a ValueError) for a device or GPU share that cannot work."""
        pools = ((Pool(Role.COLOCATED.value, self.colocated, self.decode_tp),) if self.colocated else
                 (Pool(Role.PREFILL.value, self.num_prefill, self.prefill_tp),
                  Pool(Role.DECODE.value, self.num_decode, self.decode_tp)))
        for pool in pools:
            if pool.tp < 1:
                raise ValueError(f"the {pool.role} workers' tensor-parallel size must be >= 1, got {pool.tp}")
        gpus = gpus_per_rank(self.gpus_per_worker, self.device, cluster_gpus, self.num_ranks,
                             max(p.tp for p in pools))
        check_memory_share(self.worker, gpus)
        return Placement(pools, self.num_cpus_per_rank, gpus, self.pool_resources)

    def check_fits(self, have: dict[str, float], where: str) -> Placement:
        """The placement on ``have`` (``where``'s resources), refused unless it fits."""
        placement = self.placement(have.get(GPU, 0.0))
        placement.check_fits(have, where, self.device)
        return placement


async def start_cluster(cfg: ClusterConfig) -> RayBackend:
    """Start the workers (each loads the model in its own process) and wait until all serve."""
    if not ray.is_initialized():
        local = None if cfg.address else local_resources(cfg.num_ranks)
        if local is not None:  # what this host can never hold is refused in a second, before Ray starts
            cfg.check_fits(local, "this host")
        cores = len(os.sched_getaffinity(0))
        # Workers are pinned to their share of cores; declare at least one CPU per worker.
        ray.init(address=cfg.address, num_cpus=None if cfg.address else max(cores, cfg.num_ranks),
                 include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                 logging_config=ray.LoggingConfig(encoding="TEXT", log_level=cfg.log_level.upper()))
    cores = len(os.sched_getaffinity(0))
    placement = cfg.check_fits(ray.cluster_resources(), "the cluster")
    if placement.needs_beyond(ray.available_resources()):
        logger.warning("the cluster's free resources do not hold every worker now: waiting up to %g s for them",
                       cfg.placement_timeout_s)
    await wait_placeable(placement, cfg.placement_timeout_s)
    if placement.gpus_per_rank:
        logger.info("each worker rank reserves %g GPU", placement.gpus_per_rank)
    worker = dataclasses.replace(cfg.worker, device=worker_device(cfg.device, placement.gpus_per_rank),
                                 num_threads=cfg.worker.num_threads or max(1, cores // cfg.num_ranks),
                                 publish_kv_events=cfg.policy == "precise_prefix")
    roles = ([(Role.COLOCATED, cfg.colocated)] if cfg.colocated
             else [(Role.PREFILL, cfg.num_prefill), (Role.DECODE, cfg.num_decode)])
    resources = dict(num_cpus=cfg.num_cpus_per_rank, num_gpus=placement.gpus_per_rank)

    def start_one(role: Role, instance: str) -> WorkerState:
        tp = cfg.prefill_tp if role is Role.PREFILL else cfg.decode_tp
        group = worker_placement_group(role, tp, pool_resources=cfg.pool_resources, **resources) if tp > 1 else None
        pool_worker = worker.with_engine(tensor_parallel_size=tp) if tp > 1 else worker
        handle = start_worker(role, instance, pool_worker, pool_resources=cfg.pool_resources,
                              placement_group=group, **resources)
        return WorkerState(instance, handle, placement_group=group)

    states: dict[Role, list[WorkerState]] = {Role.PREFILL: [], Role.DECODE: [], Role.COLOCATED: []}
    for role, count in roles:
        states[role] = [start_one(role, f"{cfg.name_prefix}{role.value}-{i}") for i in range(count)]
    everyone = [w for ws in states.values() for w in ws]
    logger.info("starting %d workers (each loads the model)...", len(everyone))
    try:
        await wait_ready({w.instance: w.handle for w in everyone}, cfg.start_timeout_s)
    except BaseException:
        _stop_workers(everyone)  # none left pending or half-loaded behind the error
        raise
    spec = await (states[Role.DECODE] or states[Role.COLOCATED])[0].handle.tokenizer_spec.remote()
    backend = RayBackend(states[Role.PREFILL], states[Role.DECODE], states[Role.COLOCATED], cfg.policy, spec,
                         disagg_policy=cfg.disagg_policy, max_local_stall_s=cfg.max_local_stall_s)
    backend.pool_changes = PoolChanges(backend, start_one, cfg.name_prefix)
    # Workers on other hosts reach the router's inbox at its Ray node's address.
    backend.streams.inbox = DeltaInbox(ray.util.get_node_ip_address() if cfg.address else LOOPBACK,
                                       CurveKeys.from_env())
    await backend.loads()
    logger.info("cluster ready: %s", ", ".join(w.instance for w in everyone))
    return backend


def stop_cluster(backend: RayBackend) -> None:
    _stop_workers(backend.workers)


def _stop_workers(workers: list[WorkerState]) -> None:
    for w in workers:
        ray.kill(w.handle, no_restart=True)  # its other tensor-parallel ranks go with it (owned actors)
        if w.placement_group is not None:
            remove_placement_group(w.placement_group)
