"""--policy precise_prefix on a real cluster: two colocated workers with small pools and a
disk tier publish their KV block events; the router's index follows them (blocks stored in
the pool, then moved to disk as later prompts evict them), routes a repeated prompt to the
worker that holds its prefix, and predicts exactly the prompt tokens that worker then reports
as prefix hits (loaded from its disk tier), with the same greedy output; the router's
prediction counters (what ``tandem bench serve`` reads from /metrics) show the same; the other
worker, sharing the owner's folder, is matched with its disk blocks, and pointed at the
owner's tier server only once it has a folder of its own."""

from __future__ import annotations

import time

import pytest
import ray
from fault_calls import greedy
from reference import english_token_ids
from running_cluster import running_clusters
from worker_checks import assert_workers_empty

from tandem.bench.serving import breakdown
from tandem.config import WorkerConfig
from tandem.kvcache.block_hash import prefix_hashes
from tandem.router.cluster import ClusterConfig
from tandem.sampling_params import SamplingParams
from tandem.worker.api import KVSource, WorkerRequest

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def precise(clusters, tmp_path_factory):
    worker = WorkerConfig.build(kv_cache_memory_gib=0.03, max_num_batched_tokens=256, num_threads=1,
                                quantization="none", kv_offload_disk_gib=0.2,
                                kv_offload_dir=str(tmp_path_factory.mktemp("kv-offload")))
    config = ClusterConfig(colocated=2, worker=worker, policy="precise_prefix", name_prefix="kv-")
    with running_clusters({"precise": config}, clusters["colocated"].loop) as started:
        yield started["precise"]


def test_the_index_follows_the_workers_and_predicts_their_hits(precise, tokenizer):
    backend = precise.backend
    index = backend.kv_index
    assert index is not None

    def on_loop(fn):
        async def call():
            return fn()
        return precise.run(call())

    def wait_for(predicate, what: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while not (found := on_loop(predicate)):
            assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
            time.sleep(0.05)
        return found

    def counters() -> breakdown.Snapshot:
        return breakdown.parse_histograms(precise.scrape())[0]

    def prediction(since: breakdown.Snapshot, until: breakdown.Snapshot) -> dict:
        return breakdown.prefix_prediction(breakdown.difference(since, until)).get("precise_prefix", {})

    start = counters()
    names = [w.instance for w in backend.colocated]
    wait_for(lambda: not any(index.is_stale(n) for n in names), "both workers' snapshots")
    prompt = english_token_ids(tokenizer, 300, skip=30)
    hashes = prefix_hashes(prompt, BLOCK_SIZE, (len(prompt) - 1) // BLOCK_SIZE)
    first = greedy(precise, prompt, 4)
    # (Placed blocks count at once; the worker's events then say they are in its pool.)
    owner = wait_for(lambda: next((n for n in names if index.match(n, hashes).tiers == ("pool",) * len(hashes)),
                                  None), "the prompt's blocks in the index, in a pool")
    # Other prompts until the owner's pool evicted the prompt's whole prefix to its disk tier.
    for i in range(16):
        greedy(precise, english_token_ids(tokenizer, 300, skip=400 + 97 * i), 2)
        if on_loop(lambda: index.num_leading_in(owner, hashes, frozenset({"disk"}))) == len(hashes):
            break
    time.sleep(0.2)  # (the last events in)
    match = on_loop(lambda: index.match(owner, hashes))
    assert "disk" in match.tiers and match.num_blocks == len(hashes), match
    loads = {w.instance: w for w in backend.colocated}

    def hits() -> int:
        precise.run(backend.loads())
        return loads[owner].load.num_prefix_hits

    before, ahead = hits(), counters()
    assert greedy(precise, prompt, 4) == first
    reported = hits() - before
    assert reported == match.num_blocks * BLOCK_SIZE  # predicted: every block, from the pool or the disk
    end = counters()
    assert prediction(ahead, end) == {"predicted_tokens": reported, "reported_tokens": reported, "error_tokens": 0,
                                      "relative_error": 0.0}
    # Every other prompt shares no block with another: predicted and found nothing. So the
    # index's prediction is exact over the whole test (the issue asks for within 5%).
    overall = prediction(start, end)
    assert overall["reported_tokens"] == reported and overall["error_tokens"] == 0, overall
    assert index.num_gaps == 0
    # The two share one folder: the other worker is matched with the owner's disk blocks (it
    # reads those files itself) and is sent to fetch nothing.
    other = next(w for w in backend.colocated if w.instance != owner)
    assert on_loop(lambda: index.match(other.instance, hashes).tiers) == ("disk",) * len(hashes)

    def kv_source() -> KVSource | None:
        return backend._kv_source(other, WorkerRequest("r", prompt, SamplingParams()))

    assert on_loop(kv_source) is None
    # Reuse across hosts: were it on another host (a folder of its own), it would be pointed at
    # the owner, whose pool and disk tier serve the prompt's blocks (kv_sources.py).
    share_id = ray.get(other.handle.kv_disk_share_id.remote())
    assert share_id == ray.get(loads[owner].handle.kv_disk_share_id.remote())
    on_loop(lambda: index.share_disk(other.instance, None))
    assert on_loop(kv_source) == KVSource(ray.get(loads[owner].handle.kv_tier_address.remote()), len(hashes))
    on_loop(lambda: index.share_disk(other.instance, share_id))
    assert_workers_empty(precise)
