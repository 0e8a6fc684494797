"""Scheduler: preemption by swap. The newest sequence's KV goes to host blocks and comes
back into fresh device blocks before any new sequence is admitted; a full host pool means
recompute; abort frees host blocks; blocks shared by prefix caching keep their other holder.
Driven as the engine drives it (scheduler_harness.py); the copies are checked by the
random-workload property test (test_scheduler_random.py), and end to end in test_generate_matches_transformers.py."""

from __future__ import annotations

from scheduler_harness import add_seq, all_free, make_scheduler

from tandem.engine.sampler import StepOutput
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import SequenceStatus as St


def run_step(sched: Scheduler, token: int | dict[str, int] = 7):
    """One engine step -> ([(request_id, num_new_tokens)], swap_out pairs, swap_in pairs)."""
    batch = sched.schedule()
    ids = [s.request_id for i, s in enumerate(batch.seqs) if batch.samples(i)]
    toks = [token if isinstance(token, int) else token[r] for r in ids]
    sched.update(batch, StepOutput([[t] for t in toks], [[0.0] for _ in toks]))
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)], batch.swap_out, batch.swap_in


def _two_running_then_a_third_waits(**kw):
    """a and b (7-token prompts) fill 4 blocks of 4 and decode once; c (3 tokens) waits."""
    sched = make_scheduler(num_kv_blocks=4, **kw)
    a = add_seq(sched, "a", 7, max_tokens=3)
    b = add_seq(sched, "b", list(range(30, 37)), max_tokens=4)
    assert run_step(sched, {"a": 11, "b": 21}) == ([("a", 7), ("b", 7)], [], [])
    c = add_seq(sched, "c", 3, max_tokens=1)
    assert run_step(sched, {"a": 12, "b": 22}) == ([("a", 1), ("b", 1)], [], [])
    assert (a.block_ids, b.block_ids, list(sched.waiting)) == ([0, 1], [2, 3], [c])
    return sched, a, b, c


def test_swapped_sequence_resumes_where_it_stopped() -> None:
    """Out of blocks, the newest running sequence's 2 computed blocks go to host blocks 0, 1;
    it keeps its progress and, once a finishes, comes back (before c) with one token to run."""
    sched, a, b, c = _two_running_then_a_third_waits(preemption_mode="swap")
    assert run_step(sched, {"a": 13}) == ([("a", 1)], [(2, 0), (3, 1)], [])  # a took block 3 as b left
    assert (b.status, b.block_ids, b.host_block_ids, b.num_computed_tokens) == (St.SWAPPED, [], [0, 1], 8)
    assert list(sched.swapped) == [b] and list(sched.waiting) == [c] and sched.preemptor.swap_pool.num_used_blocks == 2
    assert (sched.preemptor.num_preemptions, b.num_preemptions, sched.preemptor.num_swapped_out_blocks) == (1, 1, 2)
    assert a.status == St.FINISHED_LENGTH and list(sched.block_manager.free_block_ids) == [2, 3, 1, 0]
    # b's KV comes back into fresh blocks 2, 3 (a third for its next token), then c is admitted.
    assert run_step(sched, {"b": 23, "c": 31}) == ([("b", 1), ("c", 3)], [], [(0, 2), (1, 3)])
    assert (b.block_ids, b.host_block_ids, b.status, b.num_computed_tokens) == ([2, 3, 1], [], St.RUNNING, 9)
    assert sched.preemptor.num_swapped_in_blocks == 2 and sched.preemptor.swap_pool.num_used_blocks == 0
    assert run_step(sched, {"b": 24}) == ([("b", 1)], [], [])
    assert b.output_token_ids == [21, 22, 23, 24] and b.status == St.FINISHED_LENGTH
    assert all_free(sched) and not sched.has_unfinished


def test_swapped_sequences_resume_before_new_ones() -> None:
    """c would fit in the 2 free blocks, but b (swapped, needing 3) goes first: c waits until
    b is back, though that takes until a finishes."""
    sched = make_scheduler(num_kv_blocks=5)
    a = add_seq(sched, "a", 7, max_tokens=4)
    b = add_seq(sched, "b", 7, max_tokens=4)
    run_step(sched), run_step(sched)  # a [0, 1], b [2, 3], both at 9 tokens
    assert run_step(sched) == ([("a", 1)], [(2, 0), (3, 1)], [])  # a took block 4; b swapped itself out
    c = add_seq(sched, "c", 3, max_tokens=1)
    assert sched.block_manager.num_free_blocks == 2
    assert run_step(sched) == ([("a", 1)], [], [])  # a ends; b needs 3 blocks, c must wait behind it
    assert a.status == St.FINISHED_LENGTH and list(sched.waiting) == [c] and list(sched.swapped) == [b]
    entries, swap_out, swap_in = run_step(sched)
    assert entries == [("b", 1), ("c", 3)] and len(swap_in) == 2 and not swap_out
    assert (b.status, b.num_computed_tokens, c.status) == (St.RUNNING, 9, St.FINISHED_LENGTH)
    assert run_step(sched) == ([("b", 1)], [], []) and b.status == St.FINISHED_LENGTH and all_free(sched)


def test_a_full_host_pool_falls_back_to_recompute() -> None:
    """One host block cannot hold b's two: b is preempted by recompute, nothing is copied."""
    sched, a, b, c = _two_running_then_a_third_waits(preemption_mode="swap", num_swap_blocks=1)
    assert run_step(sched, {"a": 13}) == ([("a", 1)], [], [])
    assert (b.status, b.block_ids, b.num_computed_tokens) == (St.WAITING, [], 0)
    assert list(sched.waiting) == [b, c] and not sched.swapped
    assert sched.preemptor.num_preemptions == 1 and sched.preemptor.num_swapped_out_blocks == 0


def test_recompute_mode_and_no_swap_space_never_swap() -> None:
    for kw in (dict(preemption_mode="recompute"), dict(swap_space_gib=0)):
        sched, a, b, c = _two_running_then_a_third_waits(**kw)
        assert run_step(sched, {"a": 13}) == ([("a", 1)], [], [])
        assert b.status == St.WAITING and sched.preemptor.num_swapped_out_blocks == 0


def test_aborting_a_swapped_sequence_frees_its_host_blocks() -> None:
    sched, a, b, c = _two_running_then_a_third_waits()  # auto: swaps from 1 block on
    run_step(sched, {"a": 13})
    assert b.status == St.SWAPPED and sched.preemptor.swap_pool.num_used_blocks == 2
    assert sched.abort("b") is b and b.status == St.FINISHED_ABORTED and b.host_block_ids == []
    assert not sched.swapped and sched.preemptor.swap_pool.num_free_blocks == sched.preemptor.swap_pool.num_blocks
    assert sched.abort("c") is c and all_free(sched) and not sched.has_unfinished


def test_swap_out_leaves_a_shared_prefix_block_to_its_other_holder() -> None:
    """b shares a's cached first block. Swapped out, b copies it too but only drops its own
    reference: a keeps reading it. Swapped in, b gets a fresh copy of it."""
    sched = make_scheduler(num_kv_blocks=5)
    bm = sched.block_manager
    a = add_seq(sched, "a", list(range(10, 18)), max_tokens=7)
    run_step(sched)  # a: blocks 0, 1 full and cached
    b = add_seq(sched, "b", list(range(10, 14)) + [50, 51, 52], max_tokens=7)
    assert run_step(sched) == ([("a", 1), ("b", 3)], [], [])  # a's decode took block 2 first
    assert (a.block_ids, b.block_ids, bm.ref_counts[0]) == ([0, 1, 2], [0, 3], 2)
    run_step(sched), run_step(sched), run_step(sched)  # b took the last free block
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [0, 3, 4])
    assert run_step(sched) == ([("a", 1)], [(0, 0), (3, 1), (4, 2)], [])  # a needs a 4th block
    assert a.block_ids == [0, 1, 2, 4] and bm.ref_counts[0] == 1 and b.status == St.SWAPPED
    assert run_step(sched) == ([("a", 1)], [], [])  # b needs 3 blocks; a ends
    assert a.status == St.FINISHED_LENGTH and list(bm.free_block_ids) == [3, 4, 2, 1, 0]
    assert run_step(sched) == ([("b", 1)], [], [(0, 3), (1, 4), (2, 2)])  # fresh blocks: 0 not reused
    assert b.block_ids == [3, 4, 2] and len(b.block_hashes) == 2
    # The first block's hash stays with a's block 0 (same tokens); the second is registered anew.
    assert bm.cached_block_ids[b.block_hashes[0]] == 0 and bm.cached_block_ids[b.block_hashes[1]] == 4
    while sched.has_unfinished:
        run_step(sched)
    assert all_free(sched)
