"""Checks every engine test shares."""

from __future__ import annotations

from tandem import LLM


def assert_all_blocks_free(llm: LLM) -> None:
    """Every block back in the pool, nothing queued: the state every exit path must leave."""
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
    assert not llm.engine.sequences
