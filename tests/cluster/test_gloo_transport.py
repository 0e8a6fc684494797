"""`tandem serve --kv-transport gloo` on a real cluster, on the CPU: 1 prefill + 1 decode Ray
actor whose KV goes by torch.distributed (gloo, a group of two made in the handshake) even
though both are on one node. The output is token for token the single-process engine's,
every block is freed, and a decode worker killed with KV in flight ends its requests with
UNAVAILABLE, as on ZMQ; once Ray restarts it, a fresh pair carries the KV again."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

import grpc
import pytest
import ray
from fault_calls import awaited, decode_leaks, greedy, read_to_end, request, wait_until
from metrics_text import parse_samples, total
from reference import english_token_ids
from running_cluster import running_clusters
from worker_checks import assert_workers_empty, inventories

from tandem import SamplingParams
from tandem.config import KVTransferConfig, WorkerConfig
from tandem.router.cluster import ClusterConfig

pytestmark = pytest.mark.slow

PATHS = ("shm", "zmq", "dist")
WORKER = WorkerConfig.build(kv_cache_memory_gib=0.1, max_num_batched_tokens=256, num_threads=1, quantization="none",
                            kv_transfer=KVTransferConfig(transport="gloo"))


@pytest.fixture(scope="module")
def gloo_cluster():
    """Its own cluster (on the session's Ray when one runs, else on one of its own)."""
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = ClusterConfig(num_prefill=1, num_decode=1, worker=WORKER, name_prefix="gloo-", disagg_policy="always")
    try:
        with running_clusters({"gloo": cfg}, loop) as running:
            yield running["gloo"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if own_ray:
            ray.shutdown()


def transfer_paths(cluster) -> dict[str, float]:
    samples = parse_samples(cluster.scrape())
    return {p: total(samples, "tandem_kv_transfer_paths_total", role="prefill", path=p) for p in PATHS}


def test_greedy_output_unchanged_over_gloo(gloo_cluster, make_llm, tokenizer):
    prompts = [english_token_ids(tokenizer, n, skip=41 * i) for i, n in enumerate([5, 33, 300])]
    expected = [o.token_ids for o in make_llm().generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    before = transfer_paths(gloo_cluster)
    got = [greedy(gloo_cluster, ids, 8) for ids in prompts]
    assert got == expected
    after = transfer_paths(gloo_cluster)
    assert {p: after[p] - before[p] for p in PATHS} == {"shm": 0, "zmq": 0, "dist": len(prompts)}
    assert_workers_empty(gloo_cluster)


def test_decode_worker_killed_with_kv_in_flight(gloo_cluster, tokenizer):
    """Long prompts stream their KV (chunk by chunk) when the decode worker dies: each ends
    UNAVAILABLE, the prefill worker frees every block; the restarted worker serves again
    through a new pair, with the same greedy output."""
    cluster = gloo_cluster
    backend = cluster.backend
    (victim,) = backend.decode
    probe = english_token_ids(tokenizer, 20, skip=7)
    before = greedy(cluster, probe, 6)
    stub = cluster.stub()
    pool = concurrent.futures.ThreadPoolExecutor(4)
    outs = []
    try:
        for i in range(4):
            out: dict = {}
            call = stub.Generate(request(english_token_ids(tokenizer, 700, skip=60 * i), 16), timeout=120)
            pool.submit(read_to_end, call, threading.Event(), out)
            outs.append(out)

        def sending() -> bool:
            return any(i.role.value == "prefill" and i.num_pending_transfers
                       for i in cluster.run(inventories(backend)))
        wait_until(sending, 60, "the prefill worker sends KV")
        ray.kill(victim.handle, no_restart=False)
        wait_until(lambda: all("code" in out for out in outs), 30, "every request ends")
        codes = [out["code"] for out in outs]
        assert grpc.StatusCode.UNAVAILABLE in codes, outs
        assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK}, outs
    finally:
        pool.shutdown(wait=False, cancel_futures=True)

    def prefill_empty() -> bool:  # (the decode worker, restarting, answers no inventory call)
        (prefill,) = backend.prefill
        return cluster.run(awaited(prefill.handle.inventory.remote())).is_empty
    wait_until(prefill_empty, 40, "the prefill worker frees every block")
    wait_until(lambda: victim.healthy, 180, "the restarted decode worker is seen healthy")
    assert greedy(cluster, probe, 6) == before
    assert_workers_empty(cluster)


def test_prefill_worker_killed_with_kv_in_flight(gloo_cluster, tokenizer):
    """The other side: the prefill worker dies while its KV streams to the decode worker. Each
    request ends UNAVAILABLE and the decode worker, whose receiver may have been waiting on
    the pair for tensors, frees every block it had reserved."""
    cluster = gloo_cluster
    backend = cluster.backend
    (victim,) = backend.prefill
    stub = cluster.stub()
    before = total(parse_samples(cluster.scrape()), "tandem_kv_transfer_bytes_total", direction="received")
    pool = concurrent.futures.ThreadPoolExecutor(4)
    outs = []
    try:
        for i in range(4):
            out: dict = {}
            call = stub.Generate(request(english_token_ids(tokenizer, 700, skip=50 * i), 8), timeout=120)
            pool.submit(read_to_end, call, threading.Event(), out)
            outs.append(out)

        def receiving() -> bool:  # some KV has landed, and more is on its way
            landed = total(parse_samples(cluster.scrape()), "tandem_kv_transfer_bytes_total", direction="received")
            return landed > before and any(i.role.value == "decode" and i.num_pending_transfers
                                           for i in cluster.run(inventories(backend)))
        wait_until(receiving, 60, "the decode worker receives KV")
        ray.kill(victim.handle, no_restart=False)
        wait_until(lambda: all("code" in out for out in outs), 30, "every request ends")
        codes = [out["code"] for out in outs]  # (one whose KV had all arrived may finish)
        assert grpc.StatusCode.UNAVAILABLE in codes, outs
        assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK}, outs
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    wait_until(lambda: not decode_leaks(cluster), 40, "the decode worker frees every block")
