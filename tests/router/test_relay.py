"""RequestRelay on its own, over the fake backend: the admission bound, every exit path closing
the backend's stream (what aborts the request on the workers), and each outcome counted once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from fake_backend import REPLY, FakeBackend

from tandem.proto import generation_pb2 as pb
from tandem.router.backend import NoHealthyWorker, Overloaded
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.relay import AdmissionRefused, ClientGone, RequestFailed, RequestRelay
from tandem.router.validation import ValidRequest, validate_request
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta

STATUS = "tandem_request_status_total"
REJECTED = "tandem_request_rejected_total"


def make_relay(backend: FakeBackend, max_concurrent_requests: int = 4096) -> tuple[RequestRelay, RouterMetrics]:
    tokenizer = backend.tokenizer
    metrics = RouterMetrics(tokenizer.spec.model_name, tokenizer.max_model_len)
    backend.metrics = metrics
    return RequestRelay(backend, metrics, RequestLimits(max_concurrent_requests=max_concurrent_requests)), metrics


def count(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, **labels}) or 0.0


def statuses(metrics: RouterMetrics) -> dict[str, float]:
    """The non-zero status counts, by code name."""
    codes = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED",
             "UNAVAILABLE")
    return {code: n for code in codes if (n := count(metrics, STATUS, code=code))}


def valid_request(backend: FakeBackend, request_id: str = "r-1", max_tokens: int = 100) -> ValidRequest:
    request = pb.GenerateRequest(request_id=request_id, prompt="Hi", sampling=pb.SamplingParams(max_tokens=max_tokens))
    return validate_request(request, backend.tokenizer)


async def relay_all(relay: RequestRelay, request: ValidRequest, *, buffered: bool = False) -> list[StreamDelta]:
    with relay.admitted() as timer:
        async with relay.relay(request, timer, buffered=buffered) as deltas:
            return [delta async for delta in deltas]


def test_a_request_relayed_to_its_end_counts_ok(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    relay, metrics = make_relay(backend)

    async def body():
        with relay.admitted() as timer:
            assert metrics.num_running == 1
            async with relay.relay(valid_request(backend), timer) as deltas:
                received = [delta async for delta in deltas]
            return received, deltas.finished

    received, finished = asyncio.run(body())
    reply_ids = router_tokenizer.encode(REPLY)
    assert [t for d in received for t in d.token_ids] == reply_ids
    assert finished is received[-1] and finished.request_finished and finished.num_output_tokens == len(reply_ids)
    assert backend.finished == ["r-1"] and backend.closed_early == []
    assert statuses(metrics) == {"OK": 1}
    assert count(metrics, "tandem_request_success_total", finished_reason="stop") == 1
    assert count(metrics, "tandem_generation_tokens_total") == len(reply_ids)
    assert metrics.num_running == 0


def test_admission_beyond_the_limit_is_refused_with_a_typed_error(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    relay, metrics = make_relay(backend, max_concurrent_requests=2)
    with relay.admitted(), relay.admitted():
        assert metrics.num_running == 2
        with pytest.raises(AdmissionRefused) as refused:
            with relay.admitted():
                pytest.fail("admitted past the limit")
        assert metrics.num_running == 2
    assert metrics.num_running == 0
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_requests=2" in refused.value.message
    assert statuses(metrics) == {"RESOURCE_EXHAUSTED": 1}
    assert count(metrics, REJECTED, reason="overloaded") == 1
    with relay.admitted():  # a place is free again
        assert metrics.num_running == 1


def test_admission_is_released_when_the_request_fails(router_tokenizer):
    backend = FakeBackend(router_tokenizer, fail_with=Overloaded("every KV pool is full"))
    relay, metrics = make_relay(backend, max_concurrent_requests=1)
    for _ in range(2):  # the second gets in only if the first gave its place back
        with pytest.raises(RequestFailed) as failed:
            asyncio.run(relay_all(relay, valid_request(backend)))
        assert type(failed.value) is RequestFailed  # the backend's refusal, not the admission bound
    assert metrics.num_running == 0


def test_a_consumer_that_stops_early_closes_the_backend_stream(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    relay, metrics = make_relay(backend)

    async def body():
        with relay.admitted() as timer:
            async with relay.relay(valid_request(backend), timer) as deltas:
                async for _ in deltas:
                    assert backend.closed_early == []  # still streaming
                    break
            # At once, not when the event loop shuts down and finalizes what was left open.
            assert backend.closed_early == ["r-1"] and backend.finished == []  # aborted on the workers
            return deltas.finished

    assert asyncio.run(body()) is None
    assert statuses(metrics) == {"CANCELLED": 1}
    assert count(metrics, "tandem_request_success_total", finished_reason="stop") == 0
    assert metrics.num_running == 0


def test_client_gone_passes_through_counted_as_cancelled_or_deadline(router_tokenizer):
    for deadline_passed, code in ((False, "CANCELLED"), (True, "DEADLINE_EXCEEDED")):
        backend = FakeBackend(router_tokenizer)
        relay, metrics = make_relay(backend)

        async def body():
            with relay.admitted() as timer:
                with pytest.raises(ClientGone):
                    async with relay.relay(valid_request(backend), timer,
                                           deadline_passed=lambda: deadline_passed) as deltas:
                        async for _ in deltas:
                            raise ClientGone()
                assert backend.closed_early == ["r-1"]  # at once

        asyncio.run(body())
        assert statuses(metrics) == {code: 1}


def test_a_cancelled_task_closes_the_backend_stream(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.05)
    relay, metrics = make_relay(backend)
    received: list[StreamDelta] = []

    async def consume():
        with relay.admitted() as timer:
            async with relay.relay(valid_request(backend), timer) as deltas:
                async for delta in deltas:
                    received.append(delta)

    async def body():
        task = asyncio.create_task(consume())
        while not received:
            await asyncio.sleep(0.01)
        task.cancel()  # while it waits on the backend, as grpc.aio and aiohttp cancel a call
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    assert backend.closed_early == ["r-1"]
    assert statuses(metrics) == {"CANCELLED": 1} and metrics.num_running == 0


@pytest.mark.parametrize("failure, code, reason", [
    (Overloaded("every KV pool is full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
    (NoHealthyWorker("no decode worker is healthy"), grpc.StatusCode.UNAVAILABLE, "unavailable"),
    (ValueError("the workers refuse it"), grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (KeyError("boom"), grpc.StatusCode.INTERNAL, None),
])
def test_a_backend_error_surfaces_as_a_typed_failure_and_is_counted(router_tokenizer, failure, code, reason):
    backend = FakeBackend(router_tokenizer, fail_with=failure)
    relay, metrics = make_relay(backend)
    with pytest.raises(RequestFailed) as failed:
        asyncio.run(relay_all(relay, valid_request(backend)))
    assert failed.value.code == code and failed.value.__cause__ is failure
    if code == grpc.StatusCode.INTERNAL:
        assert failed.value.message == "internal error: KeyError: 'boom'"
    else:
        assert failed.value.message == str(failure)
    assert statuses(metrics) == {code.name: 1}
    if reason is not None:  # before the first token: refused, not failed midway
        assert count(metrics, REJECTED, reason=reason) == 1
    assert metrics.num_running == 0


def test_an_error_delta_is_a_failure_not_a_finish(router_tokenizer):
    backend = FakeBackend(router_tokenizer, fail_with="the decode worker died")
    relay, metrics = make_relay(backend)
    with pytest.raises(RequestFailed) as failed:
        asyncio.run(relay_all(relay, valid_request(backend)))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "the decode worker died" in failed.value.message
    assert statuses(metrics) == {"UNAVAILABLE": 1}
    assert count(metrics, "tandem_request_success_total", finished_reason="abort") == 0


def test_a_worker_failure_midway_moves_streamed_and_reruns_buffered(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[3])
    relay, metrics = make_relay(backend)
    deltas = asyncio.run(relay_all(relay, valid_request(backend)))
    assert "".join(d.text for d in deltas) == REPLY and deltas[-1].request_finished
    assert statuses(metrics) == {"OK": 1} and count(metrics, "tandem_request_migration_seconds_count") == 1

    backend = FakeBackend(router_tokenizer, worker_failures=[3, 1, 1])  # and both moves
    relay, metrics = make_relay(backend)
    with pytest.raises(RequestFailed) as failed:
        asyncio.run(relay_all(relay, valid_request(backend)))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "moved 2 times already" in failed.value.message
    # Tokens went out before it failed: a failure, not a refusal.
    assert statuses(metrics) == {"UNAVAILABLE": 1} and count(metrics, REJECTED, reason="unavailable") == 0

    backend = FakeBackend(router_tokenizer, worker_failures=[3])
    relay, metrics = make_relay(backend)
    (whole,) = asyncio.run(relay_all(relay, valid_request(backend), buffered=True))
    assert whole.text == REPLY and whole.request_finished
    assert statuses(metrics) == {"OK": 1} and count(metrics, "tandem_request_reruns_total") == 1
    assert backend.closed_early == ["r-1"] and backend.finished == ["r-1"]


def test_an_error_in_the_block_is_internal_and_closes_the_stream(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    relay, metrics = make_relay(backend)

    async def body():
        with relay.admitted() as timer:
            with pytest.raises(RequestFailed) as failed:
                async with relay.relay(valid_request(backend), timer) as deltas:
                    async for _ in deltas:
                        raise RuntimeError("formatting failed")
            assert backend.closed_early == ["r-1"]  # at once
        return failed.value

    failure = asyncio.run(body())
    assert failure.code == grpc.StatusCode.INTERNAL and "formatting failed" in failure.message
    assert statuses(metrics) == {"INTERNAL": 1} and count(metrics, REJECTED, reason="unavailable") == 0


class EndsEarly(FakeBackend):
    """A backend whose stream ends after one delta, before the request finished."""

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       num_resumed_tokens: int = 0) -> AsyncIterator[StreamDelta]:
        yield StreamDelta(request_id=request_id, token_ids=[1], text="a", finish_reason=None,
                          num_prompt_tokens=len(prompt_token_ids), num_output_tokens=1)


def test_a_stream_that_ends_before_the_finish_is_internal(router_tokenizer):
    backend = EndsEarly(router_tokenizer)
    relay, metrics = make_relay(backend)
    with pytest.raises(RequestFailed) as failed:
        asyncio.run(relay_all(relay, valid_request(backend)))
    assert failed.value.code == grpc.StatusCode.INTERNAL
    assert failed.value.message == "the workers ended the stream before every completion finished"
    assert statuses(metrics) == {"INTERNAL": 1}
