"""The router's health tracking: a dead worker is routed around at once and tried again after
a backoff that doubles while it keeps failing soon after each recovery; a request the worker
refuses (bad input) is not a worker failure."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError, RayTaskError

from tandem.router import worker_health
from tandem.router.policy import RETRY_BASE_S, RETRY_MAX_S, STABLE_S, WorkerState
from tandem.router.prefill_placement import place
from tandem.router.ray_backend import RayBackend
from tandem.sampling_params import SamplingParams
from tandem.worker.api import Role, WorkerLoad, WorkerRequest

LOAD = WorkerLoad(role=Role.DECODE, instance="d-0", num_blocks=10, num_free_blocks=10, num_running=0, num_waiting=0,
                  num_queued_tokens=0)


def test_backoff_doubles_while_the_worker_flaps_and_resets_once_it_stays_up():
    w = WorkerState("d-0", handle=None)
    now = 1000.0
    waits = []
    for _ in range(7):  # down, back as soon as allowed, down again at once
        assert w.mark_down(now) and not w.healthy and w.load is None
        assert not w.mark_down(now + 0.1), "already down: not a second failure"
        assert not w.may_recover(w.retry_at - 0.01)
        waits.append(w.retry_at - now)
        now = w.retry_at
        assert w.may_recover(now)
        w.recover(now)
        assert w.healthy and not w.may_recover(now)
    assert waits == [min(RETRY_BASE_S * 2**i, RETRY_MAX_S) for i in range(7)]
    assert waits[-1] == RETRY_MAX_S
    now += STABLE_S  # up long enough: the next failure is a first one again
    w.mark_down(now)
    assert w.num_failures == 1 and w.retry_at - now == RETRY_BASE_S


class Method:
    """A Ray actor method's stand-in: .remote(...) -> an awaitable of behaviour(...)."""

    def __init__(self, behaviour) -> None:
        self.behaviour = behaviour
        self.num_calls = 0

    def remote(self, *args):
        self.num_calls += 1

        async def call():
            return self.behaviour(*args)
        return call()


class Handle:
    def __init__(self, load, reserve=None, heartbeat=None) -> None:
        self.heartbeat = Method(heartbeat or (lambda: 0.0))
        self.load = Method(load)
        self.reserve = Method(reserve or (lambda request: None))
        self.abort = Method(lambda request_id: False)


def _raise(error: BaseException):
    def behaviour(*_):
        raise error
    return behaviour


def backend(decode: WorkerState, router_tokenizer) -> RayBackend:
    prefill = WorkerState("p-0", Handle(lambda: LOAD))
    return RayBackend([prefill], [decode], [], "least_loaded", router_tokenizer.spec, disagg_policy="always")


def test_a_dead_worker_is_polled_back_only_after_its_backoff(router_tokenizer):
    answers = {"dead": True}
    decode = WorkerState("d-0", Handle(lambda: _raise(RayActorError())() if answers["dead"] else LOAD))
    b = backend(decode, router_tokenizer)

    async def body():
        loop = asyncio.get_running_loop()
        await b.health.refresh()
        assert not decode.healthy and decode.num_failures == 1 and not b.is_ready()
        answers["dead"] = False  # restarted: it answers, but its backoff is not over
        await b.health.refresh()
        assert not decode.healthy and decode.load == LOAD
        await asyncio.sleep(decode.retry_at - loop.time() + 0.01)
        await b.health.refresh()
        assert decode.healthy and b.is_ready()

    asyncio.run(body())


@pytest.mark.parametrize("case", ["busy", "engine stuck", "silent"])
def test_busy_is_not_hung(router_tokenizer, monkeypatch, case):
    """Its load late (queued behind request traffic) but its heartbeat prompt and the engine
    going round: busy, kept. A heartbeat reporting the engine loop stuck, or no answer at
    all, for unresponsive_after_s: hung, marked down."""
    monkeypatch.setattr(worker_health, "LOAD_TIMEOUT_S", 0.05)
    never = asyncio.Event()

    async def late():
        await never.wait()

    decode = WorkerState("d-0", Handle(lambda: LOAD, heartbeat={"busy": lambda: 0.01, "engine stuck": lambda: 99.0,
                                                                 "silent": lambda: 0.0}[case]))
    decode.handle.load.remote = late
    if case == "silent":
        decode.handle.heartbeat.remote = late
    b = backend(decode, router_tokenizer)
    b.health.unresponsive_after_s = 0.3

    async def body():
        b.start_polling()  # the clock of last answers starts now
        await b.stop_polling()
        for _ in range(6):
            await b.health.refresh()
            await asyncio.sleep(0.05)

    asyncio.run(body())
    assert decode.healthy is (case == "busy"), case


def test_a_refused_request_is_not_a_worker_failure(router_tokenizer):
    refusal = RayTaskError("reserve", "traceback", ValueError("prompt: too long")).as_instanceof_cause()
    decode = WorkerState("d-0", Handle(lambda: LOAD, reserve=_raise(refusal)))
    b = backend(decode, router_tokenizer)

    async def body():
        for _ in range(3):
            with pytest.raises(ValueError, match="prompt: too long"):
                async for _ in b.generate("r-1", [1, 2, 3], SamplingParams(max_tokens=1)):
                    pass
        await b.health.refresh()

    asyncio.run(body())
    assert decode.healthy and decode.num_failures == 0 and decode.handle.reserve.num_calls == 3


def test_a_decode_worker_dying_at_the_hand_off_is_its_failure_not_the_prefill_workers(router_tokenizer):
    """The prefill call answers, then the decode worker dies as it is handed the first token:
    the decode worker is marked down and the prefill worker stays healthy (else one decode
    death would take the whole prefill pool out of service and stop the reruns)."""
    decode = WorkerState("d-0", Handle(lambda: LOAD))
    decode.handle.start = Method(_raise(RayActorError()))
    b = backend(decode, router_tokenizer)
    prefill = b.prefill[0]
    prefill.handle.prefill = Method(lambda request, destination: "first token")
    prefill.handle.abort = decode.handle.abort
    died: list[BaseException] = []
    failed: list[BaseException] = []
    request = WorkerRequest("r-1", [1, 2, 3], SamplingParams())

    async def body():
        placement = place(b.disagg, b.decode_router, b.prefill_router, decode, prefill, request.prompt_token_ids,
                          None, 0.0)
        with pytest.raises(RayActorError):
            await b._prefill(placement, request, died, failed, [])

    asyncio.run(body())
    assert not decode.healthy and decode.num_failures == 1
    assert prefill.healthy and prefill.num_failures == 0 and died == []
    assert len(failed) == 1 and isinstance(failed[0], RayActorError)


def test_a_failed_hand_off_is_recorded_before_the_abort_goes_out(router_tokenizer):
    """The decode worker refuses the first token (a ValueError, not a death): the failure is in
    `failed` before the abort is sent, since the abort's delta may reach the stream before the
    prefill phase has ended, and the stream must then end with the failure, not as an abort."""
    decode = WorkerState("d-0", Handle(lambda: LOAD))
    decode.handle.start = Method(_raise(ValueError("r-1 has its first token already")))
    failed: list[BaseException] = []
    known_at_abort: list[int] = []
    decode.handle.abort = Method(lambda request_id: known_at_abort.append(len(failed)))
    b = backend(decode, router_tokenizer)
    prefill = b.prefill[0]
    prefill.handle.prefill = Method(lambda request, destination: "first token")
    request = WorkerRequest("r-1", [1, 2, 3], SamplingParams())

    async def body():
        placement = place(b.disagg, b.decode_router, b.prefill_router, decode, prefill, request.prompt_token_ids,
                          None, 0.0)
        with pytest.raises(ValueError):
            await b._prefill(placement, request, [], failed, [])

    asyncio.run(body())
    assert decode.healthy and [type(e) for e in failed] == [ValueError] and known_at_abort == [1]


def test_a_worker_hung_past_the_bound_is_killed_for_ray_to_restart(router_tokenizer, monkeypatch):
    """Silent for restart_hung_after_s: killed (Ray restarts it), once per bound of silence."""
    killed = []
    monkeypatch.setattr(worker_health.ray, "kill", lambda handle, no_restart: killed.append((handle, no_restart)))
    monkeypatch.setattr(worker_health, "LOAD_TIMEOUT_S", 0.02)
    never = asyncio.Event()

    async def late():
        await never.wait()

    decode = WorkerState("d-0", Handle(lambda: LOAD))
    decode.handle.load.remote = decode.handle.heartbeat.remote = late
    b = backend(decode, router_tokenizer)
    b.health.unresponsive_after_s, b.health.restart_hung_after_s = 0.1, 0.5
    marked_down_at: list[float] = []

    async def body():
        loop = asyncio.get_running_loop()
        b.start_polling()
        await b.stop_polling()
        start = loop.time()
        while loop.time() - start < 0.8:
            await b.health.refresh()
            if not decode.healthy and not marked_down_at:
                marked_down_at.append(loop.time() - start)
            assert not killed or loop.time() - start >= 0.5

    asyncio.run(body())
    assert 0.1 <= marked_down_at[0] < 0.5
    assert killed == [(decode.handle, False)]
