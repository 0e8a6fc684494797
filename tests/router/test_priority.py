"""A request's priority (vLLM's field) through the router: the gRPC field and the OpenAI body's
``priority`` reach the backend and the WorkerRequest; a bad value, or any nonzero one while the
workers schedule fcfs, is INVALID_ARGUMENT (400 in the OpenAI API) before any worker sees it;
``--scheduling-policy`` reaches every worker."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any, cast

import grpc
import openai
import pytest
from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving
from router_harness import serving
from test_burst_spread import idle
from test_worker_health import Handle

from tandem.cli import add_engine_args, engine_kwargs
from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router import serve_command
from tandem.router.openai.errors import APIError
from tandem.router.openai.protocol import CHAT, COMPLETION, parse_request
from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import validate_request
from tandem.sampling_params import SamplingParams
from tandem.worker.api import Role, WorkerRequest, checked


def _backend(router_tokenizer: RouterTokenizer, policy: str) -> FakeBackend:
    spec = dataclasses.replace(router_tokenizer.spec, scheduling_policy=policy)
    return FakeBackend(RouterTokenizer.from_spec(spec))


def _grpc(backend: FakeBackend, request: pb.GenerateRequest) -> grpc.aio.AioRpcError | None:
    async def body():
        async with serving(backend) as (channel, _):
            try:
                async for _ in pb_grpc.GenerationStub(channel).Generate(request, timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return e
        return None
    return asyncio.run(body())


def test_grpc_priority_reaches_the_backend_under_the_priority_policy(router_tokenizer):
    backend = _backend(router_tokenizer, "priority")
    for priority in (-7, 0, 2**31 - 1):
        assert _grpc(backend, pb.GenerateRequest(prompt="Hi", priority=priority)) is None
    assert [s.priority for s in backend.seen] == [-7, 0, 2**31 - 1]
    buffered = _backend(router_tokenizer, "priority")  # buffered runs (and reruns) carry it too
    assert _grpc(buffered, pb.GenerateRequest(prompt="Hi", priority=3, buffered=True)) is None
    assert [s.priority for s in buffered.seen] == [3]


def test_grpc_nonzero_priority_under_fcfs_is_invalid_argument(router_tokenizer):
    backend = _backend(router_tokenizer, "fcfs")
    error = _grpc(backend, pb.GenerateRequest(prompt="Hi", priority=1))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == ("priority: is 1, but this server schedules requests fcfs (--scheduling-policy fcfs), "
                               "where every request has priority 0: leave it unset, or start the server with "
                               "--scheduling-policy priority")
    assert backend.seen == []
    assert _grpc(backend, pb.GenerateRequest(prompt="Hi", priority=0)) is None and backend.seen[0].priority == 0


def test_validation_keeps_the_priority(router_tokenizer):
    spec = dataclasses.replace(router_tokenizer.spec, scheduling_policy="priority")
    valid = validate_request(pb.GenerateRequest(prompt="Hi", priority=-3), RouterTokenizer.from_spec(spec))
    assert valid.priority == -3
    assert validate_request(pb.GenerateRequest(prompt="Hi"), router_tokenizer).priority == 0


@pytest.mark.parametrize("kind", [COMPLETION, CHAT])
@pytest.mark.parametrize(("value", "message"), [
    ("high", "priority: must be an integer, got a string"),
    (1.5, "priority: must be an integer, got a number"),
    (True, "priority: must be an integer, got a boolean"),
    (2**31, "priority: must be between -2147483648 and 2147483647"),
    (-(2**31) - 1, "priority: must be between -2147483648 and 2147483647"),
])
def test_openai_bad_priority_is_a_400_naming_it(kind, value, message):
    body = {"prompt": "Hi"} if kind == COMPLETION else {"messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(APIError) as error:
        parse_request(kind, {**body, "priority": value}, MODEL, "r")
    assert error.value.param == "priority" and str(error.value).startswith(message)


def test_openai_priority_reaches_the_backend_or_is_refused_under_fcfs(router_tokenizer):
    async def body(backend: FakeBackend, priority: int):
        async with openai_serving(backend) as served, served.async_client() as client:
            await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": priority})
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, extra_body={"priority": priority})

    backend = _backend(router_tokenizer, "priority")
    asyncio.run(body(backend, -2))
    assert [s.priority for s in backend.seen] == [-2, -2]
    fcfs = _backend(router_tokenizer, "fcfs")
    with pytest.raises(openai.BadRequestError) as error:
        asyncio.run(body(fcfs, 4))
    answer = cast(dict[str, Any], error.value.body)
    assert error.value.status_code == 400 and answer["param"] == "priority"
    assert "priority: is 4, but this server schedules requests fcfs" in answer["message"]
    assert fcfs.seen == []
    asyncio.run(body(fcfs, 0))  # 0, the default, is always taken
    assert [s.priority for s in fcfs.seen] == [0, 0]


def test_the_ray_backend_hands_the_priority_to_the_workers(router_tokenizer):
    sent: list[WorkerRequest] = []

    def reserve(request: WorkerRequest):
        sent.append(request)
        raise RuntimeError("reserve refused: the test ends here")

    prefill = WorkerState("p-0", Handle(lambda: idle(Role.PREFILL, "p-0")))
    decode = WorkerState("d-0", Handle(lambda: idle(Role.DECODE, "d-0"), reserve=reserve))
    backend = RayBackend([prefill], [decode], [], "least_loaded", router_tokenizer.spec, disagg_policy="always")

    async def body():
        await backend.health.refresh()
        with pytest.raises(RuntimeError, match="reserve refused"):
            async for _ in backend.generate("r-1", [1, 2, 3], SamplingParams(max_tokens=2), priority=-6):
                pass
    asyncio.run(body())
    assert [(r.prompt_token_ids, r.priority) for r in sent] == [([1, 2, 3], -6)]


def test_the_worker_request_carries_the_priority():
    assert WorkerRequest("r", [1], SamplingParams()).priority == 0
    assert checked(WorkerRequest("r", [1], SamplingParams(), -4), WorkerRequest, "request").priority == -4
    for bad in ("1", 1.0, None):
        with pytest.raises(TypeError, match="priority and num_resumed_tokens ints"):
            checked(WorkerRequest("r", [1], SamplingParams(), cast(int, bad)), WorkerRequest, "request")


def _parsed(add_args, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_args(parser)
    return parser.parse_args(list(argv))


def test_scheduling_policy_reaches_every_worker_and_chats_engine():
    assert "scheduling_policy" not in serve_command.worker_config(_parsed(serve_command.add_args)).engine  # fcfs
    args = _parsed(serve_command.add_args, "--scheduling-policy", "priority")
    assert serve_command.worker_config(args).engine["scheduling_policy"] == "priority"
    assert engine_kwargs(_parsed(add_engine_args, "--scheduling-policy", "priority"))["scheduling_policy"] == "priority"
    with pytest.raises(SystemExit):  # argparse's error, naming the choices, before any worker starts
        _parsed(serve_command.add_args, "--scheduling-policy", "lifo")
