"""One Ray for the whole session, with two real clusters on it (each worker loads the model
once, in its own process): disaggregated (1 prefill + 2 decode workers) and colocated
(1 worker), each behind its own gRPC router on a free loopback port."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import ray

from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.cluster import ClusterConfig, start_cluster, stop_cluster
from tandem.router.ray_backend import RayBackend
from tandem.router.server import bound_port, drain, metrics_port, serve

WORKER_ARGS = dict(kv_cache_memory_gib=0.1, max_num_batched_tokens=256, num_threads=1)


@dataclass
class RunningCluster:
    backend: RayBackend
    port: int
    metrics_port: int
    """Where the router serves /metrics."""
    loop: asyncio.AbstractEventLoop

    def run(self, coro) -> Any:
        """Run a coroutine on the router's event loop (its own thread) and wait."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def scrape(self) -> str:
        """The router's /metrics, as Prometheus would read it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as response:
            return response.read().decode()


@pytest.fixture(scope="session")
def clusters():
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start(cfg: ClusterConfig):
        backend = await start_cluster(cfg)
        backend.start_polling()
        server = await serve(backend, "127.0.0.1", 0, metrics_port=0)
        return backend, server

    configs = {
        # With checksums on the KV: every disaggregated test also proves them harmless.
        "disaggregated": ClusterConfig(num_prefill=1, num_decode=2, worker_args={**WORKER_ARGS, "kv_checksum": True},
                                       name_prefix="d-"),
        "colocated": ClusterConfig(colocated=1, worker_args=WORKER_ARGS, name_prefix="c-"),
    }
    started = {name: asyncio.run_coroutine_threadsafe(start(cfg), loop) for name, cfg in configs.items()}
    running = {}
    try:
        for name, future in started.items():
            backend, server = future.result(timeout=600)
            running[name] = (RunningCluster(backend, bound_port(server), metrics_port(server), loop), server)
        yield {name: c for name, (c, _) in running.items()}
    finally:
        for c, server in running.values():
            asyncio.run_coroutine_threadsafe(drain(server, grace=1.0), loop).result(timeout=30)
            stop_cluster(c.backend)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        ray.shutdown()
