"""The engine loop thread: commands run between steps, never instead of them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from tandem.worker.api import EngineDown, StreamDelta
from tandem.worker.engine_loop import EngineLoop

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine


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
    loop = EngineLoop(cast("LLMEngine", engine))  # a fake with what the loop calls
    steps_seen: dict[int, list[int]] = {chain: [] for chain in range(50)}
    num_done = threading.Semaphore(0)

    def command(e: Any, chain: int, left: int) -> None:  # e: the CountingEngine
        steps_seen[chain].append(e.num_steps)
        if left:
            loop.submit(lambda e: command(e, chain, left - 1))
        else:
            num_done.release()

    def first_command(chain: int) -> Callable[[Any], None]:
        return lambda e: command(e, chain, 20)

    try:
        for chain in steps_seen:
            loop.submit(first_command(chain))
        for _ in steps_seen:
            assert num_done.acquire(timeout=30)
    finally:
        loop.stop()
    # A command queued by a command runs after the next step, not in the same round.
    for seen in steps_seen.values():
        assert len(seen) == 21 and all(b > a for a, b in zip(seen, seen[1:])), seen


class FailingEngine:
    """An engine whose first step, once it has work, runs out of memory."""

    def __init__(self) -> None:
        self.has_unfinished = False

    def step(self) -> list:
        raise torch.OutOfMemoryError("out of memory in the forward")


def test_an_error_in_the_step_fails_every_stream_and_call():
    downs: list[EngineDown] = []
    engine = FailingEngine()
    loop = EngineLoop(cast("LLMEngine", engine), on_down=downs.append)  # a fake with what the loop calls

    async def main() -> tuple[StreamDelta, BaseException]:
        sent: list[StreamDelta] = []
        done = loop.open_stream("r1").bind(sent.append)
        engine.has_unfinished = True
        await asyncio.wait_for(done, 10)
        [delta] = sent
        try:
            await loop.call(lambda engine: "never run")
        except EngineDown as e:
            return delta, e
        raise AssertionError("a call on a stopped loop ran")
    try:
        delta, refused = asyncio.run(main())
    finally:
        loop.stop()
    assert delta.request_id == "r1" and delta.request_finished and delta.finish_reason == "abort"
    assert delta.error == "the worker's engine stopped on an error: OutOfMemoryError: out of memory in the forward"
    assert refused is loop.down and downs == [loop.down]


class IdleEngine:
    """An engine with nothing to do."""

    has_unfinished = False


def test_an_idle_loop_waits_as_long_as_told_yet_a_command_wakes_it():
    """idle_wait sets how long an idle loop rests between ticks (consulted on the loop
    thread); a command does not wait for the rest to end."""
    waits: list[str] = []
    ticks = threading.Semaphore(0)

    def idle_wait() -> float:
        waits.append(threading.current_thread().name)
        return 600.0  # far longer than the test may wait: only the command can wake it

    loop = EngineLoop(cast("LLMEngine", IdleEngine()), tick=ticks.release, idle_wait=idle_wait)
    try:
        assert ticks.acquire(timeout=10)  # the first round: it ticked, then rests
        assert loop.submit(lambda e: "ran").result(timeout=10) == "ran"
        assert ticks.acquire(timeout=10)  # the command's round ticked too
        assert waits and set(waits) == {"engine-loop"}
    finally:
        loop.stop()


def test_a_stream_delta_carries_the_engines_prefix_hit_to_the_router():
    from tandem.engine.sequence import FinishReason
    from tandem.outputs import RequestDelta
    from tandem.router.delta_reader import merge
    from tandem.worker.engine_loop import stream_delta

    first = stream_delta(RequestDelta("r", [5], "a", None, None, None, 40, 1, num_cached_tokens=32))
    last = stream_delta(RequestDelta("r", [6], "b", None, None, FinishReason.LENGTH, 40, 2, num_cached_tokens=32))
    assert first.num_cached_tokens == 32 and merge(first, last).num_cached_tokens == 32
    assert StreamDelta("r", [], "", "abort", 0, 0).num_cached_tokens == 0  # made outside the engine
