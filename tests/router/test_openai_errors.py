"""The OpenAI-compatible API's refusals and failures, as OpenAI's client sees them: 400 naming
the parameter, 404 for another model, 401, 429, 503, errors after a stream started,
/health; and a client that goes away aborts its request on the workers."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from fake_backend import FakeBackend
from openai.types.chat import ChatCompletionMessageParam
from openai_harness import MODEL, openai_serving
from router_harness import MAX_MODEL_LEN

from tandem.router.backend import NoHealthyWorker, Overloaded
from tandem.router.limits import RequestLimits
from tandem.worker.api import PoolFull

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


def bad_requests() -> list[tuple[str, dict, str | None]]:
    """(endpoint, arguments, the param the 400 must name)."""
    return [
        ("chat", dict(temperature=-1), "temperature"),
        ("completions", dict(top_p=2.0), "top_p"),
        ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        ("chat", dict(top_logprobs=2), "top_logprobs"),  # without logprobs: true
        ("completions", dict(logprobs=21), "logprobs"),
        ("completions", dict(logprobs=-1), "logprobs"),
        ("chat", dict(presence_penalty=2.5), "presence_penalty"),
        ("completions", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        ("chat", dict(logit_bias={"fifty": 1}), "logit_bias"),
        ("chat", dict(logit_bias={"11": 101}), "logit_bias"),
        ("completions", dict(logit_bias={str(10**8): 1}), "logit_bias"),
        ("completions", dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
        ("completions", dict(extra_body={"include_stop_str_in_output": "yes"}), "include_stop_str_in_output"),
        ("chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        ("chat", dict(response_format={"type": "xml"}), "response_format"),
        ("completions", dict(echo=True, logprobs=0), "echo"),
        ("completions", dict(prompt=["one", [1, 2]]), "prompt"),
        ("completions", dict(prompt=[1, 2, 10**6]), "prompt"),
        ("completions", dict(max_tokens=MAX_MODEL_LEN), "max_tokens"),
        ("chat", dict(max_completion_tokens=0), "max_completion_tokens"),
        ("chat", dict(messages=[{"role": "robot", "content": "Hi"}]), "messages"),
        ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages"),
        ("chat", dict(stop=["x"] * 17), "stop"),
        ("chat", dict(n=17), "n"),
        ("chat", dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
        ("completions", dict(extra_body={"top_k": "many"}), "top_k"),
    ]


def test_bad_requests_are_400_naming_the_parameter(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        errors = []
        async with openai_serving(backend) as served, served.async_client() as client:
            for endpoint, args, _ in bad_requests():
                with pytest.raises(openai.BadRequestError) as error:
                    if endpoint == "chat":
                        await client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, **args})
                    else:
                        await client.completions.create(**{"model": MODEL, "prompt": "Hi", **args})
                errors.append(error.value)
            rejected = served.count("tandem_request_rejected_total", reason="invalid_argument")
            return errors, rejected

    errors, rejected = asyncio.run(body())
    for (endpoint, args, param), error in zip(bad_requests(), errors):
        assert (error.status_code, error.param, error.type) == (400, param, "invalid_request_error"), (args, error)
        message = error.body["message"]
        assert message.startswith(param) or message.startswith("Unrecognized"), message
    assert not backend.seen and rejected == len(errors)


def test_invalid_json_and_unknown_routes_are_openai_errors(router_tokenizer):
    async def body():
        async with openai_serving(FakeBackend(router_tokenizer)) as served, aiohttp.ClientSession() as session:
            answers = []
            for method, path, data in (("POST", "/v1/completions", b"{not json"), ("POST", "/v1/completions", b"[1]"),
                                       ("GET", "/v1/nowhere", None), ("GET", "/v1/completions", None)):
                async with session.request(method, served.root + path, data=data) as response:
                    answers.append((response.status, (await response.json())["error"]))
            return answers

    answers = asyncio.run(body())
    assert [status for status, _ in answers] == [400, 400, 404, 405]
    assert all(set(error) == {"message", "type", "param", "code"} for _, error in answers)


def test_another_model_is_404_model_not_found(router_tokenizer):
    async def body():
        async with openai_serving(FakeBackend(router_tokenizer)) as served, served.async_client() as client:
            with pytest.raises(openai.NotFoundError) as chat:
                await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
            with pytest.raises(openai.NotFoundError) as card:
                await client.models.retrieve("gpt-4o")
            return chat.value, card.value

    for error in asyncio.run(body()):
        assert error.code == "model_not_found" and error.param == "model"


def test_a_token_guards_every_route_but_health(router_tokenizer):
    def calls(served):
        with served.sync_client(api_key="wrong") as client, pytest.raises(openai.AuthenticationError) as error:
            client.completions.create(model=MODEL, prompt="Hi")
        with served.sync_client() as client:  # the right token
            return error.value, client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)

    async def body():
        async with openai_serving(FakeBackend(router_tokenizer), auth_token="s3cret") as served:
            error, answer = await asyncio.to_thread(calls, served)
            async with served.async_client(api_key="wrong") as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()
            async with aiohttp.ClientSession() as session, session.get(served.root + "/health") as health:
                return error, answer, health.status

    error, answer, health = asyncio.run(body())
    assert error.status_code == 401 and error.code == "invalid_api_key"
    assert answer.usage.completion_tokens == 2 and health == 200


@pytest.mark.parametrize("failure, error_class, status", [
    (Overloaded("every worker is full"), openai.RateLimitError, 429),
    (PoolFull("no free blocks"), openai.RateLimitError, 429),
    (NoHealthyWorker("no worker is ready"), openai.InternalServerError, 503),
])
@pytest.mark.parametrize("stream", [False, True])
def test_backend_refusals_keep_their_http_status(router_tokenizer, failure, error_class, status, stream):
    backend = FakeBackend(router_tokenizer, fail_with=failure)

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            with pytest.raises(error_class) as error:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
            return error.value, served.metrics.num_running

    error, num_running = asyncio.run(body())
    assert error.status_code == status and str(failure) in error.message and num_running == 0
    if status == 429:
        assert error.response.headers["retry-after"] == "1"


def test_past_max_concurrent_requests_is_429_at_once(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.05)

    async def body():
        async with openai_serving(backend, limits=RequestLimits(max_concurrent_requests=1)) as served, \
                served.async_client() as client:
            stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True)
            first = await stream.__anext__()  # the one slot is taken now
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model=MODEL, prompt="Hi")
            rest = [c async for c in stream]
            after = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)  # the slot is free again
            return first, rest, after, served.count("tandem_request_rejected_total", reason="overloaded")

    first, rest, after, rejected = asyncio.run(body())
    assert len([first, *rest]) == 5 and after.usage.completion_tokens == 2 and rejected == 1


def test_a_failure_after_the_stream_started_is_an_error_event(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[3, 0, 0])  # and both moves elsewhere

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            chunks = []
            with pytest.raises(openai.APIError) as error:
                async for chunk in await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
                    chunks.append(chunk)
            return chunks, error.value, served.count("tandem_request_status_total", code="UNAVAILABLE")

    chunks, error, unavailable = asyncio.run(body())
    assert len(chunks) == 1 + 3  # the role chunk and three content deltas
    assert "died" in error.message and error.type == "server_error" and unavailable == 1


def test_a_non_streamed_request_runs_again_when_its_worker_fails(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[3])

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
            return answer, served.count("tandem_request_reruns_total")

    answer, reruns = asyncio.run(body())
    assert answer.choices[0].message.content == backend.reply and reruns == 1


def test_a_request_aborted_on_the_server_is_an_error_not_a_success(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02)

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=50, stream=True)
            first = await stream.__anext__()
            assert await backend.abort(first.id)  # as the gRPC Abort rpc does, by the same id
            with pytest.raises(openai.APIError) as error:
                async for _ in stream:
                    pass
            return error.value

    assert asyncio.run(body()).code == "request_aborted"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_request(router_tokenizer, stream):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.05)

    async def body():
        async with openai_serving(backend) as served:
            async with served.async_client() as client:
                extra_body = {"ignore_eos": True}
                if stream:
                    chunks = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50,
                                                                  extra_body=extra_body, stream=True)
                    await chunks.__anext__()
                    await chunks.__anext__()
                    await chunks.close()
                else:
                    with pytest.raises(openai.APITimeoutError):
                        await client.with_options(timeout=0.2).chat.completions.create(
                            model=MODEL, messages=MESSAGES, max_tokens=50, extra_body=extra_body)
            assert backend.closed_event is not None  # set by the first generate
            await asyncio.wait_for(backend.closed_event.wait(), 5)
            await asyncio.sleep(0.05)  # the handler's bookkeeping after the close
            return served.count("tandem_request_status_total", code="CANCELLED"), served.metrics.num_running

    cancelled, num_running = asyncio.run(body())
    assert len(backend.closed_early) == 1 and not backend.finished
    assert cancelled == 1 and num_running == 0


def test_health_follows_the_backend_and_needs_no_token(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        statuses = []
        async with openai_serving(backend, auth_token="s3cret") as served, aiohttp.ClientSession() as session:
            for ready in (True, False):
                backend.ready = ready
                async with session.get(served.root + "/health") as response:
                    statuses.append((response.status, await response.json()))
        return statuses

    assert asyncio.run(body()) == [(200, {"status": "ok"}), (503, {"status": "unavailable"})]
