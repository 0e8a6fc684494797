"""One Ray for the whole session, with two real clusters on it (each worker loads the model
once, in its own process): disaggregated (1 prefill + 2 decode workers) and colocated
(1 worker), each behind its own gRPC router on a free loopback port; and a third router,
"local", over the disaggregated cluster's workers, whose decode workers prefill every prompt
themselves (--disagg-policy never)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import ray
from fault_calls import HandoffTraces, read_handoff_traces
from running_cluster import SameWorkers, running_clusters

from tandem.config import KVTransferConfig, WorkerConfig
from tandem.router.cluster import ClusterConfig

# The float path (quantization none): its greedy output is token-exact with transformers.
WORKER = WorkerConfig.build(kv_cache_memory_gib=0.1, max_num_batched_tokens=256, num_threads=1, quantization="none",
                            fault_injection=True)


@pytest.fixture(scope="session")
def clusters():
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    configs = {
        # With checksums on the KV: every disaggregated test also proves them harmless.
        # Every prompt on the prefill pool here; on the decode workers through "local".
        "disaggregated": ClusterConfig(num_prefill=1, num_decode=2,
                                       worker=replace(WORKER, kv_transfer=KVTransferConfig(checksum=True)),
                                       name_prefix="d-", disagg_policy="always"),
        "colocated": ClusterConfig(colocated=1, worker=WORKER, name_prefix="c-"),
        "local": SameWorkers("disaggregated", disagg_policy="never"),
    }
    try:
        with running_clusters(configs, loop) as running:
            yield running
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        ray.shutdown()


@pytest.fixture(scope="session")
def handoff_traces() -> HandoffTraces:
    return {}


@pytest.fixture(scope="module", autouse=True)
def record_handoff_traces(request, handoff_traces):
    """After each module that used the shared clusters, their workers' handoff traces, so a
    worker that a later fault test restarts keeps its record."""
    yield
    if any(item.module is request.module and "clusters" in item.fixturenames for item in request.session.items):
        read_handoff_traces(request.getfixturevalue("clusters")["disaggregated"], handoff_traces)
