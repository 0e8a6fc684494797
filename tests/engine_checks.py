"""Checks every engine test shares."""

from __future__ import annotations

from tandem import LLM


def assert_all_blocks_free(llm: LLM) -> None:
    """Every block back in the pool (device and host), nothing queued: the state every exit
    path must leave."""
    bm, sched = llm.engine.block_manager, llm.engine.scheduler
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)
    assert sched.preemptor.swap_pool.num_free_blocks == sched.preemptor.swap_pool.num_blocks
    assert not sched.waiting and not sched.running and not sched.swapped
    assert not llm.engine.sequences
