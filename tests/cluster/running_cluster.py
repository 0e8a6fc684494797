"""Clusters behind real routers, on a test session's Ray and router event loop."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.cluster import ClusterConfig, start_cluster, stop_cluster
from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend
from tandem.router.server import bound_port, drain, http_port, metrics_port, serve


@dataclass
class RunningCluster:
    backend: RayBackend
    port: int
    metrics_port: int
    """Where the router serves /metrics."""
    http_port: int
    """Where the router serves the OpenAI-compatible API."""
    loop: asyncio.AbstractEventLoop

    def run(self, coro) -> Any:
        """Run a coroutine on the router's event loop (its own thread) and wait."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def scrape(self) -> str:
        """The router's /metrics, as Prometheus would read it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as response:
            return response.read().decode()



@dataclass(frozen=True)
class SameWorkers:
    """A second router over another entry's workers, with its own disaggregation policy."""

    of: str
    disagg_policy: str


def _served(port: int | None) -> int:
    assert port is not None  # every router here serves /metrics and HTTP too (on port 0: any free one)
    return port


@contextlib.contextmanager
def running_clusters(configs: Mapping[str, ClusterConfig | SameWorkers], loop: asyncio.AbstractEventLoop
                     ) -> Iterator[dict[str, RunningCluster]]:
    """Start a cluster and its router (with /metrics) per config, in parallel, and a router per
    SameWorkers entry over the workers it names; stop them all after."""
    async def start(cfg: ClusterConfig):
        backend = await start_cluster(cfg)
        backend.start_polling()
        return backend, await serve(backend, "127.0.0.1", 0, metrics_port=0, http_port=0)

    async def share(of: RayBackend, disagg_policy: str):
        def states(ws: list[WorkerState]) -> list[WorkerState]:
            return [WorkerState(w.instance, w.handle) for w in ws]
        backend = RayBackend(states(of.prefill), states(of.decode), states(of.colocated), of.prefill_router.policy,
                             of.tokenizer_spec, disagg_policy=disagg_policy)
        await backend.loads()
        backend.start_polling()
        return backend, await serve(backend, "127.0.0.1", 0, metrics_port=0, http_port=0)

    started = {name: asyncio.run_coroutine_threadsafe(start(cfg), loop) for name, cfg in configs.items()
               if isinstance(cfg, ClusterConfig)}
    running = {}
    owned = set(started)
    try:
        for name, future in started.items():
            backend, server = future.result(timeout=600)
            running[name] = (RunningCluster(backend, bound_port(server), _served(metrics_port(server)),
                                            _served(http_port(server)), loop), server)
        for name, cfg in configs.items():
            if isinstance(cfg, SameWorkers):
                backend, server = asyncio.run_coroutine_threadsafe(
                    share(running[cfg.of][0].backend, cfg.disagg_policy), loop).result(timeout=60)
                running[name] = (RunningCluster(backend, bound_port(server), _served(metrics_port(server)),
                                                _served(http_port(server)), loop), server)
        yield {name: c for name, (c, _) in running.items()}
    finally:
        for name, (c, server) in running.items():
            asyncio.run_coroutine_threadsafe(drain(server, grace=1.0), loop).result(timeout=30)
            asyncio.run_coroutine_threadsafe(c.backend.stop_polling(), loop).result(timeout=30)
            if name in owned:
                stop_cluster(c.backend)
