"""Reuse across hosts, on two colocated workers (in this process, real sockets, the real model)
whose disk tiers are in folders of their own, as on two hosts: a prompt that one worker
computed and evicted to disk, sent to the other with that worker as its kv_source, is fetched
over the tier server and loaded, not computed, and gives transformers' greedy tokens (so does
one still in the source's pool); a block whose file at the source fails its checksum is
recomputed with what follows it, never served; nothing is left held on either worker."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
from metrics_text import parse_samples, total
from reference import english_token_ids, hf_greedy

from tandem import SamplingParams
from tandem.config import WorkerConfig
from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.host_tier import HostTier
from tandem.worker.api import KVSource, StreamDelta, WorkerRequest
from tandem.worker.colocated import ColocatedWorker

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PROMPT_LEN = 200  # 12 full blocks
PARAMS = SamplingParams(temperature=0, max_tokens=6)
_ids = itertools.count()


@pytest.fixture(scope="module")
def workers(loaded, tmp_path_factory) -> Iterator[tuple[ColocatedWorker, ColocatedWorker]]:
    """(source, fetcher): 20-block pools, each with a disk tier of its own; the source serves its tier."""
    def config(folder: str, serve: bool) -> WorkerConfig:
        return WorkerConfig.build(num_threads=1, quantization="none", block_size=BLOCK_SIZE, num_kv_blocks=20,
                                  kv_offload_disk_gib=0.05, kv_offload_dir=str(tmp_path_factory.mktemp(folder)),
                                  publish_kv_events=serve)
    source = ColocatedWorker(config("host-a", True), "colocated-a", loaded=loaded)
    fetcher = ColocatedWorker(config("host-b", False), "colocated-b", loaded=loaded)
    yield source, fetcher
    source.shutdown()
    fetcher.shutdown()


async def _run(worker: ColocatedWorker, prompt: list[int], source: KVSource | None = None) -> tuple[list[int], int]:
    """-> the request's tokens and its cached prompt tokens."""
    deltas: list[StreamDelta] = []
    await worker.generate(WorkerRequest(f"r{next(_ids)}", prompt, PARAMS, kv_source=source), deltas.append)
    assert all(d.error is None for d in deltas)
    return [t for d in deltas for t in d.token_ids], deltas[0].num_cached_tokens


def _computed_and_evicted(worker: ColocatedWorker, prompt: list[int], others: list[list[int]]) -> list[int]:
    """Run ``prompt`` on ``worker``, then enough others that its blocks leave the pool for disk."""
    tokens, _ = asyncio.run(_run(worker, prompt))
    for other in others:
        asyncio.run(_run(worker, other))
    disk = worker.prefix_fetch.disk
    assert disk is not None
    disk.flush()
    assert all(disk.holds(h) for h in prefix_hashes(prompt, BLOCK_SIZE))
    return tokens


def test_a_prefix_evicted_on_one_worker_is_fetched_by_another(workers, hf_model, loaded, tokenizer):
    source, fetcher = workers
    address = source.kv_tier_address()
    assert address is not None and fetcher.kv_tier_address() is None  # (it publishes no events)
    others = [english_token_ids(tokenizer, PROMPT_LEN, skip=1500 + 300 * i) for i in range(2)]

    # A corrupt file at the source: blocks 0-4 come over, 5 on are recomputed.
    damaged = english_token_ids(tokenizer, PROMPT_LEN, skip=900)
    _computed_and_evicted(source, damaged, others)
    path = source.prefix_fetch.disk.path_of(prefix_hashes(damaged, BLOCK_SIZE)[5])
    data = bytearray(open(path, "rb").read())
    data[-50] ^= 0x02
    open(path, "wb").write(bytes(data))
    tokens, cached = asyncio.run(_run(fetcher, damaged, KVSource(address, 12)))
    assert tokens == hf_greedy(hf_model, damaged, PARAMS.max_tokens, loaded.config.eos_token_ids)
    assert cached == 5 * BLOCK_SIZE and fetcher.prefix_fetch.counters.num_blocks == 5

    prompt = english_token_ids(tokenizer, PROMPT_LEN, skip=40)
    expected = _computed_and_evicted(source, prompt, others)
    assert expected == hf_greedy(hf_model, prompt, PARAMS.max_tokens, loaded.config.eos_token_ids)
    tokens, cached = asyncio.run(_run(fetcher, prompt, KVSource(address, 12)))
    assert tokens == expected and cached == 12 * BLOCK_SIZE  # every full block fetched, none computed
    counters = fetcher.prefix_fetch.counters
    assert (counters.num_fetches, counters.num_blocks, counters.num_failed) == (2, 17, 0)
    assert source.prefix_fetch.server is not None and source.prefix_fetch.server.num_served_blocks == 17
    # A second time the fetcher holds them already: nothing is asked for.
    tokens, cached = asyncio.run(_run(fetcher, prompt, KVSource(address, 12)))
    assert tokens == expected and cached == 12 * BLOCK_SIZE and counters.num_fetches == 2

    # Blocks the source's pool still holds are served too (copied out between its steps).
    fresh = english_token_ids(tokenizer, PROMPT_LEN, skip=600)
    assert asyncio.run(_run(source, fresh))[1] == 0
    tokens, cached = asyncio.run(_run(fetcher, fresh, KVSource(address, 12)))
    assert tokens == hf_greedy(hf_model, fresh, PARAMS.max_tokens, loaded.config.eos_token_ids)
    assert cached == 12 * BLOCK_SIZE and (counters.num_fetches, counters.num_blocks) == (3, 29)

    samples = parse_samples(asyncio.run(fetcher.metrics_text()))
    assert total(samples, "tandem_kv_peer_fetch_blocks_total") == 29
    assert total(samples, "tandem_kv_peer_fetches_total", outcome="complete") == 3
    for worker in workers:
        assert asyncio.run(worker.inventory()).leaks() == []


def test_a_pool_with_a_host_tier_keeps_what_it_fetches_there(workers, hf_model, loaded, tokenizer):
    # An accelerator's pool keeps fetched blocks in its host tier, not on its disk. The config
    # gives host tiers to accelerator pools only, so the fetcher's chain is rebuilt here as
    # theirs is (host slots in front of the disk), over its CPU pool.
    source, fetcher = workers
    engine, disk = fetcher.loop.engine, fetcher.prefix_fetch.disk
    assert disk is not None
    host = HostTier(engine.runner.kv_cache, 40 * disk.block_bytes, disk)  # room for all it sees here
    engine.block_manager.tier, fetcher.prefix_fetch.host = host, host
    try:
        prompt = english_token_ids(tokenizer, PROMPT_LEN, skip=1200)
        others = [english_token_ids(tokenizer, PROMPT_LEN, skip=1500 + 300 * i) for i in range(2)]
        _computed_and_evicted(source, prompt, others)
        tokens, cached = asyncio.run(_run(fetcher, prompt, KVSource(source.kv_tier_address(), 12)))
        assert tokens == hf_greedy(hf_model, prompt, PARAMS.max_tokens, loaded.config.eos_token_ids)
        assert cached == 12 * BLOCK_SIZE
        hashes = prefix_hashes(prompt, BLOCK_SIZE)
        assert set(hashes) <= set(host.block_hashes()) and host.counters.num_loaded_blocks == 12
        disk.flush()
        assert not any(disk.holds(h) for h in hashes)
    finally:
        engine.block_manager.tier, fetcher.prefix_fetch.host = disk, None
    assert asyncio.run(fetcher.inventory()).leaks() == []
