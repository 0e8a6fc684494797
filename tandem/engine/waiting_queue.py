"""The scheduling policy, as the waiting queue: in which order waiting sequences are admitted,
where a preempted one goes back, and in which order running ones are served and give way.

One class per ``--scheduling-policy`` (vLLM's names), registered in WAITING_QUEUES:

- ``fcfs``: arrival order (what tandem always did). A sequence preempted by recompute goes
  back to the front of the queue; nothing waiting is admitted while a swapped-out sequence
  waits to come back.
- ``priority``: a request's ``priority`` first, lower served first (vLLM's), then arrival
  order. A preempted sequence goes back among its priority's, before the later arrivals; a
  waiting one that outranks every swapped-out one is admitted before they come back.

Under both, the running sequences are served in :meth:`WaitingQueue.rank` order and the
last of them not yet scheduled gives way first: under fcfs the newest, under priority the
lowest priority, latest arrival first (vLLM's victim).

Torch-free: sequences are read for their ``priority`` and ``arrival_index`` only. NOTE:
neither changes while a sequence is queued (the engine sets the priority before queueing
it): the ordered containers rely on it.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, MutableSequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tandem.engine.sequence import Sequence

Rank = tuple[int, ...]
"""A sequence's place under a policy: smaller is served first."""


def check_priority_value(priority: object) -> int:
    """``priority`` if it is an integer (bool is not); ValueError otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {type(priority).__name__}")
    return priority


class WaitingQueue(ABC):
    """The sequences waiting to be admitted (new, or preempted by recompute), in admission
    order, and the policy that orders them. Iterating yields that order; ``len``, ``in``,
    indexing and :meth:`remove` work as on a list."""

    name: ClassVar[str]
    """The policy's ``--scheduling-policy`` name."""

    _seqs: MutableSequence[Sequence]
    """The waiting sequences, in admission order."""

    @staticmethod
    @abstractmethod
    def rank(seq: Sequence) -> Rank:
        """The policy's order of service: waiting sequences are admitted, running ones served
        and swapped-out ones resumed in it; running ones give way in reverse."""

    @staticmethod
    @abstractmethod
    def step_order(running: list[Sequence]) -> list[Sequence]:
        """``running`` (sorted by :meth:`rank`) in the order a step gives them budget and blocks."""

    @classmethod
    def check_priority(cls, priority: object) -> int:
        """``priority`` if this policy takes it; ValueError naming the problem otherwise."""
        return check_priority_value(priority)

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new request's sequence."""

    @abstractmethod
    def requeue(self, seq: Sequence) -> None:
        """Queue a sequence preempted by recompute: it ran before, so it goes back in front of
        the waiting ones of its rank (fcfs: in front of all)."""

    @abstractmethod
    def admissible(self, first_swapped: Sequence | None) -> list[Sequence]:
        """The waiting sequences a step may admit, in order, while ``first_swapped`` (the
        first swapped-out sequence, None when there is none) still waits to come back."""

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __getitem__(self, i: int) -> Sequence:
        return self._seqs[i]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[s.request_id for s in self._seqs]})"


class FCFSQueue(WaitingQueue):
    """First come, first served: tandem's behaviour before policies were pluggable, exactly."""

    name = "fcfs"

    def __init__(self) -> None:
        self._seqs: deque[Sequence] = deque()

    @staticmethod
    def rank(seq: Sequence) -> Rank:
        return (seq.arrival_index,)

    @staticmethod
    def step_order(running: list[Sequence]) -> list[Sequence]:
        # NOTE: decodes before prefill chunks, so that a flood of long prompts never starves
        # a running decode (each needs one token of the budget).
        return sorted(running, key=lambda s: s.num_uncomputed_tokens != 1)

    @classmethod
    def check_priority(cls, priority: object) -> int:
        value = check_priority_value(priority)
        if value != 0:
            raise ValueError(f"priority {value} needs the priority scheduling policy (--scheduling-policy "
                             f"priority); this engine schedules {cls.name}, where every request has priority 0")
        return value

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def requeue(self, seq: Sequence) -> None:
        # NOTE: in front of every waiting one: it recomputes before any newer sequence starts.
        self._seqs.appendleft(seq)

    def admissible(self, first_swapped: Sequence | None) -> list[Sequence]:
        # NOTE: a swapped-out sequence (its KV computed, on the host) comes back first.
        return [] if first_swapped is not None else list(self._seqs)


class PriorityQueue(WaitingQueue):
    """vLLM's priority scheduling: lower ``priority`` first, ties in arrival order."""

    name = "priority"

    def __init__(self) -> None:
        self._seqs: list[Sequence] = []

    @staticmethod
    def rank(seq: Sequence) -> Rank:
        return (seq.priority, seq.arrival_index)

    @staticmethod
    def step_order(running: list[Sequence]) -> list[Sequence]:
        # NOTE: priority first, then decodes before prefill chunks within a priority: the
        # sequences a step has not reached are then exactly the ones that may give way.
        return sorted(running, key=lambda s: (s.priority, s.num_uncomputed_tokens != 1))

    def add(self, seq: Sequence) -> None:
        bisect.insort_right(self._seqs, seq, key=self.rank)

    def requeue(self, seq: Sequence) -> None:
        self._seqs.insert(bisect.bisect_left(self._seqs, self.rank(seq), key=self.rank), seq)

    def admissible(self, first_swapped: Sequence | None) -> list[Sequence]:
        if first_swapped is None:
            return list(self._seqs)
        return list(self._seqs[:bisect.bisect_left(self._seqs, self.rank(first_swapped), key=self.rank)])


WAITING_QUEUES: dict[str, type[WaitingQueue]] = {FCFSQueue.name: FCFSQueue, PriorityQueue.name: PriorityQueue}
"""--scheduling-policy's choices: name -> the waiting queue that implements it. NOTE: the
flag's choices are engine_options.SCHEDULING_POLICIES (torch-free, beneath the engine), which
must name exactly these (tests/engine/test_waiting_queue.py checks)."""


def make_waiting_queue(name: str) -> WaitingQueue:
    """The waiting queue of policy ``name`` (ValueError naming the choices otherwise)."""
    try:
        return WAITING_QUEUES[name]()
    except KeyError:
        raise ValueError(f"scheduling_policy must be one of {', '.join(WAITING_QUEUES)}, got {name!r}") from None
