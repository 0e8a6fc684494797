"""Scheduler: FCFS, token budget, chunked prefill, preemption, stops, abort (the random
workloads: test_scheduler_random.py), all driven the way the engine drives it (schedule, then
update with one sampled token per sampling entry). Pure Python: no model is loaded."""

from __future__ import annotations

import pytest
from scheduler_harness import EOS, add_seq, all_free, make_scheduler, run_step

from tandem.engine.sequence import SequenceStatus as St


def test_fcfs_admission_then_decodes() -> None:
    """Prompts are admitted whole in arrival order, then each decodes one token a step."""
    sched = make_scheduler()
    a, b, c = add_seq(sched, "a", 5), add_seq(sched, "b", 6), add_seq(sched, "c", 7)
    assert run_step(sched) == [("a", 5, True), ("b", 6, True), ("c", 7, True)]
    assert sched.running == [a, b, c] and not sched.waiting
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2, 3], [4, 5])
    assert run_step(sched, {"a": 11, "b": 12, "c": 13}) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert (a.output_token_ids, b.output_token_ids, a.output_logprobs) == ([7, 11], [7, 12], [-0.5, -0.5])


def test_chunked_prefill_splits_a_long_prompt() -> None:
    """100 tokens under a 32-token budget run as 32, 32, 32, 4; only the last chunk samples."""
    sched = make_scheduler(num_kv_blocks=16, block_size=16, max_num_batched_tokens=32)
    seq = add_seq(sched, "a", 100)
    expect = [(32, False, 2), (32, False, 4), (32, False, 6), (4, True, 7)]
    for n, samples, num_blocks in expect:
        assert run_step(sched) == [("a", n, samples)]
        assert seq.block_ids == list(range(num_blocks))
        assert seq.num_output_tokens == int(samples)
    assert seq.num_computed_tokens == 100 and run_step(sched) == [("a", 1, True)]


def test_token_budget_is_shared_and_decodes_come_first() -> None:
    """Running sequences take the budget first; what is left goes to new prompts, chunked."""
    sched = make_scheduler(max_num_batched_tokens=16)
    add_seq(sched, "a", 10), add_seq(sched, "b", 10), add_seq(sched, "c", 3), add_seq(sched, "d", 30)
    assert run_step(sched) == [("a", 10, True), ("b", 6, False)]
    assert run_step(sched) == [("a", 1, True), ("b", 4, True), ("c", 3, True), ("d", 8, False)]
    assert run_step(sched) == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 13, False)]
    assert run_step(sched) == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 9, True)]


def test_decodes_are_listed_before_an_older_sequences_prefill_chunk() -> None:
    """Even when the running order puts a prefill chunk first, single-token entries lead."""
    sched = make_scheduler(max_num_batched_tokens=16)
    add_seq(sched, "new", 2, arrival=10**9 + 1)
    add_seq(sched, "old", 20, arrival=10**9)  # older, but queued second
    assert run_step(sched) == [("new", 2, True), ("old", 14, False)]
    assert [s.request_id for s in sched.running] == ["new", "old"]
    assert run_step(sched) == [("new", 1, True), ("old", 6, True)]
    assert [s.request_id for s in sched.running] == ["old", "new"]  # sorted by arrival


def test_max_num_seqs_caps_the_running_set() -> None:
    """A third request waits until one of the two running ones finishes."""
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = (add_seq(sched, r, 3, max_tokens=m) for r, m in (("a", 2), ("b", 3), ("c", 1)))
    assert run_step(sched) == [("a", 3, True), ("b", 3, True)]
    assert run_step(sched) == [("a", 1, True), ("b", 1, True)]
    assert a.status == St.FINISHED_LENGTH and list(sched.waiting) == [c]
    assert run_step(sched) == [("b", 1, True), ("c", 3, True)]
    assert (b.status, c.status) == (St.FINISHED_LENGTH, St.FINISHED_LENGTH) and all_free(sched)


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    """The budget rises to max_model_len and a prompt that does not fit waits whole."""
    sched = make_scheduler(max_model_len=64, max_num_batched_tokens=16, enable_chunked_prefill=False)
    assert sched.config.max_num_batched_tokens == 64
    add_seq(sched, "a", 50), add_seq(sched, "b", 40), add_seq(sched, "c", 5)
    assert run_step(sched) == [("a", 50, True)]  # b would need 40 of the 14 left; c waits behind
    assert run_step(sched) == [("a", 1, True), ("b", 40, True), ("c", 5, True)]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_the_newest_sequence(prefix_caching: bool) -> None:
    """Out of blocks, the newest running sequence is freed, goes to the waiting front and
    later reruns prompt + generated tokens (from its surviving cached prefix, if any)."""
    sched = make_scheduler(num_kv_blocks=4, enable_prefix_caching=prefix_caching, preemption_mode="recompute")
    a = add_seq(sched, "a", 7, max_tokens=3)
    b = add_seq(sched, "b", list(range(30, 37)), max_tokens=4)
    assert run_step(sched, {"a": 11, "b": 21}) == [("a", 7, True), ("b", 7, True)]
    c = add_seq(sched, "c", 3, max_tokens=1)
    assert run_step(sched, {"a": 12, "b": 22}) == [("a", 1, True), ("b", 1, True)]
    assert (a.block_ids, b.block_ids, list(sched.waiting)) == ([0, 1], [2, 3], [c])
    assert run_step(sched, {"a": 13}) == [("a", 1, True)]  # a needs a 3rd block: b gives way
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (St.WAITING, [], 0, 1)
    assert list(sched.waiting) == [b, c] and sched.preemptor.num_preemptions == 1
    assert a.status == St.FINISHED_LENGTH and a.output_token_ids == [11, 12, 13]
    assert list(sched.block_manager.free_block_ids) == [2, 3, 1, 0]
    # b's first block (block 2) survived in the cache; its second (block 3) went to a.
    b_first = 5 if prefix_caching else 9
    assert run_step(sched, {"b": 23, "c": 31}) == [("b", b_first, True), ("c", 3, True)]
    assert b.block_ids == [2, 3, 1] and c.status == St.FINISHED_LENGTH
    assert b.num_cached_prompt_tokens == 0  # counted at first admission only
    assert run_step(sched, {"b": 24}) == [("b", 1, True)]
    assert b.output_token_ids == [21, 22, 23, 24] and b.status == St.FINISHED_LENGTH
    assert all_free(sched) and not sched.has_unfinished


def test_a_step_that_preempts_admits_nothing() -> None:
    """A sequence that cannot grow and is the newest preempts itself; though a chunk of it
    would fit in the blocks it just freed, it is only readmitted on the next step."""
    sched = make_scheduler(num_kv_blocks=5, max_num_batched_tokens=5, enable_prefix_caching=False,
                           preemption_mode="recompute")
    a, b = add_seq(sched, "a", 3), add_seq(sched, "b", 3)
    assert run_step(sched) == [("a", 3, True), ("b", 2, False)]
    for _ in range(6):  # pool fills: a [0, 2, 4], b [1, 3]
        assert run_step(sched) == [("a", 1, True), ("b", 1, True)]
    assert (a.block_ids, b.block_ids, b.num_tokens) == ([0, 2, 4], [1, 3], 9)
    assert run_step(sched) == [("a", 1, True)]  # b needed a 3rd block: preempted itself
    assert list(sched.block_manager.free_block_ids) == [3, 1] and list(sched.waiting) == [b]
    assert run_step(sched) == [("a", 1, True), ("b", 4, False)] and b.block_ids == [3]


@pytest.mark.parametrize("params, max_model_len, tokens, status", [
    (dict(), None, [7, EOS], St.FINISHED_STOPPED),
    (dict(ignore_eos=True, max_tokens=3), None, [EOS, EOS, EOS], St.FINISHED_LENGTH),
    (dict(stop_token_ids=(42,)), None, [41, 7, 42], St.FINISHED_STOPPED),
    (dict(max_tokens=3), None, [7, 8, 9], St.FINISHED_LENGTH),
    (dict(max_tokens=50), 12, [7, 8, 9], St.FINISHED_LENGTH),  # prompt 9 + 3 = max_model_len
])
def test_stop_conditions(params: dict, max_model_len: int | None, tokens: list[int], status: St) -> None:
    """EOS, stop_token_ids, max_tokens and max_model_len end a request on the exact token."""
    sched = make_scheduler(max_model_len=max_model_len)
    params.setdefault("max_tokens", 100)
    seq = add_seq(sched, "a", 9, **params)
    for i, t in enumerate(tokens):
        assert seq.status == (St.WAITING if i == 0 else St.RUNNING)
        run_step(sched, t)
    assert seq.status == status and seq.output_token_ids == tokens
    assert seq.block_ids == [] and not sched.has_unfinished and all_free(sched)


def test_abort_from_waiting_and_running_frees_every_block() -> None:
    """Abort finds a request in either queue, marks it aborted and drops its references."""
    sched = make_scheduler(num_kv_blocks=8, max_num_batched_tokens=9)
    bm = sched.block_manager
    a = add_seq(sched, "a", list(range(10, 19)))
    run_step(sched)  # a: blocks 0, 1 full and cached
    b = add_seq(sched, "b", list(range(10, 18)) + list(range(50, 60)))
    c = add_seq(sched, "c", 4)
    assert run_step(sched) == [("a", 1, True), ("b", 8, False)]  # b: 8 cached + an 8-token chunk
    assert (a.block_ids, b.block_ids, bm.ref_counts[:5]) == ([0, 1, 2], [0, 1, 3, 4], [2, 2, 1, 1, 1])
    assert b.num_cached_prompt_tokens == 8
    assert sched.abort("b") is b and b.status == St.FINISHED_ABORTED and b.finish_reason == "abort"
    assert b.block_ids == [] and bm.ref_counts[:5] == [1, 1, 1, 0, 0]
    assert list(bm.free_block_ids) == [5, 6, 7, 4, 3] and sched.running == [a]
    assert sched.abort("b") is None and sched.abort("nope") is None
    assert sched.abort("c") is c and c.status == St.FINISHED_ABORTED and not sched.waiting
    assert sched.abort("a") is a and a.status == St.FINISHED_ABORTED
    assert all_free(sched) and not sched.has_unfinished


# -- property test: random workloads with random aborts --------------------------------------


def test_a_flood_of_prompts_never_starves_running_decodes() -> None:
    """Colocated: three requests decode while a long prompt that arrived before them (a
    preempted one resumes with its place in line) prefills, and two more long prompts arrive
    every step. Prefill chunks fill the budget, yet every running decode gets its token in
    every step (the starvation guard: decodes are scheduled before any prefill chunk)."""
    sched = make_scheduler(num_kv_blocks=4096, block_size=4, max_num_batched_tokens=64, max_num_seqs=64,
                   enable_chunked_prefill=True)
    decoders = [add_seq(sched, f"d{i}", 3) for i in range(3)]
    run_step(sched)
    assert all(d.num_output_tokens == 1 for d in decoders)
    older = add_seq(sched, "older-long", 400, arrival=-1)  # first in line by arrival
    for step in range(40):
        for j in range(2):
            add_seq(sched, f"flood-{step}-{j}", 200)
        before = {d.request_id: d.num_output_tokens for d in decoders}
        entries = run_step(sched)
        assert sum(n for _, n, _ in entries) == 64, "the budget is full every step"
        assert [e for e in entries if e[0] in before] == [(rid, 1, True) for rid in before], (step, entries)
        assert all(d.num_output_tokens == before[d.request_id] + 1 for d in decoders)
    assert older.num_output_tokens > 1, "the older prompt had the rest of the budget first, and decodes too"
