"""Changing a serving cluster's pools: draining a worker out (no new requests; those it holds
finish, or move to another worker at the drain's end: router/migration.py; then it exits for
good), adding a worker (it joins routing once it has loaded the model), scaling a pool to a
size by doing either, and replacing workers (a new one added, then the old one drained: a
rolling restart, or a node taken down by Kubernetes' preStop hook). Nothing a client sent
fails: a drained worker's streams go on elsewhere, and a drain that would leave its pool
without a worker is refused."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.placement_group import remove_placement_group

from tandem.router.placement_wait import wait_ready
from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend
from tandem.worker.api import Role

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 60.0
_POLL_S = 0.2
START_TIMEOUT_S = 600.0

StartWorker = Callable[[Role, str], WorkerState]
"""Starts one worker actor of a role under a name (cluster.py's, with the cluster's settings)."""


@dataclass(frozen=True)
class DrainResult:
    """What one drain did."""

    instance: str
    num_at_start: int
    """Requests the worker held when the drain began."""
    num_moved: int
    """Of them, those still there at the drain's timeout: moved to other workers."""
    seconds: float


class PoolChanges:
    """Drain, add and scale the workers of one RayBackend (one change at a time)."""

    def __init__(self, backend: RayBackend, start_worker: StartWorker | None, name_prefix: str = "") -> None:
        """start_worker: None where workers cannot be added (a backend over given actors)."""
        self.backend = backend
        self.start_worker = start_worker
        self.name_prefix = name_prefix
        self._lock = asyncio.Lock()
        self._numbers = itertools.count(len(backend.workers))

    def pool(self, role: Role) -> list[WorkerState]:
        return {Role.PREFILL: self.backend.prefill, Role.DECODE: self.backend.decode,
                Role.COLOCATED: self.backend.colocated}[role]

    def roles(self) -> list[Role]:
        """The pools this cluster has."""
        return [Role.COLOCATED] if self.backend.colocated else [Role.PREFILL, Role.DECODE]

    def describe(self) -> list[dict[str, object]]:
        """Every worker: its pool, name, whether it is healthy and whether it is draining."""
        return [{"role": role.value, "instance": w.instance, "healthy": w.healthy, "draining": w.draining}
                for role in self.roles() for w in self.pool(role)]

    async def drain(self, instance: str, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> DrainResult:
        """Take ``instance`` out: route nothing more to it, let what it holds finish for up to
        timeout_s, move the rest (their streams go on elsewhere), then end it for good.
        ValueError for an unknown worker, or one whose pool would be left without a worker."""
        async with self._lock:
            return await self._drain(instance, timeout_s)

    async def _drain(self, instance: str, timeout_s: float) -> DrainResult:
        role, w = self._find(instance)
        pool = self.pool(role)
        if not any(other.routable for other in pool if other is not w):
            raise ValueError(f"draining {instance} would leave the {role.value} pool without a worker: add one first")
        start = time.monotonic()
        w.draining = True
        logger.warning("draining %s: no new requests; those it holds have %.0f s to finish", instance, timeout_s)
        num_at_start = held = await self._num_held(w)
        while held and time.monotonic() - start < timeout_s:
            await asyncio.sleep(_POLL_S)
            held = await self._num_held(w)
        # NOTE: marked down, every wait on it ends at once: its streams move (router/migration.py)
        self.backend.mark_unhealthy(w, "is drained")
        while await self._num_held(w) and time.monotonic() - start < timeout_s + 10:
            await asyncio.sleep(_POLL_S)  # the moved requests' aborts land
        self._remove(role, w)
        self._count(role, "drained")
        logger.warning("drained %s in %.1f s: %d requests finished there, %d moved", instance,
                       time.monotonic() - start, num_at_start - held, held)
        return DrainResult(instance, num_at_start, held, time.monotonic() - start)

    async def replace(self, instance: str, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> list[str]:
        """A new worker in ``instance``'s pool (once it serves), then ``instance`` drained.
        -> what it did, e.g. ["added decode-3", "drained decode-0"]."""
        async with self._lock:
            return await self._replace(instance, drain_timeout_s)

    async def _replace(self, instance: str, drain_timeout_s: float) -> list[str]:
        role, _ = self._find(instance)
        added = await self._add(role)
        await self._drain(instance, drain_timeout_s)
        return [f"added {added.instance}", f"drained {instance}"]

    async def restart(self, instances: list[str] | None = None,
                      drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> list[str]:
        """A rolling restart: each worker of ``instances`` (None: every worker) replaced in turn,
        so each pool keeps its size and never drops below it."""
        async with self._lock:
            names = instances if instances is not None else [
                w.instance for role in self.roles() for w in self.pool(role)]
            for name in names:
                self._find(name)  # every name known before anything changes
            done: list[str] = []
            for name in names:
                done += await self._replace(name, drain_timeout_s)
            return done

    async def drain_node(self, node_ip: str, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                         replace: bool = False) -> list[str]:
        """Drain (or with ``replace``, replace) every worker on the Ray node at ``node_ip``: what
        a node's preStop hook asks before Kubernetes stops it. -> what it did."""
        async with self._lock:
            workers = [w for role in self.roles() for w in self.pool(role)]
            ips = await asyncio.gather(*(_node_ip(w) for w in workers))
            names = [w.instance for w, ip in zip(workers, ips) if ip == node_ip]
            done: list[str] = []
            for name in names:
                if replace:
                    done += await self._replace(name, timeout_s)
                else:
                    await self._drain(name, timeout_s)
                    done.append(f"drained {name}")
            return done

    async def add(self, role: Role) -> WorkerState:
        """Start one worker in ``role``'s pool; it joins routing once it serves."""
        async with self._lock:
            return await self._add(role)

    async def _add(self, role: Role) -> WorkerState:
        if self.start_worker is None:
            raise ValueError("this router cannot start workers (it was given its workers)")
        if role not in self.roles():
            raise ValueError(f"this cluster has no {role.value} pool")
        instance = f"{self.name_prefix}{role.value}-{next(self._numbers)}"
        w = self.start_worker(role, instance)
        try:
            await wait_ready({instance: w.handle}, START_TIMEOUT_S)
        except BaseException:
            _end(w)
            raise
        self.backend.add_worker(role, w)
        self._count(role, "added")
        logger.warning("worker %s joined the %s pool", instance, role.value)
        return w

    async def scale(self, sizes: dict[Role, int], drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> list[str]:
        """Bring each pool of ``sizes`` to that many workers: new ones added (all at once), the
        newest drained first. -> what it did, e.g. ["added decode-3", "drained prefill-1"]."""
        for role, size in sizes.items():
            if role not in self.roles():
                raise ValueError(f"this cluster has no {role.value} pool")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"the {role.value} pool needs at least one worker, got {size!r}")
        done: list[str] = []
        async with self._lock:
            for role, size in sizes.items():
                missing = size - len(self.pool(role))
                if missing > 0:
                    added = await asyncio.gather(*(self._add(role) for _ in range(missing)))
                    done += [f"added {w.instance}" for w in added]
                for w in list(reversed(self.pool(role)))[:max(0, -missing)]:
                    await self._drain(w.instance, drain_timeout_s)
                    done.append(f"drained {w.instance}")
        return done

    def _find(self, instance: str) -> tuple[Role, WorkerState]:
        for role in self.roles():
            for w in self.pool(role):
                if w.instance == instance:
                    return role, w
        names = ", ".join(w.instance for role in self.roles() for w in self.pool(role))
        raise ValueError(f"no worker is named {instance!r} (the workers: {names})")

    def _count(self, role: Role, change: str) -> None:
        if self.backend.metrics is not None:  # (set by the server that serves this backend)
            self.backend.metrics.pool_changes.labels(self.backend.metrics.model_name, role.value, change).inc()

    @staticmethod
    async def _num_held(w: WorkerState) -> int:
        """Requests the worker holds (0 when it does not answer: it has died)."""
        try:
            inventory = await asyncio.wait_for(w.handle.inventory.remote(), 5.0)
        except Exception:  # noqa: BLE001 - dead or stuck: nothing more will finish there
            return 0
        return max(inventory.num_sequences, inventory.num_open_streams)

    def _remove(self, role: Role, w: WorkerState) -> None:
        self.backend.remove_worker(role, w)
        _end(w)


async def _node_ip(w: WorkerState) -> str | None:
    """The address of the Ray node ``w`` runs on (None: it does not answer)."""
    try:
        return await asyncio.wait_for(w.handle.node_ip.remote(), 5.0)
    except Exception:  # noqa: BLE001 - dead or stuck: not on any node that can be drained
        return None


def _end(w: WorkerState) -> None:
    ray.kill(w.handle, no_restart=True)  # for good: Ray does not restart it
    if w.placement_group is not None:
        remove_placement_group(w.placement_group)
