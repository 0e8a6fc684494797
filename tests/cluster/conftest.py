"""One Ray for the whole session, with two real clusters on it (each worker loads the model
once, in its own process): disaggregated (1 prefill + 2 decode workers) and colocated
(1 worker), each behind its own gRPC router on a free loopback port; and a third router,
"local", over the disaggregated cluster's workers, whose decode workers prefill every prompt
themselves (--disagg-policy never)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
from fault_calls import HandoffTraces, read_handoff_traces
from mixed_streams import NUM_STREAMS, run_mix
from running_cluster import SameWorkers, running_clusters
from worker_checks import assert_workers_empty

from tandem.config import KVTransferConfig, WorkerConfig
from tandem.router.cluster import ClusterConfig

# The float path (quantization none): its greedy output is token-exact with transformers.
WORKER = WorkerConfig.build(kv_cache_memory_gib=0.1, max_num_batched_tokens=256, num_threads=1, quantization="none",
                            fault_injection=True)


LAST_MODULE = "test_pool_changes_cluster.py"
"""It replaces the disaggregated cluster's workers, which the "local" router holds by handle."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LAST_MODULE's tests after every other cluster test (tests/conftest.py puts this folder's
    after every other folder's)."""
    mine = [item for item in items if item.path.name == LAST_MODULE]
    rest = [item for item in items if item.path.name != LAST_MODULE]
    here = Path(__file__).parent
    after = max((k for k, item in enumerate(rest) if item.path.parent == here), default=len(rest) - 1)
    items[:] = rest[:after + 1] + mine + rest[after + 1:]


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


@pytest.fixture(scope="session")
def reference(clusters, tokenizer) -> list[dict[Any, Any]]:
    """The mix (mixed_streams.py) run uninterrupted on the disaggregated cluster: what every
    run that moves streams must equal."""
    cluster = clusters["disaggregated"]
    assert_workers_empty(cluster)
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as pool:
        outs = run_mix(cluster, tokenizer, pool)
    assert all(o["code"] == grpc.StatusCode.OK for o in outs), [o.get("details") for o in outs]
    assert_workers_empty(cluster, timeout=30)
    return outs
