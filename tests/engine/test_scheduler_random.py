"""The scheduler under random workloads: every step's batch, block tables, KV contents
(tracked per slot, swaps and copies included) and stop conditions checked against an
independent model of what they must be; at the end every block is free."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from scheduler_harness import EOS, add_seq, make_scheduler

from tandem.engine.sampler import StepOutput
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.sequence import SequenceStatus as St


def _check_books(sched: Scheduler) -> None:
    """Ref counts equal table memberships; only cached prefix blocks are shared; the host
    blocks in use are exactly the swapped sequences', never more than the device pool."""
    bm, bs, pool = sched.block_manager, sched.block_manager.block_size, sched.preemptor.swap_pool
    live = [*sched.waiting, *sched.running, *sched.swapped]
    assert len({id(s) for s in live}) == len(live)
    assert all(s.status == St.WAITING for s in sched.waiting) and all(s.status == St.RUNNING for s in sched.running)
    assert all(s.status == St.SWAPPED for s in sched.swapped)
    host_ids = [b for s in sched.swapped for b in s.host_block_ids]
    assert sorted(host_ids) == sorted(set(range(pool.num_blocks)) - set(pool.free_block_ids))
    assert len(host_ids) == pool.num_used_blocks <= bm.num_blocks
    for s in sched.swapped:
        assert s.block_ids == [] and len(s.host_block_ids) == bm.num_blocks_for(s.num_computed_tokens) > 0
    assert all(s.host_block_ids == [] for s in (*sched.waiting, *sched.running))
    holders: dict[int, list[tuple[Sequence, int]]] = defaultdict(list)
    for s in (*sched.waiting, *sched.running):
        assert len(set(s.block_ids)) == len(s.block_ids)
        assert s.num_computed_tokens <= len(s.block_ids) * bs and len(s.block_hashes) <= len(s.block_ids)
        if s.status == St.WAITING:
            assert s.block_ids == [] and s.num_computed_tokens == 0
        for i, b in enumerate(s.block_ids):
            holders[b].append((s, i))
            if i < len(s.block_hashes) and bm.block_hash[b] is not None:
                assert bm.block_hash[b] == s.block_hashes[i]
    assert bm.ref_counts == [len(holders[b]) for b in range(bm.num_blocks)]
    assert set(bm.free_block_ids) == {b for b in range(bm.num_blocks) if not holders[b]}
    for b, hs in holders.items():
        if len(hs) > 1:  # shared: a registered, full, computed block at the same table index
            assert bm.block_hash[b] is not None and len({i for _, i in hs}) == 1
            assert all(i < s.num_computed_tokens // bs for s, i in hs)
    assert {bm.block_hash[b]: b for b in bm.cached_block_ids.values()} == bm.cached_block_ids
    assert sum(h is not None for h in bm.block_hash) == len(bm.cached_block_ids)


def _copy_blocks(src: dict[int, tuple], dst: dict[int, tuple], block_pairs: list[tuple[int, int]], bs: int) -> None:
    for src_block, dst_block in block_pairs:
        for i in range(bs):
            dst.pop(dst_block * bs + i, None)
            if src_block * bs + i in src:
                dst[dst_block * bs + i] = src[src_block * bs + i]


def _check_batch_and_kv(sched: Scheduler, batch, kv: dict[int, tuple], host_kv: dict[int, tuple]) -> None:
    """The batch obeys the limits; the KV cache (simulated: a slot holds its token's whole
    prefix; swaps copied first, as the runner does) is right for every computed token; new
    tokens go only to private, unhashed blocks."""
    cfg, bm, bs = sched.config, sched.block_manager, sched.block_manager.block_size
    _copy_blocks(kv, host_kv, batch.swap_out, bs)
    _copy_blocks(host_kv, kv, batch.swap_in, bs)
    ns = batch.num_new_tokens
    assert 0 < batch.num_tokens <= cfg.max_num_batched_tokens and len(sched.running) <= cfg.max_num_seqs
    assert ns == sorted(ns, key=lambda n: n != 1) and min(ns) >= 1
    assert len({id(s) for s in batch.seqs}) == len(ns) and all(s in sched.running for s in batch.seqs)
    for seq, n in zip(batch.seqs, ns):
        start = seq.num_computed_tokens
        assert start + n <= seq.num_tokens <= cfg.max_model_len
        if not cfg.enable_chunked_prefill:
            assert start + n == seq.num_tokens
        slots = bm.slot_ids(seq, 0, start + n)
        for p in range(start):
            assert kv[slots[p]] == tuple(seq.token_ids[:p + 1]), (seq, p)
        for p in range(start, start + n):
            b = seq.block_ids[p // bs]
            assert bm.ref_counts[b] == 1 and bm.block_hash[b] is None
            kv[slots[p]] = tuple(seq.token_ids[:p + 1])


def _first_stop(seq: Sequence, max_model_len: int) -> tuple[int, St] | None:
    """Oracle: index of the output token that should have ended ``seq``, and how."""
    p = seq.params
    for i, t in enumerate(seq.output_token_ids):
        if (t == EOS and not p.ignore_eos) or t in p.stop_token_ids:
            return i, St.FINISHED_STOPPED
        if i + 1 >= p.max_tokens or seq.num_prompt_tokens + i + 1 >= max_model_len:
            return i, St.FINISHED_LENGTH
    return None


def _random_workload(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(3, 16)
    chunked = rng.random() < 0.7
    sched = make_scheduler(
        num_kv_blocks=num_blocks, block_size=bs, max_model_len=rng.randint(2, num_blocks * bs),
        max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 40),
        enable_prefix_caching=rng.random() < 0.8, enable_chunked_prefill=chunked,
        num_swap_blocks=rng.randint(0, num_blocks), preemption_mode=rng.choice(["auto", "swap", "recompute"]),
    )
    max_len = sched.config.max_model_len
    bases = [[rng.randint(10, 13) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    kv: dict[int, tuple] = {}
    host_kv: dict[int, tuple] = {}
    seqs: list[Sequence] = []
    num_requests = rng.randint(1, 20)
    for _ in range(3000):
        if len(seqs) < num_requests and rng.random() < 0.5:
            prompt = (rng.choice(bases) + [rng.randint(10, 13) for _ in range(rng.randint(0, 9))])[:max_len - 1]
            seqs.append(add_seq(sched, f"r{len(seqs)}", prompt or [10], max_tokens=rng.randint(1, 24),
                                ignore_eos=rng.random() < 0.3, stop_token_ids=rng.choice([(), (13,)])))
        if seqs and rng.random() < 0.05:
            victim = rng.choice(seqs)
            was_live = not victim.status.is_finished
            assert (sched.abort(victim.request_id) is victim) == was_live
            assert victim.status.is_finished and victim.block_ids == []
        _check_books(sched)
        if not sched.has_unfinished:
            if len(seqs) == num_requests:
                break
            continue
        batch = sched.schedule()
        _check_books(sched)
        _check_batch_and_kv(sched, batch, kv, host_kv)
        k = sum(batch.samples(i) for i in range(len(batch.seqs)))
        toks = [rng.choice([EOS, 10, 11, 12, 13, 13, 14, 15]) if rng.random() < 0.3 else rng.randint(10, 12)
                for _ in range(k)]
        sched.update(batch, StepOutput([[t] for t in toks], [[0.0]] * k))
    else:
        pytest.fail(f"seed {seed}: workload did not drain")
    bm = sched.block_manager
    assert not sched.waiting and not sched.running and not sched.swapped and not sched.has_unfinished
    assert sched.preemptor.swap_pool.num_free_blocks == sched.preemptor.swap_pool.num_blocks
    assert bm.ref_counts == [0] * num_blocks and sorted(bm.free_block_ids) == list(range(num_blocks))
    for seq in seqs:
        assert seq.status.is_finished and seq.block_ids == []
        stop = _first_stop(seq, max_len)
        if seq.status == St.FINISHED_ABORTED:
            assert stop is None  # nothing had ended it before the abort
        else:
            assert stop == (seq.num_output_tokens - 1, seq.status), seq


@pytest.mark.parametrize("chunk", range(5))
def test_random_workloads_leave_the_books_clean(chunk: int) -> None:
    """Seeded random workloads with random aborts: at every step the ref counts, free list
    and cache agree with the block tables, shared blocks are cached prefix blocks, the KV of
    every computed token is right; at the end every request finished as the oracle says
    and every block is free."""
    for seed in range(chunk * 200, (chunk + 1) * 200):
        _random_workload(seed)
