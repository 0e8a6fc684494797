"""The Ray actor around a worker. Torch-free here, so the router process that creates it
never imports torch: the worker class is imported inside the actor's own process."""

from __future__ import annotations

import importlib
from typing import Any, AsyncIterator

import ray

from tandem.kvtransfer.protocol import Destination
from tandem.worker_api import PrefillResult, Role, StreamDelta, TokenizerSpec, WorkerLoad, WorkerRequest

WORKER_CLASSES = {
    Role.PREFILL: "tandem.prefill_node.worker:PrefillWorker",
    Role.DECODE: "tandem.decode_node.worker:DecodeWorker",
    Role.COLOCATED: "tandem.decode_node.colocated:ColocatedWorker",
}


class WorkerHost:
    """Every worker method, delegated; each role uses its own subset."""

    def __init__(self, role: Role, **worker_args: Any) -> None:
        module, name = WORKER_CLASSES[role].split(":")
        self.worker = getattr(importlib.import_module(module), name)(**worker_args)

    def is_ready(self) -> bool:
        return self.worker.is_ready()

    def tokenizer_spec(self) -> TokenizerSpec:
        return self.worker.tokenizer_spec()

    async def load(self) -> WorkerLoad:
        return await self.worker.load()

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def prefill(self, request: WorkerRequest, destination: Destination) -> PrefillResult:
        return await self.worker.prefill(request, destination)

    async def reserve(self, request: WorkerRequest) -> Destination:
        return await self.worker.reserve(request)

    async def start(self, first: PrefillResult) -> None:
        await self.worker.start(first)

    async def stream(self, request_id: str) -> AsyncIterator[StreamDelta]:
        async for delta in self.worker.stream(request_id):
            yield delta

    async def generate(self, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        async for delta in self.worker.generate(request):
            yield delta


def start_worker(role: Role, instance: str, *, num_cpus: float, num_gpus: float, **worker_args: Any):
    """-> the actor handle of a new worker (Ray restarts it if its process dies)."""
    actor = ray.remote(WorkerHost).options(
        name=instance, num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=-1, max_concurrency=1000,
    )
    return actor.remote(role, instance=instance, **worker_args)
