"""Prefill packing (tandem/engine/prefill_policy.py): each step fills its token budget with
prompt chunks of several sequences; a short prompt never waits behind a long one being
chunked for more than one chunk of it; the long one still advances every step, and long
prompts start in arrival order. Exact per-step schedules, driven through the scheduler
harness (no model is loaded)."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import MODEL, add_seq, all_free, make_scheduler, run_step

from tandem.config import EngineConfig


def test_several_prompts_fill_the_budget_around_a_long_one() -> None:
    """Whole prompts in arrival order, then the long one's first chunk takes the rest; next
    step the long one's chunk is capped at 32 so the two new prompts fit, and it gets the
    rest of the budget back."""
    sched = make_scheduler(num_kv_blocks=512, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    for rid, n in (("a", 10), ("b", 20), ("c", 15), ("long", 400)):
        add_seq(sched, rid, n)
    assert run_step(sched) == [("a", 10, True), ("b", 20, True), ("c", 15, True), ("long", 19, False)]
    add_seq(sched, "d", 8), add_seq(sched, "e", 12)
    assert run_step(sched) == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("long", 41, False),
                               ("d", 8, True), ("e", 12, True)]
    assert run_step(sched) == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 1, True), ("e", 1, True),
                               ("long", 59, False)]


def test_short_prompts_behind_a_long_one_wait_for_one_chunk_of_it() -> None:
    """The issue's case: a 2000-token prompt, then five 20-token ones, budget 256 (threshold:
    half of it by default). The short ones start after the long one's first chunk, not after
    its eighth; one arriving mid-way starts on the next step; the long one takes what they
    leave and finishes one step later than alone."""
    sched = make_scheduler(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=256)
    assert sched.config.long_prefill_token_threshold == 128
    long = add_seq(sched, "long", 2000)
    shorts = [add_seq(sched, f"s{i}", 20) for i in range(5)]
    assert run_step(sched) == [("long", 256, False)]
    assert run_step(sched) == [("long", 156, False)] + [(s.request_id, 20, True) for s in shorts]
    add_seq(sched, "late", 20)
    decodes = [(s.request_id, 1, True) for s in shorts]
    assert run_step(sched) == decodes + [("long", 231, False), ("late", 20, True)]
    decodes.append(("late", 1, True))
    for _ in range(5):
        assert run_step(sched) == decodes + [("long", 250, False)]
    assert run_step(sched) == decodes + [("long", 107, True)]
    assert long.num_computed_tokens == 2000 and long.num_output_tokens == 1


def test_long_prompts_start_in_arrival_order_and_short_ones_pass_them() -> None:
    """A second long prompt waits for the first (it only takes what the first leaves on its
    last step), while a short prompt that arrives behind both starts at once."""
    sched = make_scheduler(num_kv_blocks=512, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    add_seq(sched, "L1", 300, max_tokens=1), add_seq(sched, "L2", 300, max_tokens=1)
    assert run_step(sched) == [("L1", 64, False)]
    add_seq(sched, "s", 10, max_tokens=1)
    assert run_step(sched) == [("L1", 54, False), ("s", 10, True)]
    assert run_step(sched) == [("L1", 64, False)]
    assert run_step(sched) == [("L1", 64, False)]
    assert run_step(sched) == [("L1", 54, True), ("L2", 10, False)]
    add_seq(sched, "t", 10, max_tokens=1)
    assert run_step(sched) == [("L2", 54, False), ("t", 10, True)]
    for _ in range(3):
        assert run_step(sched) == [("L2", 64, False)]
    assert run_step(sched) == [("L2", 44, True)]
    assert not sched.has_unfinished and all_free(sched)


def test_a_stream_of_short_prompts_never_starves_the_long_one() -> None:
    """Three 10-token prompts arrive every step: each starts on the step after it arrives,
    and the long one takes the 34 tokens they leave (more than its threshold of 32); a burst
    of five more than fit starts over two steps, the long one still getting its 32."""
    sched = make_scheduler(num_kv_blocks=1024, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    long = add_seq(sched, "long", 600, max_tokens=1)
    assert run_step(sched) == [("long", 64, False)]
    for step in range(10):
        shorts = [add_seq(sched, f"s{step}-{j}", 10, max_tokens=1).request_id for j in range(3)]
        assert run_step(sched) == [("long", 34, False)] + [(rid, 10, True) for rid in shorts]
    burst = [add_seq(sched, f"b{j}", 10, max_tokens=1).request_id for j in range(5)]
    assert run_step(sched) == [("long", 34, False)] + [(rid, 10, True) for rid in burst[:3]]
    assert run_step(sched) == [("long", 44, False)] + [(rid, 10, True) for rid in burst[3:]]
    assert long.num_computed_tokens == 64 + 11 * 34 + 44


@pytest.mark.parametrize("seed", range(40))
def test_random_mixes_keep_the_budget_and_the_guarantees(seed: int) -> None:
    """Random short and long prompts (blocks to spare), checked every step: the budget is
    never exceeded and is full while there is work; the oldest prompt being chunked gets at
    least ``min(threshold, budget left by decodes, what it has left)``; no prompt left
    waiting would have fitted in the tokens given to chunks past their threshold (or left
    unused); a prompt starts chunked only when no older prompt is left waiting."""
    rng = random.Random(seed)
    budget, threshold = rng.choice([(32, 16), (64, 32), (64, 48), (100, 50)])
    sched = make_scheduler(num_kv_blocks=8192, block_size=rng.choice([1, 4, 16]), max_num_batched_tokens=budget,
                           long_prefill_token_threshold=threshold, max_num_seqs=1024)
    for step in range(80):
        for j in range(rng.choice([0, 0, 1, 2, 3])):
            n = rng.choice([rng.randint(1, 12), rng.randint(budget, 5 * budget)])
            add_seq(sched, f"r{step}-{j}", n, max_tokens=rng.randint(1, 4))
        work = sum(s.num_uncomputed_tokens for s in (*sched.running, *sched.waiting))
        num_decodes = sum(s.num_uncomputed_tokens == 1 for s in sched.running)
        partial = [s for s in sched.running if s.num_uncomputed_tokens > 1]
        left = {s.request_id: s.num_uncomputed_tokens for s in partial}
        waiting = list(sched.waiting)
        entries = run_step(sched)
        got = {rid: n for rid, n, _ in entries}
        chunked = {rid for rid, _, samples in entries if not samples}
        total = sum(got.values())
        assert total == min(budget, work), entries
        if partial:
            oldest = min(partial, key=lambda s: s.arrival_index)
            assert got[oldest.request_id] >= min(threshold, budget - num_decodes, left[oldest.request_id]), entries
        past_threshold = sum(max(0, got[s.request_id] - threshold) for s in partial)
        still_waiting = [s for s in waiting if s in sched.waiting]
        assert all(s.num_tokens > past_threshold + budget - total for s in still_waiting), entries
        started_chunked = [s for s in waiting if s.request_id in chunked]
        assert len(started_chunked) <= 1
        assert all(s.arrival_index < w.arrival_index for s in started_chunked for w in still_waiting), entries


def test_a_prompt_fits_by_its_uncached_tokens() -> None:
    """A 42-token prompt whose first 32 tokens the long one has just computed (and cached)
    needs only 10 more: it fits in the 16 the long one leaves, and starts at once."""
    sched = make_scheduler(num_kv_blocks=64, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    prompt = list(range(500, 564))
    add_seq(sched, "long", prompt)
    assert run_step(sched) == [("long", 32, False)]
    follow = add_seq(sched, "follow", prompt[:32] + list(range(900, 910)))
    assert run_step(sched) == [("long", 22, False), ("follow", 10, True)]
    assert follow.num_cached_prompt_tokens == 32


def test_a_decode_that_preempts_itself_lets_an_older_chunked_prompt_run() -> None:
    """The newer sequence decodes while the older one is chunked (2 tokens capped + 1 back);
    when the newer one needs a block and none is free it gives way, and the older one's chunk
    runs in the block it gave back (the step is not left empty)."""
    sched = make_scheduler(num_kv_blocks=4, max_num_batched_tokens=4, enable_prefix_caching=False,
                           preemption_mode="recompute")
    assert sched.config.long_prefill_token_threshold == 2
    new = add_seq(sched, "new", 1, arrival=10**6 + 1, max_tokens=20)
    add_seq(sched, "old", 14, arrival=10**6, max_tokens=2)
    for _ in range(4):
        assert run_step(sched) == [("new", 1, True), ("old", 3, False)]
    assert run_step(sched) == [("old", 2, True)]
    assert list(sched.waiting) == [new] and sched.preemptor.num_preemptions == 1


def test_the_threshold_option() -> None:
    """Half the budget by default, at least 1, at most the budget; no cap without chunking."""
    build = lambda **kw: EngineConfig.build(MODEL, num_kv_blocks=64, block_size=4, **kw)  # noqa: E731
    assert build(max_num_batched_tokens=256).long_prefill_token_threshold == 128
    assert build(max_num_batched_tokens=1).long_prefill_token_threshold == 1
    assert build(max_num_batched_tokens=64, long_prefill_token_threshold=500).long_prefill_token_threshold == 64
    no_chunks = build(max_model_len=200, max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert no_chunks.long_prefill_token_threshold == no_chunks.max_num_batched_tokens == 200
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        build(long_prefill_token_threshold=0)
