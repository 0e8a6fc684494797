"""The waiting queues, one per --scheduling-policy: their order, where a preempted sequence goes
back, what may pass a swapped-out sequence, and which priorities each takes. Pure Python."""

from __future__ import annotations

import pytest
from scheduler_harness import MODEL

from tandem.config import EngineConfig
from tandem.config.engine_options import ENGINE_DEFAULTS, SCHEDULING_POLICIES
from tandem.engine.sequence import Sequence
from tandem.engine.waiting_queue import WAITING_QUEUES, FCFSQueue, PriorityQueue, make_waiting_queue
from tandem.sampling_params import SamplingParams


def seq(rid: str, arrival: int, priority: int = 0) -> Sequence:
    s = Sequence(rid, [1, 2, 3], SamplingParams(), arrival)
    s.priority = priority
    return s


def ids(queue) -> list[str]:
    return [s.request_id for s in queue]


def test_the_registry_is_the_flags_choices():
    assert tuple(WAITING_QUEUES) == SCHEDULING_POLICIES == ("fcfs", "priority")
    assert ENGINE_DEFAULTS["scheduling_policy"] == "fcfs"
    assert all(WAITING_QUEUES[name].name == name for name in WAITING_QUEUES)
    assert type(make_waiting_queue("priority")) is PriorityQueue
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        make_waiting_queue("lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig.build(MODEL, num_kv_blocks=8, scheduling_policy="lifo")
    assert EngineConfig.build(MODEL, num_kv_blocks=8).scheduling_policy == "fcfs"


def test_fcfs_is_arrival_order_and_a_preempted_sequence_goes_first():
    q = FCFSQueue()
    a, b, c, d = seq("a", 0), seq("b", 1), seq("c", 2), seq("d", 3)
    for s in (b, c, d):
        q.add(s)
    q.requeue(a)
    assert ids(q) == ["a", "b", "c", "d"] and len(q) == 4 and q[0] is a and q[-1] is d and c in q
    q.requeue(seq("z", 9))  # in front even of older ones: it ran before
    assert ids(q)[:2] == ["z", "a"]
    q.remove(c)
    assert ids(q) == ["z", "a", "b", "d"] and c not in q
    # Nothing waiting passes a swapped-out sequence.
    assert q.admissible(seq("s", 99)) == [] and ids(q.admissible(None)) == ["z", "a", "b", "d"]


def test_priority_is_lower_first_then_arrival_order():
    q = PriorityQueue()
    for rid, arrival, priority in (("a", 0, 2), ("b", 1, 0), ("c", 2, 1), ("d", 3, 0), ("e", 4, -5)):
        q.add(seq(rid, arrival, priority))
    assert ids(q) == ["e", "b", "d", "c", "a"]
    # A preempted sequence goes back by its rank: among its priority's, by its own arrival.
    q.requeue(seq("old", -1, 0))
    q.requeue(seq("late", 10, 1))
    assert ids(q) == ["e", "old", "b", "d", "c", "late", "a"]
    # Of equal rank (a request's forks), the one preempted goes first; a new one goes last.
    twin = seq("twin", 1, 0)
    q.requeue(twin)
    assert ids(q)[1:5] == ["old", "twin", "b", "d"]
    q.remove(twin)
    # Only the waiting sequences that outrank the first swapped-out one pass it.
    assert ids(q.admissible(seq("s", 5, 0))) == ["e", "old", "b", "d"]
    assert ids(q.admissible(seq("s", 0, 0))) == ["e", "old"]
    assert ids(q.admissible(seq("s", 0, -9))) == []
    assert ids(q.admissible(None)) == ids(q)


def test_each_policy_takes_its_priorities():
    assert PriorityQueue.check_priority(-(2**40)) == -(2**40) and FCFSQueue.check_priority(0) == 0
    with pytest.raises(ValueError, match=r"^priority 3 needs the priority scheduling policy \(--scheduling-policy "
                                         r"priority\); this engine schedules fcfs"):
        FCFSQueue.check_priority(3)
    for bad in (True, 1.0, "1", None):
        for cls in (FCFSQueue, PriorityQueue):
            with pytest.raises(ValueError, match="^priority must be an integer, got "):
                cls.check_priority(bad)


def test_running_sequences_are_served_by_rank_decodes_first_within_it():
    a, b, c, d = seq("a", 0, 1), seq("b", 1, 0), seq("c", 2, 1), seq("d", 3, 0)
    for s in (a, d):
        s.num_computed_tokens = 2  # decodes: one token left
    fcfs = sorted([a, b, c, d], key=FCFSQueue.rank)
    assert ids(FCFSQueue.step_order(fcfs)) == ["a", "d", "b", "c"]
    by_priority = sorted([a, b, c, d], key=PriorityQueue.rank)
    assert ids(by_priority) == ["b", "d", "a", "c"]
    assert ids(PriorityQueue.step_order(by_priority)) == ["d", "b", "a", "c"]
