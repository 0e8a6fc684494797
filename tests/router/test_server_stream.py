"""The servicer over a real grpc.aio server and client: streaming, validation errors, error mapping."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from fake_backend import FakeBackend
from router_harness import MAX_MODEL_LEN, running_router

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.backend import NoHealthyWorker, Overloaded
from tandem.sampling_params import SamplingParams
from tandem.worker.api import PoolFull


async def collect(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest, **kwargs) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(req, **kwargs)]


async def status_of(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub, req)
    return error.value.code(), error.value.details()


def test_pieces_concatenate_and_usage_comes_last(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    prompt = "What is the capital of France?"

    async def body() -> list[pb.GenerateResponse]:
        async with running_router(backend) as (channel, _):
            req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=6, temperature=0.5, seed=3))
            return await collect(pb_grpc.GenerationStub(channel), req)

    responses = asyncio.run(body())
    reply_ids = router_tokenizer.encode(backend.reply)[:6]
    assert len(responses) == 6
    assert "".join(r.text for r in responses) == router_tokenizer.decode(reply_ids)
    assert [t for r in responses for t in r.token_ids] == reply_ids
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not r.HasField("usage") for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(router_tokenizer.encode(prompt)), 6)
    # The backend got the tokenized prompt and the sampling fields; the id was assigned once.
    (seen,) = backend.seen
    assert seen.prompt_token_ids == router_tokenizer.encode(prompt)
    assert seen.params == SamplingParams(max_tokens=6, temperature=0.5, seed=3)
    assert {r.request_id for r in responses} == {seen.request_id} and len(seen.request_id) == 32
    assert backend.finished == [seen.request_id] and not backend.closed_early
    assert not any(r.logprobs for r in responses)


def test_chat_and_token_ids_with_logprobs(router_tokenizer):
    backend = FakeBackend(router_tokenizer, reply="Paris.")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    chat = pb.GenerateRequest(request_id="chat-1", sampling=pb.SamplingParams(max_tokens=50, logprobs=0))
    for m in messages:
        chat.messages.messages.add(**m)
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))

    async def body():
        async with running_router(backend) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            return await collect(stub, chat), await collect(stub, ids)

    chat_responses, id_responses = asyncio.run(body())
    assert "".join(r.text for r in chat_responses) == "Paris."
    assert chat_responses[-1].finish_reason == pb.FINISH_REASON_STOP  # the reply ended before max_tokens
    assert all(list(r.logprobs) == [-0.5] for r in chat_responses)
    assert {r.request_id for r in chat_responses} == {"chat-1"}
    assert backend.seen[0].prompt_token_ids == router_tokenizer.apply_chat_template(messages)
    assert backend.seen[1].prompt_token_ids == [1, 2, 3]
    assert id_responses[-1].usage.prompt_tokens == 3


BAD = [
    ("empty prompt", pb.GenerateRequest(prompt=""), "prompt"),
    ("no input", pb.GenerateRequest(), "input"),
    ("negative max_tokens", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=-1)),
     "sampling.max_tokens"),
    ("NaN temperature", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=math.nan)),
     "sampling.temperature"),
    ("top_p above 1", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=1.01)), "sampling.top_p"),
    ("prompt over the limit", pb.GenerateRequest(prompt="word " * MAX_MODEL_LEN), "prompt"),
    ("bad role", pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="root", content="x")])),
     "messages[0].role"),
    ("token id past vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6])), "token_ids[0]"),
    ("bad request id", pb.GenerateRequest(prompt="hi", request_id="a b"), "request_id"),
]


def test_bad_inputs_are_invalid_argument_and_the_server_keeps_serving(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with running_router(backend) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            statuses = [await status_of(stub, req) for _, req, _ in BAD]
            good = await collect(stub, pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)))
            return statuses, good

    statuses, good = asyncio.run(body())
    for (case, _, field), (code, details) in zip(BAD, statuses):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, case
        assert details.startswith(f"{field}: "), (case, details)
    assert not backend.seen[:-1], "refused requests must not reach the workers"
    assert good[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("error, code", [
    (Overloaded("all 2 decode workers are full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolFull("no free blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoHealthyWorker("no decode worker is alive"), grpc.StatusCode.UNAVAILABLE),
    (ValueError("prompt refused by the worker"), grpc.StatusCode.INVALID_ARGUMENT),
    (RuntimeError("worker crashed"), grpc.StatusCode.INTERNAL),
    ("KV never arrived", grpc.StatusCode.UNAVAILABLE),  # a delta carrying an error
], ids=lambda v: v.name if isinstance(v, grpc.StatusCode) else type(v).__name__)
def test_backend_errors_map_to_status_codes(router_tokenizer, error, code):
    backend = FakeBackend(router_tokenizer, fail_with=error)

    async def body():
        async with running_router(backend) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            status = await status_of(stub, pb.GenerateRequest(prompt="hi"))
            backend.fail_with = None  # the server keeps serving once the backend recovers
            return status, await collect(stub,
                                         pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=1)))

    (got, details), after = asyncio.run(body())
    assert got == code
    assert str(error) in details
    assert after[-1].usage.completion_tokens == 1
