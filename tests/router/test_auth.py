"""A configured token guards the API: UNAUTHENTICATED without it, health checks stay open."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_backend import FakeBackend
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_harness import serving

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


def test_calls_need_the_token(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def status(stub, metadata) -> grpc.StatusCode:
        try:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2)),
                                         metadata=metadata):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    async def body():
        async with serving(backend, auth_token=TOKEN) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            codes = [await status(stub, m) for m in (None, (("authorization", "Bearer wrong"),),
                                                      (("authorization", TOKEN),),
                                                      (("authorization", f"Bearer {TOKEN}"),))]
            with pytest.raises(grpc.aio.AioRpcError) as abort_error:
                await stub.Abort(pb.AbortRequest(request_ids=["x"]))
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            return codes, abort_error.value.code(), health.status

    codes, abort_code, health = asyncio.run(body())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.OK]
    assert abort_code == grpc.StatusCode.UNAUTHENTICATED
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert len(backend.seen) == 1  # refused calls never reached the backend
