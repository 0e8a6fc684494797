"""Buffered requests: the whole output in one response; a worker failure midway runs the
request again from the start (at most MAX_RERUNS times), where a streamed one goes on from its
last streamed token (router/migration.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_backend import REPLY, FakeBackend
from router_harness import serving

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.buffered import MAX_RERUNS
from tandem.router.limits import RequestLimits


def call(backend: FakeBackend, buffered: bool,
         max_tokens: int = 100) -> tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None]:
    async def body():
        responses = []
        async with serving(backend) as (channel, _):
            request = pb.GenerateRequest(request_id="b-1", prompt="Hi", buffered=buffered,
                                         sampling=pb.SamplingParams(max_tokens=max_tokens, logprobs=0))
            try:
                async for response in pb_grpc.GenerationStub(channel).Generate(request):
                    responses.append(response)
            except grpc.aio.AioRpcError as e:
                return responses, e
        return responses, None
    return asyncio.run(body())


def reruns(backend: FakeBackend) -> float:
    assert backend.metrics is not None
    return backend.metrics.reruns._value.get()


def test_one_response_with_the_whole_output(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    responses, error = call(backend, buffered=True)
    reply_ids = router_tokenizer.encode(REPLY)
    assert error is None and len(responses) == 1
    (r,) = responses
    assert list(r.token_ids) == reply_ids and r.text == REPLY and len(r.logprobs) == len(reply_ids)
    assert r.finish_reason == pb.FINISH_REASON_STOP and r.usage.completion_tokens == len(reply_ids)


def test_a_worker_failure_midway_runs_it_again_unseen_by_the_client(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[3])
    responses, error = call(backend, buffered=True)
    assert error is None and len(responses) == 1
    assert list(responses[0].token_ids) == router_tokenizer.encode(REPLY) and responses[0].text == REPLY
    assert [s.request_id for s in backend.seen] == ["b-1", "b-1"]
    assert backend.closed_early == ["b-1"] and backend.finished == ["b-1"]  # the failed run was closed
    assert reruns(backend) == 1


def test_it_gives_up_after_max_reruns(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[1] * (MAX_RERUNS + 2))
    responses, error = call(backend, buffered=True)
    assert error is not None
    assert responses == [] and error.code() == grpc.StatusCode.UNAVAILABLE and "died" in error.details()
    assert len(backend.seen) == MAX_RERUNS + 1 and reruns(backend) == MAX_RERUNS
    assert backend.worker_failures == [1]  # the run after the last allowed never happened


def test_no_rerun_when_no_worker_is_healthy(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[2])
    backend.ready = False
    responses, error = call(backend, buffered=True)
    assert error is not None
    assert error.code() == grpc.StatusCode.UNAVAILABLE and len(backend.seen) == 1 and reruns(backend) == 0


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_streamed_request_moves_on_instead(router_tokenizer, fail_at):
    """(router/migration.py) Its client gets every token once, from two runs: the second
    resumes after the tokens already streamed (none: it runs again whole)."""
    backend = FakeBackend(router_tokenizer, worker_failures=[fail_at])
    responses, error = call(backend, buffered=False)
    assert error is None
    assert [t for r in responses for t in r.token_ids] == router_tokenizer.encode(REPLY)
    assert "".join(r.text for r in responses) == REPLY
    assert [s.num_resumed_tokens for s in backend.seen] == [0, fail_at] and reruns(backend) == 0
    assert responses[-1].usage.completion_tokens == len(router_tokenizer.encode(REPLY))


def test_a_streamed_request_ends_unavailable_past_max_migrations(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[2])
    async def body():
        responses = []
        async with serving(backend, limits=RequestLimits(max_migrations=0)) as (channel, _):
            request = pb.GenerateRequest(request_id="b-1", prompt="Hi", sampling=pb.SamplingParams(max_tokens=100))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for response in pb_grpc.GenerationStub(channel).Generate(request):
                    responses.append(response)
        return responses, error.value
    responses, error = asyncio.run(body())
    assert len(responses) == 2 and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "max-migrations=0" in error.details() and len(backend.seen) == 1
