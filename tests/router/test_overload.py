"""Overload: past max_concurrent_requests a call is refused at once with RESOURCE_EXHAUSTED;
the accepted calls finish, and the router takes new work as soon as they do."""

from __future__ import annotations

import asyncio
import time

import grpc
from fake_backend import FakeBackend
from router_harness import serving

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.limits import RequestLimits

LIMIT = 8
OFFERED = 10 * LIMIT  # ten times what the router may hold at once


async def outcome(stub: pb_grpc.GenerationStub) -> tuple[grpc.StatusCode, float, int]:
    """-> (status, seconds to the outcome, tokens received)."""
    start = time.perf_counter()
    tokens = 0
    try:
        async for response in stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=5))):
            tokens += len(response.token_ids)
    except grpc.aio.AioRpcError as e:
        return e.code(), time.perf_counter() - start, tokens
    return grpc.StatusCode.OK, time.perf_counter() - start, tokens


def test_past_the_bound_calls_are_refused_at_once_and_the_router_recovers(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.1)  # each accepted call holds its slot ~0.5 s

    async def body():
        async with serving(backend, limits=RequestLimits(max_concurrent_requests=LIMIT)) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            burst = await asyncio.gather(*(outcome(stub) for _ in range(OFFERED)))
            after = await asyncio.gather(*(outcome(stub) for _ in range(LIMIT)))  # once the burst is over
            return burst, after

    burst, after = asyncio.run(body())
    accepted = [o for o in burst if o[0] == grpc.StatusCode.OK]
    refused = [o for o in burst if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(accepted) == LIMIT and len(refused) == OFFERED - LIMIT
    assert all(tokens == 5 for _, _, tokens in accepted)
    # A refusal does not wait for a slot: it comes well before any accepted call ends.
    assert max(t for _, t, _ in refused) < min(t for _, t, _ in accepted)
    assert [o[0] for o in after] == [grpc.StatusCode.OK] * LIMIT
    assert len(backend.seen) == 2 * LIMIT and not backend.closed_early
