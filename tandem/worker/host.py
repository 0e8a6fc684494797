"""The Ray actor around a worker. Torch-free here, so the router process that creates it
never imports torch: the worker class is imported inside the actor's own process."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.config import WorkerConfig
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.protocol import Destination
from tandem.worker import step_priority
from tandem.worker.api import (
    PrefillResult,
    Role,
    TokenizerSpec,
    WorkerInventory,
    WorkerLoad,
    WorkerRequest,
)
from tandem.worker.delta_outbox import DeltaOutbox
from tandem.worker.delta_stream import Send

WORKER_CLASSES = {
    Role.PREFILL: "tandem.prefill_node.worker:PrefillWorker",
    Role.DECODE: "tandem.decode_node.worker:DecodeWorker",
    Role.COLOCATED: "tandem.worker.colocated:ColocatedWorker",
}


class WorkerHost:
    """Every worker method, delegated; each role uses its own subset."""

    def __init__(self, role: Role, instance: str, config: WorkerConfig,
                 placement_group: PlacementGroup | None = None) -> None:
        """placement_group: a tensor-parallel worker's (see worker_placement_group)."""
        # KV goes in place between workers of one Ray node; KV events go out on the node's address.
        if role in (Role.PREFILL, Role.DECODE) or config.publish_kv_events:
            kv_transfer = config.kv_transfer.on_node(ray.get_runtime_context().get_node_id(),
                                                     ray.util.get_node_ip_address())
            config = dataclasses.replace(config, kv_transfer=kv_transfer)
        module, name = WORKER_CLASSES[role].split(":")
        self.worker = getattr(importlib.import_module(module), name)(config, instance, placement_group)
        self.outbox = DeltaOutbox(CurveKeys.from_env())
        """Where the streams' deltas leave for the router (a socket per router inbox)."""
        self.worker.exit_on_engine_down = True  # NOTE: Ray restarts a process that ended, not a thread
        if self.worker.engine.config.device.type == "cpu":
            step_priority.favour_the_step(self.worker.loop.native_id)  # the serving path shares its cores here

    def is_ready(self) -> bool:
        return self.worker.is_ready()

    def tokenizer_spec(self) -> TokenizerSpec:
        return self.worker.tokenizer_spec()

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        """This actor's process id (for memory sampling and fault tests)."""
        return os.getpid()

    def kv_events_address(self) -> str | None:
        return self.worker.kv_events_address()

    def kv_tier_address(self) -> str | None:
        return self.worker.kv_tier_address()

    def kv_disk_share_id(self) -> str | None:
        return self.worker.kv_disk_share_id()

    async def kv_snapshot(self) -> dict | None:
        return await self.worker.kv_snapshot()

    @ray.method(concurrency_group="control")
    def node_ip(self) -> str:
        """The address of the Ray node this actor runs on (a node's drain finds its workers by it)."""
        return ray.util.get_node_ip_address()

    @ray.method(concurrency_group="control")
    async def heartbeat(self) -> float:
        """Seconds since the worker's engine loop last went round. NOTE: in a concurrency
        group of its own, so that a flood of request calls (which take every slot of the
        default group and queue on the engine loop) never delays it: a late answer means
        the process is hung, not busy."""
        return self.worker.heartbeat()

    async def load(self) -> WorkerLoad:
        return await self.worker.load()

    async def inventory(self) -> WorkerInventory:
        return await self.worker.inventory()

    async def handoff_trace(self) -> list[tuple[str, str, str]]:
        return await self.worker.handoff_trace()

    async def metrics_text(self) -> str:
        return await self.worker.metrics_text()

    async def inject_fault(self, kind: str) -> None:
        await self.worker.inject_fault(kind)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def prefill(self, request: WorkerRequest, destination: Destination) -> PrefillResult:
        return await self.worker.prefill(request, destination)

    async def reserve(self, request: WorkerRequest) -> Destination:
        return await self.worker.reserve(request)

    async def prefill_local(self, request: WorkerRequest) -> None:
        await self.worker.prefill_local(request)

    async def start(self, first: PrefillResult) -> None:
        await self.worker.start(first)

    async def stream(self, request_id: str, inbox: str) -> None:
        """A decode worker's request's deltas, each sent to the router's ``inbox``
        (tcp://HOST:PORT, router/delta_inbox.py) as it comes; returns once the last is sent.
        Cancelling the call aborts the request."""
        await self.worker.stream(request_id, self._sender(inbox))

    async def generate(self, request: WorkerRequest, inbox: str) -> None:
        """A colocated worker's request, run; its deltas go as `stream`'s do."""
        await self.worker.generate(request, self._sender(inbox))

    def _sender(self, inbox: str) -> Send:
        """Sends to ``inbox`` from the engine thread: no wake-up of this actor's thread per token."""
        if not (isinstance(inbox, str) and inbox.startswith("tcp://")):
            raise ValueError(f"inbox must be a tcp:// address, got {inbox!r}")
        return functools.partial(self.outbox.send, inbox)


def pool_resource(role: Role) -> str:
    """The custom Ray resource a worker of `role` asks for with pool resources on: start a
    node with `ray start --resources '{"tandem_decode": 1}'` to host one decode worker."""
    return f"tandem_{role.value}"


def worker_placement_group(role: Role, tp: int, *, num_cpus: float, num_gpus: float,
                           pool_resources: bool = False) -> PlacementGroup:
    """One bundle per tensor-parallel rank, all on one node (the ranks' collectives run on
    its loopback); the worker itself takes bundle 0, its other ranks the rest."""
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    first = {**bundle, **({pool_resource(role): 1} if pool_resources else {})}
    return placement_group([first] + [bundle] * (tp - 1), strategy="STRICT_PACK")


def start_worker(role: Role, instance: str, config: WorkerConfig, *, num_cpus: float, num_gpus: float,
                 pool_resources: bool = False, placement_group: PlacementGroup | None = None):
    """-> the actor handle of a new worker built with ``config`` (Ray restarts it if its process dies).
    pool_resources: the worker runs only on nodes that offer its pool's resource.
    placement_group: a tensor-parallel worker's (see worker_placement_group)."""
    options: dict[str, Any] = dict(resources={pool_resource(role): 1} if pool_resources else None,
                                   runtime_env=step_priority.actor_runtime_env())
    if placement_group is not None:
        options = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group,
                                                                            placement_group_bundle_index=0),
                       runtime_env=step_priority.actor_runtime_env())
    # ray.remote's overloads leave out concurrency_groups, an actor option its documentation gives.
    actor = ray.remote(concurrency_groups={"control": 2})(WorkerHost).options(  # type: ignore[call-overload]
        name=instance, num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=-1, max_concurrency=1000, **options)
    return actor.remote(role, instance, config, placement_group)
