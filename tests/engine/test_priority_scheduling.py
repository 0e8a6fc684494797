"""Priority scheduling (--scheduling-policy priority, vLLM's semantics) against fcfs, with exact
orders: which request is admitted when, which running one gives way to a preemption, where a
preempted one waits and when it comes back. The scheduler harness and an engine over a
scripted runner: pure Python, no weights."""

from __future__ import annotations

from typing import Any, cast

import pytest
from scheduler_harness import MODEL, all_free, make_scheduler, run_step

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampler import StepOutput
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.sequence import SequenceStatus as St
from tandem.sampling_params import SamplingParams


class _ScriptedRunner:
    """Runs no model: every sample target draws token 7; records each step's request ids."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def swap(self, batch: ScheduledBatch) -> None:
        pass

    def run(self, batch: ScheduledBatch, *args) -> StepOutput:
        self.steps.append([s.request_id for s in batch.seqs])
        num_targets = sum(len(batch.sample_targets(i)) for i in range(len(batch.seqs)))
        return StepOutput([[7]] * num_targets, [[-0.5]] * num_targets)


def _engine(scheduling_policy: str, **kw) -> tuple[LLMEngine, _ScriptedRunner]:
    cfg = EngineConfig.build(MODEL, num_kv_blocks=kw.pop("num_kv_blocks", 32), block_size=4,
                             scheduling_policy=scheduling_policy, **kw)
    runner = _ScriptedRunner()
    return LLMEngine(cfg, cast(Any, None), runner=cast(Any, runner)), runner


def _admission_order(engine: LLMEngine, runner: _ScriptedRunner) -> list[str]:
    """Step until nothing is left -> the request ids in the order they first ran."""
    while engine.has_unfinished:
        engine.step()
    order: list[str] = []
    for rid in (r for step in runner.steps for r in step):
        if rid not in order:
            order.append(rid)
    return order


def _add(engine: LLMEngine, priorities: dict[str, int], **params) -> None:
    for i, (rid, priority) in enumerate(priorities.items()):
        engine.add_request(rid, list(range(100 + 10 * i, 105 + 10 * i)), SamplingParams(max_tokens=2, **params),
                           priority=priority)


def test_one_at_a_time_requests_are_admitted_by_priority_then_arrival():
    engine, runner = _engine("priority", max_num_seqs=1)
    _add(engine, {"a": 2, "b": 0, "c": 1, "d": 0})
    assert _admission_order(engine, runner) == ["b", "d", "c", "a"]
    # Each ran alone to its end: one prompt step, one decode step.
    assert runner.steps == [["b"], ["b"], ["d"], ["d"], ["c"], ["c"], ["a"], ["a"]]
    assert engine.inventory().num_free_blocks == 32


def test_fcfs_keeps_arrival_order():
    engine, runner = _engine("fcfs", max_num_seqs=1)
    _add(engine, {"a": 0, "b": 0, "c": 0, "d": 0})
    assert _admission_order(engine, runner) == ["a", "b", "c", "d"]
    engine, runner = _engine("priority", max_num_seqs=1)  # equal priorities: arrival order too
    _add(engine, {"a": 4, "b": 4, "c": 4, "d": 4})
    assert _admission_order(engine, runner) == ["a", "b", "c", "d"]


def test_a_later_request_of_higher_priority_passes_the_waiting_ones_not_the_running_one():
    engine, runner = _engine("priority", max_num_seqs=1)
    _add(engine, {"low": 5, "mid": 3})
    engine.step()  # mid runs (alone)
    engine.add_request("high", list(range(300, 305)), SamplingParams(max_tokens=2), priority=-1)
    assert _admission_order(engine, runner) == ["mid", "high", "low"]
    assert engine.scheduler.preemptor.num_preemptions == 0


def test_fcfs_refuses_a_nonzero_priority_and_keeps_nothing():
    engine, _ = _engine("fcfs")
    with pytest.raises(ValueError, match=r"^priority 1 needs the priority scheduling policy"):
        engine.add_request("a", [5, 6, 7], SamplingParams(), priority=1)
    with pytest.raises(ValueError, match=r"^priority must be an integer, got str"):
        engine.add_request("a", [5, 6, 7], SamplingParams(), priority=cast(int, "1"))
    with pytest.raises(ValueError, match=r"^priority 2 needs"):
        engine.check_request("a", [5, 6, 7], 2)
    with pytest.raises(ValueError, match=r"^priority -1 needs"):
        engine.reserve_prefilled("a", [5, 6, 7], SamplingParams(), priority=-1)
    assert engine.get_sequence("a") is None and not engine.has_unfinished
    engine.add_request("a", [5, 6, 7], SamplingParams(), priority=0)  # the default is always taken


def test_a_decode_workers_reservation_and_the_forks_keep_the_priority():
    engine, _ = _engine("priority")
    assert engine.reserve_prefilled("r", [5, 6, 7], SamplingParams(), priority=4) is not None
    reserved = engine.get_sequence("r")
    assert reserved is not None and reserved.priority == 4
    group = engine.add_request("n", [8, 9, 10], SamplingParams(n=3, max_tokens=3), priority=-2).group
    engine.step()  # the prompt's first sample: the other completions fork from it
    assert group is not None and [s.priority for s in group.completions] == [-2, -2, -2]
    assert all(s in engine.scheduler.running for s in group.completions)


def _queued(sched: Scheduler, rid: str, num_tokens: int, priority: int, arrival: int, max_tokens: int = 20) -> Sequence:
    s = Sequence(rid, list(range(1000 * (arrival + 1), 1000 * (arrival + 1) + num_tokens)),
                 SamplingParams(max_tokens=max_tokens), arrival)
    s.priority = priority  # NOTE: before it is queued: the queue orders it as it comes
    sched.add(s)
    return s


def _four_decoding(policy: str, priorities: tuple[int, int, int, int], **kw) -> tuple[Scheduler, list[Sequence]]:
    """a, b, c, d (arrival order; 4-token prompts, one block of 4 each; a and c end after 4
    tokens) run their prompts in 5 blocks; at their first decode each needs a second block,
    and only one is free."""
    sched = make_scheduler(num_kv_blocks=5, scheduling_policy=policy, **kw)
    seqs = [_queued(sched, rid, 4, priority, arrival, 4 if rid in "ac" else 20)
            for arrival, (rid, priority) in enumerate(zip("abcd", priorities))]
    assert sorted(run_step(sched)) == [(r, 4, True) for r in "abcd"]  # (admitted in rank order)
    return sched, seqs


def test_preemption_takes_the_lowest_priority_latest_arrival_first():
    """Priorities a 0, b 2, c 1, d 2: served a, c, b, d; a takes the free block, c preempts
    d (priority 2, the later arrival), b then finds none left and gives way itself."""
    sched, (a, b, c, d) = _four_decoding("priority", (0, 2, 1, 2), preemption_mode="recompute")
    assert run_step(sched) == [("a", 1, True), ("c", 1, True)]
    assert (b.status, d.status, sched.preemptor.num_preemptions) == (St.WAITING, St.WAITING, 2)
    assert [s.request_id for s in sched.waiting] == ["b", "d"]  # by priority, then arrival
    assert [s.request_id for s in sched.running] == ["a", "c"]


def test_fcfs_preempts_the_newest_first():
    """The same requests under fcfs: served a, b, c, d; b preempts d, c gives way itself,
    and both recompute before anything newer, oldest first."""
    sched, (a, b, c, d) = _four_decoding("fcfs", (0, 0, 0, 0), preemption_mode="recompute")
    assert run_step(sched) == [("a", 1, True), ("b", 1, True)]
    assert [s.request_id for s in sched.waiting] == ["c", "d"] and sched.preemptor.num_preemptions == 2


def test_swapped_sequences_resume_by_priority_and_a_higher_one_may_pass_them():
    """Priorities a 0, b 2, c 1, d 1: c preempts b (the lowest), d then gives way itself;
    swapped out, they wait in rank order d, b (not arrival order). A new request e that
    outranks them is admitted while they cannot come back (one block free, each needs two);
    one that ranks after them waits. Once a, c and e end they come back d first, then it starts."""
    sched, (a, b, c, d) = _four_decoding("priority", (0, 2, 1, 1), preemption_mode="swap")
    assert run_step(sched) == [("a", 1, True), ("c", 1, True)]
    assert [s.request_id for s in sched.swapped] == ["d", "b"] and not sched.waiting
    _queued(sched, "e", 3, 0, 100, max_tokens=2)
    assert run_step(sched) == [("a", 1, True), ("c", 1, True), ("e", 3, True)]
    low = _queued(sched, "low", 3, 5, 101, max_tokens=1)
    assert run_step(sched) == [("a", 1, True), ("e", 1, True), ("c", 1, True)]  # a, c and e end
    assert [s.request_id for s in sched.swapped] == ["d", "b"] and list(sched.waiting) == [low]
    host_blocks = d.host_block_ids + b.host_block_ids
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("d", 1), ("b", 1), ("low", 3)]
    assert [host for host, _ in batch.swap_in] == host_blocks  # d's KV first


def test_fcfs_admits_nothing_while_a_swapped_sequence_waits():
    sched, (a, b, c, d) = _four_decoding("fcfs", (0, 0, 0, 0), preemption_mode="swap")
    assert run_step(sched) == [("a", 1, True), ("b", 1, True)]
    assert [s.request_id for s in sched.swapped] == ["c", "d"]
    _queued(sched, "e", 3, 0, 100, max_tokens=2)
    assert run_step(sched) == [("a", 1, True), ("b", 1, True)]  # e waits behind c and d


def test_abort_and_the_end_leave_nothing_under_priority():
    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    a = _queued(sched, "a", 5, 0, 0, max_tokens=2)
    _queued(sched, "b", 5, -1, 1, max_tokens=2)
    assert run_step(sched) == [("b", 5, True)]
    assert sched.abort("a") is a and not sched.waiting
    assert run_step(sched) == [("b", 1, True)]
    assert not sched.has_unfinished and all_free(sched)
