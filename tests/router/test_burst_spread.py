"""A burst spreads over each pool: the router counts what it has placed on a worker until that
worker's polled load shows it, so requests sent at once (before any poll) do not all tie and
pile onto the first worker."""

from __future__ import annotations

import asyncio
import collections

import pytest
from test_worker_health import Handle, Method

from tandem.router.policy import Router, WorkerState
from tandem.router.prefill_placement import place_colocated
from tandem.router.ray_backend import RayBackend
from tandem.sampling_params import SamplingParams
from tandem.worker.api import Role, WorkerLoad, WorkerRequest


def idle(role: Role, instance: str) -> WorkerLoad:
    return WorkerLoad(role=role, instance=instance, num_blocks=1000, num_free_blocks=1000, num_running=0,
                      num_waiting=0, num_queued_tokens=0)


class Slow(Method):
    """A Ray method whose answer (the request's destination) comes after the whole burst was placed."""

    def __init__(self) -> None:
        super().__init__(lambda request: f"destination of {request.request_id}")

    def remote(self, *args):
        async def call():
            await asyncio.sleep(0.01)
            return self.behaviour(*args)
        return call()


class SlowHandle(Handle):
    """A worker whose reserve (remote prefill) and prefill_local answer slowly."""

    def __init__(self, load) -> None:
        super().__init__(load)
        self.reserve = self.prefill_local = Slow()


def worker(role: Role, instance: str) -> WorkerState:
    return WorkerState(instance, SlowHandle(lambda: idle(role, instance)))


def burst(router_tokenizer, disagg_policy: str, num_requests: int, prompt_len: int | list[int]):
    prefill = [worker(Role.PREFILL, f"p-{i}") for i in range(2)]
    decode = [worker(Role.DECODE, f"d-{i}") for i in range(2)]
    backend = RayBackend(prefill, decode, [], "least_loaded", router_tokenizer.spec, disagg_policy=disagg_policy)

    async def body():
        await backend.health.refresh()  # every worker reported idle
        lengths = prompt_len if isinstance(prompt_len, list) else [prompt_len] * num_requests
        requests = [WorkerRequest(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=8))
                    for i, n in enumerate(lengths)]
        return await asyncio.gather(*(backend._reserve(r) for r in requests))
    placements = asyncio.run(body())
    assert [p.destination for p in placements] == [f"destination of r{i}" for i in range(num_requests)]
    return placements


@pytest.mark.parametrize("num_requests", [6, 32])
def test_a_burst_splits_evenly_over_two_decode_and_two_prefill_workers(router_tokenizer, num_requests):
    placements = burst(router_tokenizer, "always", num_requests, prompt_len=40)
    on_decode = collections.Counter(p.decode.instance for p in placements)
    on_prefill = collections.Counter(p.prefill.instance for p in placements)
    assert on_decode == {"d-0": num_requests // 2, "d-1": num_requests // 2}
    assert on_prefill == {"p-0": num_requests // 2, "p-1": num_requests // 2}
    assert all(p.choice.reason == "policy_always" for p in placements)


def test_a_burst_of_local_prefills_splits_too(router_tokenizer):
    placements = burst(router_tokenizer, "never", 7, prompt_len=40)
    on_decode = collections.Counter(p.decode.instance for p in placements)
    assert sorted(on_decode.values()) == [3, 4]
    assert all(p.prefill is None and p.is_local for p in placements)


def test_a_mixed_burst_under_auto_splits_the_decode_pool_by_sequences(router_tokenizer):
    """Short prompts prefilled locally and long ones remotely: the decode pool is ordered by its
    sequences first, so the remote ones (no prompt tokens queued there) do not all go to the
    worker without local prefills."""
    lengths = [1000 if i % 4 == 0 else 40 for i in range(32)]
    placements = burst(router_tokenizer, "auto", 32, prompt_len=lengths)
    assert collections.Counter(p.decode.instance for p in placements) == {"d-0": 16, "d-1": 16}
    assert {p.is_local for p in placements} == {True, False}


def test_a_burst_on_colocated_workers_splits_and_is_released_at_the_first_token():
    router = Router("least_loaded")
    workers = [WorkerState(f"c-{i}", None, load=idle(Role.COLOCATED, f"c-{i}")) for i in range(2)]
    releases = []
    for _ in range(6):
        worker = router.order(workers, list(range(30)))[0]
        releases.append((worker.instance, place_colocated(worker, 30)))
    assert collections.Counter(name for name, _ in releases) == {"c-0": 3, "c-1": 3}
    assert [w.num_in_flight_tokens for w in workers] == [90, 90]
    for _, release in releases:
        release()
        release()  # idempotent: its first token, then its end
    assert [w.num_in_flight_tokens for w in workers] == [0, 0]
