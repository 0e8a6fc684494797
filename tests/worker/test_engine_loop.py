"""The engine loop thread: commands run between steps, never instead of them."""

from __future__ import annotations

import threading

from tandem.worker.engine_loop import EngineLoop


class CountingEngine:
    """An engine with work that never ends: counts its steps."""

    has_unfinished = True

    def __init__(self) -> None:
        self.num_steps = 0

    def step(self) -> list:
        self.num_steps += 1
        return []


def test_commands_that_keep_coming_do_not_hold_back_the_steps():
    """Each command submits the next (as a client whose reservation was refused asks again):
    the queue is never empty, yet the engine steps between them."""
    engine = CountingEngine()
    loop = EngineLoop(engine)
    steps_seen: dict[int, list[int]] = {chain: [] for chain in range(50)}
    num_done = threading.Semaphore(0)

    def command(e: CountingEngine, chain: int, left: int) -> None:
        steps_seen[chain].append(e.num_steps)
        if left:
            loop.submit(lambda e: command(e, chain, left - 1))
        else:
            num_done.release()
    try:
        for chain in steps_seen:
            loop.submit(lambda e, chain=chain: command(e, chain, 20))
        for _ in steps_seen:
            assert num_done.acquire(timeout=30)
    finally:
        loop.stop()
    # A command queued by a command runs after the next step, not in the same round.
    for seen in steps_seen.values():
        assert len(seen) == 21 and all(b > a for a, b in zip(seen, seen[1:])), seen
