"""prefix_aware routing: the router's prefix index hashes prompts exactly as the workers'
block managers do, at each worker's block size, and picks the owner of the longest
prefix unless its queue outweighs what the prefix saves."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.engine.sequence import Sequence
from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.block_manager import BlockManager
from tandem.router.policy import Router, WorkerState
from tandem.sampling_params import SamplingParams
from tandem.worker.api import Role, WorkerLoad

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16


def worker(instance: str, num_queued_tokens: int = 0, num_free_blocks: int = 100, block_size: int = 16) -> WorkerState:
    load = WorkerLoad(Role.DECODE, instance, num_blocks=100, num_free_blocks=num_free_blocks, num_running=0,
                      num_waiting=0, num_queued_tokens=num_queued_tokens, block_size=block_size)
    return WorkerState(instance, handle=None, load=load)


def names(order: list[WorkerState]) -> list[str]:
    return [w.instance for w in order]


@pytest.mark.parametrize("block_size", [4, 16])
def test_router_hashes_equal_the_block_managers(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size)
    seq = Sequence("r", PROMPT, SamplingParams(), 0)
    bm.allocate(seq, len(PROMPT))
    seq.num_computed_tokens = len(PROMPT)
    bm.cache_full_blocks(seq)
    assert prefix_hashes(PROMPT, block_size) == seq.block_hashes
    # And the router's guess of the cached prefix is what find_cached_prefix finds.
    router = Router("prefix_aware")
    w = worker("d-0", block_size=block_size)
    router.record(w, PROMPT)
    extended = PROMPT + [7, 8, 9]
    bm.free(seq)
    found = bm.find_cached_prefix(Sequence("r2", extended, SamplingParams(), 1))
    assert router.num_cached_tokens(w, extended) == len(found) * block_size == (len(PROMPT) // block_size) * block_size


def test_longest_prefix_owner_first_when_loads_are_equal():
    router = Router("prefix_aware")
    a, b, c = worker("a"), worker("b"), worker("c")
    router.record(b, PROMPT[:40])  # 2 blocks
    router.record(c, PROMPT)  # 6 blocks
    assert names(router.order([a, b, c], PROMPT + [1])) == ["c", "b", "a"]
    assert router.num_cached_tokens(c, PROMPT + [1]) == 96
    assert router.num_cached_tokens(c, PROMPT) == 96  # the last token is always computed: 99 // 16 blocks
    assert router.num_cached_tokens(c, [5] + PROMPT) == 0  # a prefix, not any substring


def test_a_salted_prefix_is_found_only_under_its_salt():
    """The index hashes as the worker's block manager does from the request's cache_salt: a
    prefix routed under one salt is no hit for the same tokens unsalted or under another."""
    router = Router("prefix_aware")
    a, b = worker("a"), worker("b")
    router.record(b, PROMPT, cache_salt="tenant-1")
    assert router.num_cached_tokens(b, PROMPT + [1], "tenant-1") == 96
    assert router.num_cached_tokens(b, PROMPT + [1]) == router.num_cached_tokens(b, PROMPT + [1], "tenant-2") == 0
    assert names(router.order([a, b], PROMPT + [1], "tenant-1")) == ["b", "a"]
    bm = BlockManager(num_blocks=64, block_size=16)
    seq = Sequence("r", PROMPT, SamplingParams(cache_salt="tenant-1"), 0)
    bm.allocate(seq, len(PROMPT))
    seq.num_computed_tokens = len(PROMPT)
    bm.cache_full_blocks(seq)
    assert prefix_hashes(PROMPT, 16, cache_salt="tenant-1") == seq.block_hashes


def test_a_crowded_owner_is_passed_over():
    """Owner first while its queued tokens minus the 96 tokens it holds is below the others'."""
    router = Router("prefix_aware")
    owner, other = worker("owner", num_queued_tokens=95), worker("other")
    router.record(owner, PROMPT)
    assert names(router.order([other, owner], PROMPT + [1])) == ["owner", "other"]
    owner.load = worker("owner", num_queued_tokens=97).load
    assert names(router.order([other, owner], PROMPT + [1])) == ["other", "owner"]
    # Free blocks only break ties: the owner holds the prefix in what it counts as free.
    owner.load = worker("owner", num_free_blocks=10).load
    assert names(router.order([other, owner], PROMPT + [1])) == ["owner", "other"]


def test_in_flight_tokens_count_as_queued():
    router = Router("prefix_aware")
    owner, other = worker("owner"), worker("other")
    router.record(owner, PROMPT)
    owner.num_in_flight_tokens = 200
    assert names(router.order([owner, other], PROMPT + [1])) == ["other", "owner"]


def test_no_prefix_anywhere_is_least_loaded():
    router = Router("prefix_aware")
    a, b = worker("a", num_free_blocks=50), worker("b", num_free_blocks=80)
    assert names(router.order([a, b], PROMPT)) == names(Router("least_loaded").order([a, b], PROMPT)) == ["b", "a"]


def test_each_worker_is_hashed_at_its_own_block_size():
    router = Router("prefix_aware")
    small, large = worker("small", block_size=4), worker("large", block_size=32)
    router.record(small, PROMPT)
    router.record(large, PROMPT)
    assert router.num_cached_tokens(small, PROMPT + [1]) == 100
    assert router.num_cached_tokens(large, PROMPT + [1]) == 96
    assert names(router.order([large, small], PROMPT + [1])) == ["small", "large"]


def test_index_forgets_beyond_the_pool_and_unhealthy_workers_are_skipped():
    router = Router("prefix_aware")
    w = worker("w")  # 100 blocks in its pool
    router.record(w, PROMPT)
    router.record(w, list(range(5000, 5000 + 16 * 100)))  # 100 newer blocks push the old ones out
    assert router.num_cached_tokens(w, PROMPT + [1]) == 0
    router.record(w, PROMPT)
    w.healthy = False
    assert router.order([w], PROMPT) == []


def test_other_policies_remember_nothing():
    router = Router("least_loaded")
    w = worker("w")
    router.record(w, PROMPT)
    assert router.num_cached_tokens(w, PROMPT + [1]) == 0


def test_the_router_imports_no_torch():
    code = "import sys, tandem.router.ray_backend, tandem.router.server; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
