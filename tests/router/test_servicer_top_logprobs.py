"""The gRPC API's new fields end to end over a real grpc.aio router: GenerateResponse.top_logprobs
(one entry per token, streamed and buffered, the fake backend's known values) and
sampling.structured_outputs reaching the backend as StructuredOutputsParams, or refused with
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_backend import CHOSEN_LOGPROB, FakeBackend, top_logprobs_at
from router_harness import running_router

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.client import build_request
from tandem.structured_outputs import StructuredOutputsParams


async def collect(channel: grpc.aio.Channel, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [r async for r in pb_grpc.GenerationStub(channel).Generate(request)]


@pytest.mark.parametrize("buffered", [False, True])
def test_top_logprobs_come_one_entry_per_token(router_tokenizer, buffered):
    backend = FakeBackend(router_tokenizer)
    request = build_request("Hi", max_tokens=6, logprobs=3, n=2)
    request.buffered = buffered

    async def run():
        async with running_router(backend) as (channel, _):
            return await collect(channel, request)

    responses = asyncio.run(run())
    assert backend.seen[0].params.logprobs == 3
    for index in range(2):
        mine = [r for r in responses if r.index == index]
        assert len(mine) == (1 if buffered else 6)
        ids = [t for r in mine for t in r.token_ids]
        tops = [(list(t.token_ids), list(t.logprobs)) for r in mine for t in r.top_logprobs]
        assert [p for r in mine for p in r.logprobs] == [CHOSEN_LOGPROB] * 6
        assert tops == [tuple(top_logprobs_at(t, 3)) for t in ids]
        assert all(len(r.top_logprobs) == len(r.token_ids) for r in mine)


def test_no_top_logprobs_unless_asked(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def run():
        async with running_router(backend) as (channel, _):
            return (await collect(channel, build_request("Hi", max_tokens=3, logprobs=0)),
                    await collect(channel, build_request("Hi", max_tokens=3)))

    chosen_only, plain = asyncio.run(run())
    assert all(len(r.logprobs) == 1 and not r.top_logprobs for r in chosen_only)
    assert all(not r.logprobs and not r.top_logprobs for r in plain)
    assert [s.params.logprobs for s in backend.seen] == [0, None]


def test_structured_outputs_reach_the_backend_or_are_refused_naming_the_field(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    good = build_request("Hi", max_tokens=3)
    good.sampling.structured_outputs.choice.choices.extend(["yes", "no"])
    bad = build_request("Hi", max_tokens=3)
    bad.sampling.structured_outputs.json_schema = "{not json"
    too_many = build_request("Hi", logprobs=21)

    async def run():
        async with running_router(backend) as (channel, _):
            await collect(channel, good)
            errors = []
            for request in (bad, too_many):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await collect(channel, request)
                errors.append(error.value)
            return errors

    bad_error, count_error = asyncio.run(run())
    assert backend.seen[0].params.structured_outputs == StructuredOutputsParams(choice=("yes", "no"))
    assert bad_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_error.details().startswith("sampling.structured_outputs.json_schema: is not valid JSON")
    assert count_error.details() == ("sampling.logprobs: must be in [0, 20] (0: each chosen token's "
                                     "log-probability, N: also the N most likely tokens), got 21")
    assert len(backend.seen) == 1
