"""The router's admission queue (router/admission.py's AdmissionQueue) on the virtual clock."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

from tandem.router.admission import RECHECK_S
from tandem.sim.cluster import Clock, Timer

ADMISSION_TIMEOUT_S = 60.0
MAX_QUEUED_REQUESTS = 1024
"""RayBackend's defaults (admission_timeout_s, max_queued_requests)."""


@dataclass(eq=False)
class _Turn:
    ask: Callable[[Callable[[object], None]], None]
    done: Callable[[object], None]
    deadline: float
    asking: bool = False
    signalled: bool = False
    timer: Timer | None = None


class SimAdmission:
    """AdmissionQueue on the clock: a request asks at once when none is queued; one refused
    queues; only the head asks again, when room_freed signals it or every RECHECK_S; one
    admitted (or given up) hands the head's turn on. A signal while the head asks is kept.
    The deadline is checked between asks, as the real queue does."""

    def __init__(self, clock: Clock, timeout_s: float = ADMISSION_TIMEOUT_S,
                 max_waiting: int = MAX_QUEUED_REQUESTS) -> None:
        self.clock, self.timeout_s, self.max_waiting = clock, timeout_s, max_waiting
        self.num_waiting = 0
        self._turns: collections.deque[_Turn] = collections.deque()

    def room_freed(self) -> None:
        if self._turns:
            self._signal(self._turns[0])

    def admit(self, ask: Callable[[Callable[[object], None]], None], done: Callable[[object], None]) -> None:
        """ask(answer): answer(a placement, None for no room, or an exception); done(result)
        gets the first placement, or the exception (Overloaded's message as a RuntimeError)."""
        if self.num_waiting >= self.max_waiting:
            done(RuntimeError(f"{self.num_waiting} requests already wait for KV room"))
            return
        self.num_waiting += 1
        turn = _Turn(ask, done, self.clock.now + self.timeout_s)
        if self._turns:
            self._turns.append(turn)
            self._wait(turn)
        else:
            self._ask(turn, first=True)

    def _ask(self, turn: _Turn, first: bool = False) -> None:
        turn.signalled, turn.asking = False, True  # NOTE: cleared before asking: a signal during it is kept
        turn.ask(lambda result: self._answered(turn, result, first))

    def _answered(self, turn: _Turn, result: object, first: bool) -> None:
        turn.asking = False
        if result is not None:
            self._end(turn, result)
            return
        if first:
            self._turns.append(turn)
        self._wait(turn)

    def _wait(self, turn: _Turn) -> None:
        left = turn.deadline - self.clock.now
        if left <= 0:
            self._end(turn, RuntimeError(f"no decode worker had room within {self.timeout_s:g} s"))
        elif turn.signalled:
            self._ask(turn)
        else:
            head = self._turns[0] is turn
            turn.timer = self.clock.after(min(RECHECK_S, left) if head else left, lambda: self._waited(turn))

    def _waited(self, turn: _Turn) -> None:
        turn.timer = None
        if self._turns[0] is turn:
            self._ask(turn)
        else:
            self._wait(turn)

    def _signal(self, turn: _Turn) -> None:
        if turn.timer is None:
            turn.signalled = True
            return
        turn.timer.cancel()
        turn.timer = None
        self._ask(turn)

    def _end(self, turn: _Turn, result: object) -> None:
        self.num_waiting -= 1
        was_head = bool(self._turns) and self._turns[0] is turn
        if turn in self._turns:
            self._turns.remove(turn)
        if was_head and self._turns:
            self._signal(self._turns[0])
        turn.done(result)
