"""LLMEngine's API for its workers: load, inventory and counters (snapshots read between
steps), kept blocks released later, reservations released by abort, and the prefill hooks
run inside the step. A scripted runner stands in for the model: pure Python, no weights."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from scheduler_harness import MODEL

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.hooks import PrefillHooks
from tandem.engine.sampler import StepOutput
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import FinishReason
from tandem.engine.snapshots import EngineCounters, EngineInventory, EngineLoad
from tandem.sampling_params import SamplingParams


class _ScriptedRunner:
    """Runs no model: every sample target draws TOKEN; the step's layers are reported stored."""

    TOKEN = 7
    NUM_LAYERS = 2

    def __init__(self) -> None:
        self.send_slots: list[np.ndarray | None] = []

    def swap(self, batch: ScheduledBatch) -> None:
        pass

    def run(self, batch: ScheduledBatch, on_layer_stored=None, send_slots: np.ndarray | None = None) -> StepOutput:
        self.send_slots.append(send_slots)
        if on_layer_stored is not None:
            for layer in range(self.NUM_LAYERS):
                on_layer_stored(layer)
        num_targets = sum(len(batch.sample_targets(i)) for i in range(len(batch.seqs)))
        return StepOutput([[self.TOKEN]] * num_targets, [[-0.5]] * num_targets)


def _engine(num_kv_blocks: int = 8, hooks: PrefillHooks | None = None, runner: _ScriptedRunner | None = None,
            **kw) -> LLMEngine:
    """No model, and the scripted runner (a fresh one unless given) standing in for ModelRunner:
    a step calls only its swap and run."""
    cfg = EngineConfig.build(MODEL, num_kv_blocks=num_kv_blocks, block_size=4, **kw)
    return LLMEngine(cfg, cast(Any, None), runner=cast(Any, runner or _ScriptedRunner()), hooks=hooks)


def _at_rest(num_blocks: int) -> EngineInventory:
    return EngineInventory(num_requests=0, num_waiting=0, num_running=0, num_reserved=0, num_blocks=num_blocks,
                           num_free_blocks=num_blocks, num_referenced_blocks=0, num_swapped_blocks=0)


def test_kept_blocks_outlive_their_request_until_released() -> None:
    """A prefill worker's request ends at its first token but keeps blocks 0, 1 (their KV is
    still being sent); released, they go back tail first, as a freed request's do."""
    engine = _engine()
    seq = engine.add_request("a", list(range(100, 107)), SamplingParams(max_tokens=1), keep_blocks=True)
    (delta,) = engine.step()
    assert delta.request_finished and delta.finish_reason is FinishReason.LENGTH
    assert engine.get_sequence("a") is None and seq.block_ids == [0, 1]
    held = engine.inventory()
    assert (held.num_requests, held.num_free_blocks, held.num_referenced_blocks) == (0, 6, 2)
    assert list(engine.block_manager.free_block_ids) == [2, 3, 4, 5, 6, 7]
    engine.release_blocks(seq)
    assert list(engine.block_manager.free_block_ids) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert engine.inventory() == _at_rest(8) and seq.block_ids == []


def test_unkept_blocks_are_freed_when_the_request_ends() -> None:
    engine = _engine()
    engine.add_request("a", list(range(100, 107)), SamplingParams(max_tokens=1))
    engine.step()
    assert list(engine.block_manager.free_block_ids) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert engine.inventory() == _at_rest(8)


def test_a_reservation_holds_its_blocks_until_abort_releases_exactly_them() -> None:
    """Beside a running request on block 0, a 9-token reservation gets blocks 1-3; aborted,
    exactly those come back and the running request keeps its own."""
    engine = _engine()
    engine.add_request("x", list(range(100, 103)), SamplingParams(max_tokens=5))
    engine.step()
    assert engine.reserve_prefilled("r", list(range(200, 209)), SamplingParams(max_tokens=5)) == [1, 2, 3]
    reserved = engine.get_sequence("r")
    assert reserved is not None and reserved.num_cached_prompt_tokens == 0
    held = engine.inventory()
    assert (held.num_requests, held.num_running, held.num_reserved, held.num_free_blocks) == (2, 1, 1, 4)
    delta = engine.abort_request("r")
    assert delta is not None and delta.finish_reason is FinishReason.ABORT and engine.get_sequence("r") is None
    assert list(engine.block_manager.free_block_ids) == [4, 5, 6, 7, 3, 2, 1]
    assert engine.inventory().num_reserved == 0 and engine.abort_request("r") is None


def test_load_counts_the_waiting_sequences_tokens() -> None:
    """Under a 16-token budget a (10) runs whole, b (10) a 6-token chunk, c (3) waits: only
    c's tokens are queued; b's rest belongs to a running sequence."""
    engine = _engine(num_kv_blocks=64, max_num_batched_tokens=16)
    for rid, start, n in (("a", 100, 10), ("b", 200, 10), ("c", 300, 3)):
        engine.add_request(rid, list(range(start, start + n)), SamplingParams(max_tokens=5))
    assert engine.load() == EngineLoad(num_requests=3, num_waiting=3, num_running=0, num_queued_tokens=23,
                                       num_blocks=64, num_free_blocks=64)
    engine.step()
    load = engine.load()
    assert load == EngineLoad(num_requests=3, num_waiting=1, num_running=2, num_queued_tokens=3,
                              num_blocks=64, num_free_blocks=59)
    assert load.num_used_blocks == 5


def test_counters_and_inventory_follow_a_swap_out_and_back() -> None:
    """a and b fill the 4 blocks; a's third token needs a block, so b's 2 computed blocks
    are swapped out (counted, held on the host, b neither reserved nor running) and back."""
    engine = _engine(num_kv_blocks=4, preemption_mode="swap")
    engine.add_request("a", list(range(100, 107)), SamplingParams(max_tokens=3))
    engine.add_request("b", list(range(200, 207)), SamplingParams(max_tokens=4))
    engine.step(), engine.step()
    assert engine.counters() == EngineCounters(0, 0, 0, 0, 0)
    engine.step()  # a takes b's blocks and ends
    assert engine.counters() == EngineCounters(num_preemptions=1, num_swapped_out_blocks=2, num_swapped_in_blocks=0,
                                               num_draft_tokens=0, num_accepted_draft_tokens=0)
    assert engine.inventory() == EngineInventory(
        num_requests=1, num_waiting=0, num_running=0, num_reserved=0, num_blocks=4, num_free_blocks=4,
        num_referenced_blocks=0, num_swapped_blocks=2)
    while engine.has_unfinished:
        engine.step()
    assert engine.counters().num_swapped_in_blocks == 2 and engine.inventory() == _at_rest(4)


def test_check_request_refuses_what_add_request_would() -> None:
    engine = _engine()
    engine.add_request("a", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.check_request("a", [5, 6])
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.check_request("b", [])
    engine.check_request("b", [5, 6])
    assert engine.get_sequence("b") is None


def test_prefill_hooks_run_inside_the_step() -> None:
    """send_plan is asked before the forward and its slots go to the runner; each layer is
    reported with the step's batch; on_delta sees the step's deltas at its end."""
    events: list[tuple] = []

    def send_plan(batch: ScheduledBatch) -> np.ndarray:
        events.append(("plan", [s.request_id for s in batch.seqs]))
        return np.array([4, 5, 6])

    hooks = PrefillHooks(on_layer_stored=lambda batch, layer: events.append(("layer", batch.seqs[0].request_id, layer)),
                         on_delta=lambda d: events.append(("delta", d.request_id, d.new_token_ids)),
                         send_plan=send_plan)
    runner = _ScriptedRunner()
    engine = _engine(hooks=hooks, runner=runner)
    engine.add_request("a", [10, 11, 12], SamplingParams(max_tokens=1))
    deltas = engine.step()
    assert [d.request_id for d in deltas] == ["a"]
    assert events == [("plan", ["a"]), ("layer", "a", 0), ("layer", "a", 1), ("delta", "a", [7])]
    slots = runner.send_slots[0]
    assert slots is not None and slots.tolist() == [4, 5, 6]


def test_without_hooks_the_runner_gets_none() -> None:
    runner = _ScriptedRunner()
    engine = _engine(runner=runner)
    engine.add_request("a", [10, 11, 12], SamplingParams(max_tokens=1))
    engine.step()
    assert runner.send_slots == [None]
