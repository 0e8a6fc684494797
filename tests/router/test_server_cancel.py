"""Every early end of a call closes the backend's stream (which aborts the request on the
workers): client cancel, deadline; and the Abort rpc ends a running stream."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from fake_backend import FakeBackend
from router_harness import running_router

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.tokenizer import RouterTokenizer

LONG = pb.SamplingParams(max_tokens=200, ignore_eos=True)  # more than the reply: it ends on its own


async def wait_closed(backend: FakeBackend, timeout: float = 5.0) -> None:
    assert backend.closed_event is not None  # set by the first generate
    await asyncio.wait_for(backend.closed_event.wait(), timeout)


def test_client_cancel_mid_stream_closes_the_backend_stream(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02)

    async def body():
        async with running_router(backend) as (channel, _):
            call = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(request_id="c1", prompt="hi", sampling=LONG))
            first = [await call.read(), await call.read()]
            call.cancel()
            await wait_closed(backend)
            with pytest.raises(asyncio.CancelledError):
                await call.read()
            assert call.cancelled() and await call.code() == grpc.StatusCode.CANCELLED
            return first

    first = asyncio.run(body())
    assert all(r.request_id == "c1" for r in first)
    assert backend.closed_early == ["c1"] and not backend.finished


def test_client_cancel_while_the_server_waits_to_write_closes_the_backend_stream(router_tokenizer):
    # A fast backend and a slow reader: the server blocks in flow control, not in the backend.
    # A context long enough for 100_000 tokens (max_tokens must fit in it).
    long_context = RouterTokenizer.from_spec(dataclasses.replace(router_tokenizer.spec, max_model_len=200_000))
    backend = FakeBackend(long_context, reply=FakeBackend(router_tokenizer).reply * 400)

    async def body():
        async with running_router(backend) as (channel, _):
            sampling = pb.SamplingParams(max_tokens=100_000)  # more than the transport's window holds
            call = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(request_id="w1", prompt="hi", sampling=sampling))
            await call.read()
            await asyncio.sleep(0.2)
            call.cancel()
            await wait_closed(backend)

    asyncio.run(body())
    assert backend.closed_early == ["w1"] and not backend.finished


def test_deadline_is_deadline_exceeded_and_closes_the_backend_stream(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02)

    async def body():
        async with running_router(backend) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for response in stub.Generate(pb.GenerateRequest(request_id="d1", prompt="hi", sampling=LONG),
                                                    timeout=0.3):
                    received.append(response)
            await wait_closed(backend)
            return error.value.code(), received

    code, received = asyncio.run(body())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received, "some tokens stream before the deadline"
    assert backend.closed_early == ["d1"]


def test_abort_rpc_ends_the_stream_with_abort(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02)

    async def body():
        async with running_router(backend) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(request_id="a1", prompt="hi", sampling=LONG))
            await call.read()
            answer = await stub.Abort(pb.AbortRequest(request_ids=["a1", "unknown-id", "a1"]))
            rest = []
            while (response := await call.read()) is not grpc.aio.EOF:
                rest.append(response)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Abort(pb.AbortRequest(request_ids=["ok", "not ok!"]))
            return answer, rest, error.value

    answer, rest, error = asyncio.run(body())
    assert list(answer.aborted_request_ids) == ["a1"]
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and rest[-1].HasField("usage")
    assert backend.aborted == ["a1"] and backend.finished == ["a1"]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("request_ids[1]: ")
