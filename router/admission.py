"""The router's admission queue: requests waiting for a decode worker with KV room for their
prompt, first come first served.

Only the request at the head of the queue asks the workers for room, when room may have been
freed (a request ended, a worker's free blocks rose) and every RECHECK_S; once it is admitted
the next one asks at once. A queue of hundreds thus costs the workers one reservation at a
time, not hundreds a few milliseconds apart, which flooded the decode workers' engine loops
with reservations bound to be refused (and starved their decoding) under a burst."""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable, TypeVar

from tandem.router.backend import Overloaded

T = TypeVar("T")

RECHECK_S = 0.25
"""The head of the queue asks again at least this often, freed room signalled or not (room
can appear without a sign the router sees, e.g. a worker's prefix cache evicting)."""


class AdmissionQueue:
    def __init__(self, max_waiting: int, timeout_s: float) -> None:
        """max_waiting: requests that may be admitting at once before new ones are refused;
        timeout_s: how long one waits before it is refused (RESOURCE_EXHAUSTED)."""
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.num_waiting = 0
        """Requests being admitted now: asking for room, or queued for it."""
        self._turns: collections.deque[asyncio.Event] = collections.deque()
        """The queued requests' wake-up events, oldest first."""

    def room_freed(self) -> None:
        """Some KV room may have been freed: the head of the queue asks again."""
        if self._turns:
            self._turns[0].set()

    async def admit(self, try_once: Callable[[], Awaitable[T | None]], what: str) -> T:
        """-> try_once()'s first result that is not None (None: no worker has room now).
        A request tries at once when none is queued, else joins the queue. Raises Overloaded
        when max_waiting requests are admitting already, or after timeout_s."""
        if self.num_waiting >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting} requests already wait for KV room")
        self.num_waiting += 1
        turn = asyncio.Event()
        clock = asyncio.get_running_loop()
        deadline = clock.time() + self.timeout_s
        try:
            if not self._turns:
                admitted = await try_once()
                if admitted is not None:
                    return admitted
            self._turns.append(turn)
            while True:
                left = deadline - clock.time()
                if left <= 0:
                    raise Overloaded(f"no decode worker had room for {what} within {self.timeout_s} s")
                wait_s = min(RECHECK_S, left) if self._turns[0] is turn else left
                try:
                    await asyncio.wait_for(turn.wait(), wait_s)
                except asyncio.TimeoutError:
                    if self._turns[0] is not turn:
                        continue
                turn.clear()  # NOTE: before asking, so that a sign during the call is kept
                admitted = await try_once()
                if admitted is not None:
                    return admitted
        finally:
            self.num_waiting -= 1
            was_head = bool(self._turns) and self._turns[0] is turn
            if turn in self._turns:
                self._turns.remove(turn)
            if was_head and self._turns:  # the next one's turn: room may be left
                self._turns[0].set()
