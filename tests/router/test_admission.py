"""The admission queue: first come first served, one request asking for room at a time."""

from __future__ import annotations

import asyncio

import pytest

from tandem.router import admission
from tandem.router.admission import AdmissionQueue
from tandem.router.backend import Overloaded


class Pool:
    """Free blocks, and the order in which requests asked for them."""

    def __init__(self, num_free: int) -> None:
        self.num_free = num_free
        self.asked: list[str] = []

    def asker(self, name: str, num_blocks: int = 1):
        async def try_once() -> str | None:
            self.asked.append(name)
            await asyncio.sleep(0)  # a call to a worker
            if self.num_free < num_blocks:
                return None
            self.num_free -= num_blocks
            return name
        return try_once


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_first_come_first_served_one_asking_at_a_time(monkeypatch):
    monkeypatch.setattr(admission, "RECHECK_S", 60.0)  # only signs wake the head here

    async def main() -> None:
        queue, pool = AdmissionQueue(max_waiting=10, timeout_s=30), Pool(num_free=1)
        tasks = [asyncio.create_task(queue.admit(pool.asker(n), n)) for n in "abcd"]
        await settle()
        # Each tried once as it came (no queue yet); a got the only block, b c d queue in order.
        assert pool.asked == ["a", "b", "c", "d"] and await tasks[0] == "a"
        assert queue.num_waiting == 3
        pool.asked.clear()
        queue.room_freed()  # nothing was freed after all: only the head asks
        await settle()
        assert pool.asked == ["b"]
        pool.num_free = 2
        queue.room_freed()  # the head is admitted, the next asks at once, the last waits
        await settle()
        assert pool.asked == ["b", "b", "c", "d"]
        assert [await t for t in tasks[1:3]] == ["b", "c"] and not tasks[3].done()
        # A newcomer queues behind d without asking.
        late = asyncio.create_task(queue.admit(pool.asker("e"), "e"))
        await settle()
        assert pool.asked[-1] == "d" and queue.num_waiting == 2
        pool.num_free = 2
        queue.room_freed()
        await settle()
        assert await tasks[3] == "d" and await late == "e" and queue.num_waiting == 0
    asyncio.run(main())


def test_head_that_leaves_hands_on_its_turn(monkeypatch):
    monkeypatch.setattr(admission, "RECHECK_S", 60.0)

    async def main() -> None:
        queue, pool = AdmissionQueue(max_waiting=10, timeout_s=30), Pool(num_free=0)
        tasks = [asyncio.create_task(queue.admit(pool.asker(n), n)) for n in "ab"]
        await settle()
        pool.num_free = 1
        pool.asked.clear()
        tasks[0].cancel()  # the client went away while at the head
        await settle()
        assert pool.asked == ["b"] and await tasks[1] == "b" and queue.num_waiting == 0
    asyncio.run(main())


def test_head_asks_again_without_a_sign(monkeypatch):
    monkeypatch.setattr(admission, "RECHECK_S", 0.05)

    async def main() -> None:
        queue, pool = AdmissionQueue(max_waiting=10, timeout_s=30), Pool(num_free=0)
        task = asyncio.create_task(queue.admit(pool.asker("a"), "a"))
        await asyncio.sleep(0.01)
        pool.num_free = 1  # room the router was not told of
        assert await asyncio.wait_for(task, 1.0) == "a"
        assert 2 <= len(pool.asked) <= 4
    asyncio.run(main())


def test_refused_when_the_queue_is_full_or_after_the_timeout(monkeypatch):
    monkeypatch.setattr(admission, "RECHECK_S", 0.02)

    async def main() -> None:
        queue, pool = AdmissionQueue(max_waiting=2, timeout_s=0.2), Pool(num_free=0)
        waiting = [asyncio.create_task(queue.admit(pool.asker(n), n)) for n in "ab"]
        await settle()
        with pytest.raises(Overloaded, match="2 requests already wait"):
            await queue.admit(pool.asker("c"), "c")
        for t in waiting:
            with pytest.raises(Overloaded, match="within 0.2 s"):
                await t
        assert queue.num_waiting == 0
    asyncio.run(main())
