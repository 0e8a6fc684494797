"""Clusters behind real routers, on a test session's Ray and router event loop."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.cluster import ClusterConfig, start_cluster, stop_cluster
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



@contextlib.contextmanager
def running_clusters(configs: dict[str, ClusterConfig], loop: asyncio.AbstractEventLoop
                     ) -> Iterator[dict[str, RunningCluster]]:
    """Start a cluster and its router (with /metrics) per config, in parallel; stop them all after."""
    async def start(cfg: ClusterConfig):
        backend = await start_cluster(cfg)
        backend.start_polling()
        return backend, await serve(backend, "127.0.0.1", 0, metrics_port=0, http_port=0)

    started = {name: asyncio.run_coroutine_threadsafe(start(cfg), loop) for name, cfg in configs.items()}
    running = {}
    try:
        for name, future in started.items():
            backend, server = future.result(timeout=600)
            running[name] = (RunningCluster(backend, bound_port(server), metrics_port(server), http_port(server), loop),
                             server)
        yield {name: c for name, (c, _) in running.items()}
    finally:
        for c, server in running.values():
            asyncio.run_coroutine_threadsafe(drain(server, grace=1.0), loop).result(timeout=30)
            stop_cluster(c.backend)
