"""Where a worker fetches the prefix blocks it lacks: the worker whose disk tier, by the KV
index, holds the most blocks that follow what it holds itself in its pool or disk tier (at
least MIN_FETCH_BLOCKS, counted from the first it lacks), never itself, never a stale worker,
never a block held only in a host tier or only placed, nor a disk block from a worker whose
folder it shares (it reads those files itself)."""

from __future__ import annotations

from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.kv_events import KVEventBatch
from tandem.router.kv_index import KVBlockIndex
from tandem.router.kv_sources import kv_source_for
from tandem.router.policy import WorkerState
from tandem.worker.api import KVSource, Role, WorkerLoad

PROMPT = list(range(2000, 2100))  # 100 tokens: 6 full blocks of 16
HASHES = prefix_hashes(PROMPT, 16)
ADDRESSES = {"w0": "tcp://w0:1", "w1": "tcp://w1:1", "w2": "tcp://w2:1"}


def worker(instance: str) -> WorkerState:
    load = WorkerLoad(Role.COLOCATED, instance, num_blocks=100, num_free_blocks=100, num_running=0, num_waiting=0,
                      num_queued_tokens=0, block_size=16)
    return WorkerState(instance, handle=None, load=load)


def index_of(holdings: dict[str, dict[int, list[str]]]) -> KVBlockIndex:
    index = KVBlockIndex()
    for instance, blocks in holdings.items():
        index.resync(instance, "e", 1, {HASHES[i]: tiers for i, tiers in blocks.items()})
    return index


def test_the_peer_holding_most_of_what_follows_is_the_source():
    index = index_of({"w0": {0: ["pool"], 1: ["pool"]},
                      "w1": {i: ["disk"] for i in range(5)},  # 3 blocks past w0's 2
                      "w2": {0: ["host"], 1: ["pool"], **{i: ["disk", "pool"] for i in range(2, 5)}, 5: ["pool"]}})
    assert kv_source_for(index, ADDRESSES, worker("w0"), PROMPT, None) == KVSource("tcp://w2:1", 6)
    # w1 for a worker holding nothing: its 5 leading blocks, against none of w2's (a host block first).
    assert kv_source_for(index, ADDRESSES, worker("w3"), PROMPT, None) == KVSource("tcp://w1:1", 5)


def test_no_source_below_the_minimum_for_itself_past_a_host_or_placed_block_or_from_a_stale_worker():
    index = index_of({"w0": {0: ["pool"]}, "w1": {0: ["disk"], 1: ["disk"], 2: ["host"]}})
    index.note_placed("w1", HASHES)  # blocks 3-5 are on their way there, not there
    assert kv_source_for(index, ADDRESSES, worker("w0"), PROMPT, None) is None  # one block past w0's
    assert kv_source_for(index, ADDRESSES, worker("w1"), PROMPT, None) is None  # itself
    assert kv_source_for(index, {"w0": "tcp://w0:1"}, worker("w2"), PROMPT, None) is None  # w1 serves nothing
    assert kv_source_for(index, ADDRESSES, worker("w2"), PROMPT, None) == KVSource("tcp://w1:1", 2)
    assert not index.apply(KVEventBatch("w1", "e", 9, ()))  # a gap: w1 is stale until its snapshot
    assert kv_source_for(index, ADDRESSES, worker("w2"), PROMPT, None) is None


def test_a_salted_prompt_matches_only_blocks_of_its_salt():
    index = index_of({"w1": {i: ["disk"] for i in range(6)}})
    assert kv_source_for(index, ADDRESSES, worker("w0"), PROMPT, "tenant-a") is None
    salted = prefix_hashes(PROMPT, 16, cache_salt="tenant-a")
    index.resync("w1", "e", 2, {h: ["disk"] for h in salted})
    assert kv_source_for(index, ADDRESSES, worker("w0"), PROMPT, "tenant-a") == KVSource("tcp://w1:1", 6)


def test_no_fetch_of_disk_blocks_from_a_worker_sharing_the_folder():
    index = index_of({"w0": {i: ["disk"] for i in range(4)}, "w1": {}})
    assert kv_source_for(index, ADDRESSES, worker("w1"), PROMPT, None) == KVSource("tcp://w0:1", 4)
    index.share_disk("w0", "dir-a")
    index.share_disk("w1", "dir-a")  # w1 reads w0's files itself
    assert kv_source_for(index, ADDRESSES, worker("w1"), PROMPT, None) is None
    index.resync("w0", "e", 2, {**{HASHES[i]: ["disk"] for i in range(4)}, HASHES[4]: ["pool"], HASHES[5]: ["pool"]})
    assert kv_source_for(index, ADDRESSES, worker("w1"), PROMPT, None) == KVSource("tcp://w0:1", 6)  # its pool's
