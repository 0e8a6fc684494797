"""What the workers ask Ray for (CPUs, GPUs, pool resources), decided and checked against what
the cluster has before any worker starts: ``tandem serve`` refuses at once, naming what it
needs and what the cluster has, instead of leaving actors pending forever for resources that
do not exist. Torch-free: the router decides placement without loading a model.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.config import WorkerConfig

CPU, GPU = "CPU", "GPU"
GPU_SHARE_UNIT = 1e-4
"""Ray counts resources in units of 0.0001: a fractional share is rounded down to it."""
TOLERANCE = 1e-6


class PlacementError(ValueError):
    """The workers cannot be placed or started. A ValueError, so that the CLI prints it as
    ``tandem: error: ...`` and exits 2 (no traceback)."""


@dataclass(frozen=True)
class Pool:
    """``workers`` workers of one role, each with ``tp`` tensor-parallel ranks."""

    role: str
    """prefill, decode or colocated."""
    workers: int
    tp: int = 1

    @property
    def ranks(self) -> int:
        return self.workers * self.tp

    def describe(self) -> str:
        """e.g. "2 decode workers" or "1 prefill worker x 2 ranks"."""
        text = f"{self.workers} {self.role} worker{'s' if self.workers != 1 else ''}"
        return text + (f" x {self.tp} ranks" if self.tp > 1 else "")


def pool_resource(role: str) -> str:
    """The custom Ray resource a worker of ``role`` asks for with --pool-resources (the same
    name as tandem.worker.host.pool_resource's, which takes a Role)."""
    return f"tandem_{role}"


@dataclass(frozen=True)
class Placement:
    """The Ray resources of every rank of every worker: one bundle per rank, the worker's
    pool resource (with --pool-resources) on its first rank only."""

    pools: tuple[Pool, ...]
    cpus_per_rank: float
    gpus_per_rank: float
    pool_resources: bool = False

    @property
    def num_ranks(self) -> int:
        return sum(p.ranks for p in self.pools)

    def bundles(self) -> list[dict[str, float]]:
        """Every rank's resources, as Ray placement-group bundles (zero amounts left out)."""
        rank = {name: quantity for name, quantity in ((CPU, self.cpus_per_rank), (GPU, self.gpus_per_rank))
                if quantity}
        out: list[dict[str, float]] = []
        for pool in self.pools:
            first = {**rank, **({pool_resource(pool.role): 1.0} if self.pool_resources else {})}
            out.extend(([first] + [rank] * (pool.tp - 1)) * pool.workers)
        return out

    def needs(self) -> dict[str, float]:
        """The total of each resource over all bundles."""
        total: dict[str, float] = {}
        for bundle in self.bundles():
            for name, quantity in bundle.items():
                total[name] = total.get(name, 0.0) + quantity
        return total

    def explain(self, resource: str) -> str:
        """e.g. "2 GPUs (1 prefill worker + 1 decode worker, 1 GPU each)"."""
        total = self.needs().get(resource, 0.0)
        if resource in (CPU, GPU):
            per = self.cpus_per_rank if resource == CPU else self.gpus_per_rank
            pools = [p for p in self.pools if p.workers]
            each = "per rank" if any(p.tp > 1 for p in pools) else "each"
            workers = " + ".join(p.describe() for p in pools)
            return f"{amount(total, resource)} ({workers}, {amount(per, resource)} {each})"
        pools = [p for p in self.pools if pool_resource(p.role) == resource]
        return f"{total:g} {resource} ({' + '.join(p.describe() for p in pools)}, 1 each)"

    def check_fits(self, have: Mapping[str, float], where: str, device: str = "auto") -> None:
        """Refuse (PlacementError) when ``have`` (``where``'s total resources, e.g. "the
        cluster") lacks anything the workers need: they would wait for it forever."""
        short = self.needs_beyond(have)
        if not short:
            return
        lines = [f"needs {self.explain(name)}; {where} has {amount(have.get(name, 0.0), name)}" for name in short]
        hints = []
        if GPU in short:
            hints.append("--device cpu runs the workers on the CPU" if device != "cpu" else "")
            if any(p.tp > 1 for p in self.pools):
                hints.append("tensor parallelism needs a whole GPU per rank")
            elif self.gpus_per_rank >= 1 and have.get(GPU, 0.0) > 0:
                hints.append("--gpus-per-worker 0.5 puts two workers on each GPU")
        custom = [name for name in short if name not in (CPU, GPU)]
        if custom:
            hints.append(f"start a node per worker with `ray start --resources '{{\"{custom[0]}\": 1}}'` (and so on), "
                         "or serve without --pool-resources")
        hint = "; ".join(h for h in hints if h)
        raise PlacementError(f"tandem serve cannot place its workers: {'; '.join(lines)}"
                             + (f" ({hint})" if hint else ""))

    def needs_beyond(self, have: Mapping[str, float]) -> list[str]:
        """The resources the workers need more of than ``have`` holds."""
        return [name for name, quantity in self.needs().items() if quantity > have.get(name, 0.0) + TOLERANCE]


def amount(value: float, resource: str) -> str:
    """e.g. "2 GPUs", "0.5 GPUs", "1 CPU"."""
    return f"{value:g} {resource}{'s' if value != 1 and resource in (CPU, GPU) else ''}"


def device_kind(device: str) -> str:
    """``auto``, ``cpu`` or ``cuda`` for an engine device name; PlacementError for ``cuda:N``
    with N > 0: Ray shows each worker only the GPU it reserved, as ``cuda:0``."""
    kind, _, index = device.partition(":")
    if kind == "cuda" and index not in ("", "0"):
        raise PlacementError(f"--device {device}: under tandem serve each worker sees only the GPU Ray reserved "
                             "for it (as cuda:0); use --device cuda")
    return kind


def gpus_per_rank(requested: float | None, device: str, cluster_gpus: float, num_ranks: int,
                  max_tp: int = 1) -> float:
    """The GPUs Ray reserves for each rank of each worker.

    requested: --gpus-per-worker (None: decide). Decided: 0 on the CPU (``--device cpu``, or
    ``auto`` on a cluster without GPUs); with ``cuda`` (or ``auto`` and GPUs) a whole GPU per
    rank when the cluster has one for each, else an equal share of one (1 / ranks per GPU),
    so that the default 1 prefill + 1 decode runs on a one-GPU host at 0.5 GPU each. With
    ``cuda`` and no GPU in the cluster: 1 each, which check_fits then refuses by name."""
    kind = device_kind(device)
    if requested is not None:
        if requested < 0 or (requested > 1 and requested != int(requested)):
            raise PlacementError(f"--gpus-per-worker must be a fraction in (0, 1] or a whole number, got {requested:g}")
        if 0 < requested < GPU_SHARE_UNIT:
            raise PlacementError(f"--gpus-per-worker {requested:g} is below Ray's unit of {GPU_SHARE_UNIT:g}")
        if requested > 1:
            raise PlacementError(f"--gpus-per-worker {requested:g}: a worker rank runs on one GPU; "
                                 "use --prefill-tp/--decode-tp to spread a worker over more")
        if kind == "cpu" and requested > 0:
            raise PlacementError(f"--device cpu with --gpus-per-worker {requested:g}: the workers would reserve "
                                 "GPUs they never use")
        if kind == "cuda" and requested == 0:
            raise PlacementError(f"--device {device} with --gpus-per-worker 0: the workers would see no GPU")
        if 0 < requested < 1 and max_tp > 1:
            raise PlacementError(f"--gpus-per-worker {requested:g} with tensor parallelism: NCCL needs a whole "
                                 "GPU per rank")
        return float(requested)
    if kind == "cpu" or (kind == "auto" and cluster_gpus <= 0):
        return 0.0
    gpus = math.floor(cluster_gpus + TOLERANCE)
    if gpus >= num_ranks or gpus == 0 or max_tp > 1:
        return 1.0
    share = 1.0 / math.ceil(num_ranks / gpus)  # each GPU holds ceil(ranks / GPUs) ranks
    return math.floor(share / GPU_SHARE_UNIT) * GPU_SHARE_UNIT


def worker_device(device: str, gpus: float) -> str:
    """The device the workers are told: ``auto`` becomes ``cpu`` where they reserve no GPU,
    because Ray (2.60) leaves CUDA_VISIBLE_DEVICES alone for an actor with num_gpus=0: it
    would see, and auto would take, every GPU of its node, reserved by others or not."""
    return "cpu" if gpus == 0 and device_kind(device) == "auto" else device


def check_memory_share(worker: WorkerConfig, gpus: float) -> None:
    """Workers sharing a GPU (a fractional share) must not each ask for more of its memory
    than their share: --gpu-memory-utilization is each worker's fraction of the GPU."""
    utilization = worker.engine.get("gpu_memory_utilization")
    if utilization is not None and 0 < gpus < 1 and utilization > gpus + TOLERANCE:
        raise PlacementError(
            f"--gpu-memory-utilization {utilization:g} is more than each worker's share of its GPU ({gpus:g}, "
            f"--gpus-per-worker): the workers on one GPU would ask for more memory than it has; use at most "
            f"{gpus:g} (e.g. {gpus * 0.9:.2g})")


def local_resources(num_ranks: int) -> dict[str, float] | None:
    """What a local Ray started for ``num_ranks`` ranks will have (CPUs: at least one per
    rank, as start_cluster declares; GPUs: what Ray itself detects), known in a fraction of
    a second, before Ray starts; None when Ray's detector is not available."""
    try:  # Ray's own detector (private API): the same count ray.init would find
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource(GPU)
        if manager is None:  # no detector for GPUs in this Ray
            return None
        gpus = manager.get_current_node_num_accelerators()
        visible = manager.get_current_process_visible_accelerator_ids()
    except Exception:  # noqa: BLE001 - another Ray version: Ray's own start tells
        return None
    if visible is not None:
        gpus = min(gpus, len(visible))
    return {CPU: float(max(len(os.sched_getaffinity(0)), num_ranks)), GPU: float(gpus)}


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """``tandem serve``'s flags for where the workers run and how long their start may take."""
    parser.add_argument("--gpus-per-worker", type=float, default=None, metavar="N",
                        help="GPUs Ray reserves for each worker (each tensor-parallel rank): 1, or a fraction to "
                             "share one GPU, e.g. 0.5 puts a prefill and a decode worker on one GPU (give each its "
                             "--gpu-memory-utilization, at most its share). Default: 0 on the CPU (--device cpu, "
                             "or auto on a cluster without GPUs); else 1 when the cluster has a GPU per rank, "
                             "otherwise an equal share (the default 1 prefill + 1 decode on one GPU: 0.5 each)")
    parser.add_argument("--placement-timeout", type=float, default=60.0, metavar="S",
                        help="seconds Ray may take to find room for every worker before serve gives up "
                             "(default %(default)g); resources the cluster does not have at all are refused at once")
    parser.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                        help="seconds the placed workers may take to load the model (default %(default)g)")


def placement_options(args: argparse.Namespace) -> dict[str, Any]:
    """ClusterConfig's placement keywords from add_placement_args' flags."""
    for flag, value in (("--placement-timeout", args.placement_timeout), ("--start-timeout", args.start_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value:g}")
    return dict(gpus_per_worker=args.gpus_per_worker, placement_timeout_s=args.placement_timeout,
                start_timeout_s=args.start_timeout)
