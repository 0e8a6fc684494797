"""reserve_whole_prompts (a prefill worker's engine): a prompt takes blocks for all of itself
at admission, so its later chunks never need one and nothing is preempted while transfers
read the blocks. Without it the same load preempts a prompt mid-prefill: its finished
neighbours keep their blocks until their transfers end (keep_blocks), and the blocks its
next chunk needs are not there."""

from __future__ import annotations

from typing import Any

from scheduler_harness import add_seq, all_free, make_scheduler, run_step

from tandem.engine.sequence import SequenceStatus

SETTINGS: dict[str, Any] = dict(num_kv_blocks=4, block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=3,
                enable_prefix_caching=False, preemption_mode="recompute")
PROMPT_LENS = (6, 11, 5, 4)
TRANSFER_STEPS = 3
"""Steps a finished prompt's blocks stay held after its end, as its KV transfer reads them."""


def run_prompts(reserve: bool) -> tuple[int, list[dict[str, list[int]]]]:
    """-> the preemptions, and every prompt's blocks after each step (its transfer held
    them TRANSFER_STEPS steps past its end, then they were released as a DONE event does)."""
    sched = make_scheduler(reserve_whole_prompts=reserve, **SETTINGS)
    seqs = [add_seq(sched, f"p{i}", n, max_tokens=1) for i, n in enumerate(PROMPT_LENS)]
    for seq in seqs:
        seq.keep_blocks = True
    ended_at: dict[str, int] = {}
    blocks: list[dict[str, list[int]]] = []
    for step in range(40):
        if sched.has_unfinished:
            run_step(sched)
        for seq in seqs:
            if seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                continue
            if step - ended_at.setdefault(seq.request_id, step) == TRANSFER_STEPS:
                sched.block_manager.free(seq)
        blocks.append({s.request_id: list(s.block_ids) for s in seqs})
        if not sched.has_unfinished and not any(s.block_ids for s in seqs):
            break
    assert all_free(sched) and all(s.status == SequenceStatus.FINISHED_LENGTH for s in seqs)
    return sched.preemptor.num_preemptions, blocks


def test_a_prompt_takes_all_its_blocks_at_admission_and_nothing_is_preempted() -> None:
    preemptions, blocks = run_prompts(reserve=True)
    assert preemptions == 0
    # p0 runs whole; p1 (11 tokens: 3 blocks) waits until p0's transfer lets go of its 2
    # blocks, then takes all 3 with its first chunk and keeps exactly those; p2 and p3 follow.
    assert [b["p0"] for b in blocks[:4]] == [[0, 1]] * 3 + [[]]
    assert [b["p1"] for b in blocks[:9]] == [[]] * 4 + [[2, 3, 1]] * 4 + [[]]
    assert blocks[9] == {"p0": [], "p1": [], "p2": [0, 1], "p3": [3]}


def test_without_it_the_same_prompts_preempt_one_mid_prefill() -> None:
    preemptions, _ = run_prompts(reserve=False)
    assert preemptions == 1
