"""The precise prefix index: batches applied in order, a gap or a restart leaves the worker
stale (scored as holding nothing) until its snapshot, batches already in a snapshot skipped;
matches count leading blocks and their best tier. The batches are a real block manager's and
disk tier's events, and cross as bytes (JSON), a malformed one refused. The index's health
(staleness, stale entries, gaps, resyncs) reaches the router's metrics."""

from __future__ import annotations

import pytest
import torch
from metrics_text import parse_samples, total
from prometheus_client import CollectorRegistry, generate_latest

from tandem.engine.sequence import Sequence
from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.disk_tier import DiskTier
from tandem.kvcache.kv_events import POOL_TIER, BlockEvent, BlockEventKind, KVEventBatch, KVEventLog
from tandem.router.kv_index import PLACED_S, KVBlockIndex
from tandem.router.kv_index_metrics import KVIndexCollector
from tandem.sampling_params import SamplingParams

BS = 4


def h(i: int) -> bytes:
    return bytes([i]) * 16


def batch(seq: int, *events: tuple[str, int, str], epoch: str = "e1", worker: str = "w0") -> KVEventBatch:
    return KVEventBatch(worker, epoch, seq, tuple(BlockEvent(BlockEventKind(k), h(i), t) for k, i, t in events))


def test_batches_in_order_then_a_gap_needs_a_snapshot():
    index = KVBlockIndex()
    assert not index.apply(batch(1, ("stored", 1, "pool")))  # nothing known yet: a snapshot first
    index.resync("w0", "e1", 1, {h(1): ["pool"]})
    assert index.apply(batch(2, ("stored", 2, "pool"), ("stored", 3, "pool")))
    assert index.apply(batch(3, ("removed", 2, "pool"), ("stored", 2, "disk")))
    m = index.match("w0", [h(1), h(2), h(3), h(4)])
    assert (m.num_blocks, m.tiers) == (3, ("pool", "disk", "pool")) and m.score == pytest.approx(2.8)
    assert index.match("w0", [h(9), h(1)]).num_blocks == 0  # leading blocks only
    assert not index.apply(batch(5, ("stored", 9, "pool")))  # 4 was lost
    assert index.is_stale("w0") and index.match("w0", [h(1)]).num_blocks == 0 and index.num_gaps == 1
    index.resync("w0", "e1", 5, {h(1): ["disk"], h(9): ["pool"]})
    assert index.apply(batch(5, ("stored", 7, "pool")))  # in the snapshot already: skipped
    assert index.apply(batch(6, ("removed", 1, "disk")))
    assert index.match("w0", [h(1)]).num_blocks == 0 and index.match("w0", [h(9)]).num_blocks == 1
    # A restarted worker (a new epoch) starts over: its old blocks are gone.
    assert not index.apply(batch(1, ("stored", 5, "pool"), epoch="e2"))
    assert index.match("w0", [h(9)]).num_blocks == 0 and index.num_resyncs == 2


def test_batches_cross_as_json_and_a_malformed_one_is_refused():
    b = batch(4, ("stored", 1, "pool"), ("removed", 2, "disk"))
    assert KVEventBatch.decode(b.encode()) == b
    for bad in (b"\x80\x04pickle", b"{}", b'{"worker": "w", "epoch": "e", "seq": 0, "events": []}',
                b'{"worker": "w", "epoch": "e", "seq": 1, "events": [["moved", "00", "pool"]]}',
                b'{"worker": "w", "epoch": "e", "seq": 1, "events": [["stored", "zz", "pool"]]}'):
        with pytest.raises(ValueError, match="not a KV event batch"):
            KVEventBatch.decode(bad)


def test_a_block_managers_events_keep_the_index_equal_to_its_cache(tmp_path):
    """A pool with a disk tier, prompts filling and evicting it: after every cut, the index's
    view of the worker is exactly what the pool and the tier hold."""
    log = KVEventLog("w0", "e1")
    bm = BlockManager(6, BS)
    kv = torch.zeros(1, 2, 6, BS, 1, 2)
    tier = DiskTier(kv, str(tmp_path), 1 << 20, "k")
    bm.tier, bm.events, tier.events = tier, log, log
    index = KVBlockIndex()
    index.resync("w0", "e1", log.last_seq, {})

    def run(tokens: list[int]) -> None:
        seq = Sequence(str(tokens[0]), tokens, SamplingParams(), arrival_index=0)
        cached = bm.find_cached_prefix(seq)
        bm.allocate(seq, len(tokens) - len(cached) * BS, cached)
        seq.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(seq)
        bm.free(seq)
        tier.flush()
        cut = log.cut()
        assert cut is not None and index.apply(KVEventBatch.decode(cut.encode()))

    prompts = [list(range(100 * i, 100 * i + 13)) for i in range(4)]
    for tokens in prompts + prompts[:2]:
        run(tokens)
        for p in prompts:
            hashes = prefix_hashes(p, BS)
            in_pool = [x in bm.cached_block_ids for x in hashes]
            on_disk = [tier.holds(x) for x in hashes]
            m = index.match("w0", hashes)
            expected = next((i for i, (a, b) in enumerate(zip(in_pool, on_disk)) if not (a or b)), len(hashes))
            assert m.num_blocks == expected
            assert list(m.tiers) == [POOL_TIER if in_pool[i] else "disk" for i in range(expected)]
    tier.close()


def test_placed_blocks_count_until_the_events_speak_for_them():
    """A prompt the router placed counts as held before the worker's events mention it (they
    lag the placement by its queue and prefill), until its blocks' events arrive (a removal
    included) or PLACED_S passes; a snapshot keeps what it does not mention."""
    now = [100.0]
    index = KVBlockIndex(clock=lambda: now[0])
    index.resync("w0", "e1", 1, {h(1): ["pool"]})
    index.note_placed("w0", [h(1), h(2), h(3)])
    m = index.match("w0", [h(1), h(2), h(3), h(4)])
    assert (m.num_blocks, m.tiers) == (3, ("pool", "placed", "placed")) and m.score == pytest.approx(3.0)
    assert index.apply(batch(2, ("stored", 2, "pool"), ("removed", 3, "pool")))
    assert index.match("w0", [h(1), h(2), h(3)]).tiers == ("pool", "pool")  # 3: removed, its events say
    index.note_placed("w0", [h(5)])
    index.resync("w0", "e1", 2, {h(1): ["pool"], h(2): ["pool"]})
    assert index.match("w0", [h(5)]).tiers == ("placed",)
    now[0] += PLACED_S
    assert index.match("w0", [h(5)]).num_blocks == 0  # never ran, as far as the events tell
    assert index.match("w1", [h(1)]).num_blocks == 0  # another worker: nothing placed there


def test_a_worker_is_matched_with_the_disk_blocks_of_the_workers_sharing_its_folder():
    # w0 and w1 keep their disk tiers in one folder (one host): each loads the other's files.
    index = KVBlockIndex()
    index.resync("w0", "e", 1, {h(1): ["pool"], h(2): ["disk"], h(3): ["disk"], h(5): ["disk"], h(6): ["pool"]})
    index.resync("w1", "e", 1, {h(1): ["disk"]})
    index.resync("w2", "e", 1, {})
    prompt = [h(1), h(2), h(3), h(4), h(5)]
    assert index.match("w1", prompt).num_blocks == 1  # no folder known yet: its own only
    for worker, share_id in (("w0", "dir-a"), ("w1", "dir-a"), ("w2", "dir-b")):
        index.share_disk(worker, share_id)
    m = index.match("w1", prompt)
    assert (m.num_blocks, m.tiers) == (3, ("disk", "disk", "disk"))  # its own, then w0's up to the gap
    assert index.match("w1", [h(6)]).num_blocks == 0  # w0's pool is another process's memory
    assert index.match("w2", [h(2)]).num_blocks == 0  # another folder
    assert not index.apply(batch(9, ("stored", 7, "disk"), worker="w0"))  # a gap: w0 is stale
    assert index.match("w1", [h(1), h(2)]).num_blocks == 1
    index.resync("w0", "e", 9, {h(2): ["disk"]})
    assert index.match("w1", [h(1), h(2)]).num_blocks == 2
    index.share_disk("w1", None)  # (restarted without a disk tier)
    assert index.match("w1", [h(1), h(2)]).num_blocks == 1
    index.share_disk("w1", "dir-a")
    index.forget("w0")
    assert index.match("w1", [h(1), h(2)]).num_blocks == 1


def test_the_index_health_reaches_the_routers_metrics():
    now = [100.0]
    index = KVBlockIndex(clock=lambda: now[0])
    index.resync("w0", "e1", 1, {h(1): ["pool"], h(2): ["disk"]})
    index.resync("w1", "e1", 1, {})
    now[0] = 103.5
    assert index.apply(batch(2, ("stored", 3, "pool")))
    now[0] = 104.0
    assert not index.apply(batch(7, worker="w1"))  # a gap: w1 waits for a snapshot
    registry = CollectorRegistry()
    registry.register(KVIndexCollector("m", index))
    s = parse_samples(generate_latest(registry).decode())
    assert total(s, "tandem_router_kv_index_staleness_seconds", instance="w0") == 0.5
    assert total(s, "tandem_router_kv_index_staleness_seconds", instance="w1") == 4.0
    assert total(s, "tandem_router_kv_index_stale", instance="w1") == 1
    assert total(s, "tandem_router_kv_index_stale", instance="w0") == 0
    assert total(s, "tandem_router_kv_index_blocks", instance="w0") == 3
    assert total(s, "tandem_router_kv_index_gaps_total") == 1 and total(s, "tandem_router_kv_index_resyncs_total") == 2
