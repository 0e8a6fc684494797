"""A completions request with several prompts (vLLM's four forms of ``prompt``): each runs as a
request of its own, all at once; choices numbered prompt_index * n + j; usage summed; a stream
interleaves them and ends with one usage chunk and [DONE]; an invalid prompt refuses the whole
request before anything runs; a failure or a client gone away aborts every prompt's request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp
import openai
import pytest
from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving
from router_harness import VOCAB_SIZE

from tandem.router.backend import Overloaded
from tandem.router.limits import RequestLimits

PROMPTS = ["Capital of France?", "Capital of Italy?", "Capital of Spain?"]
REPLIES = {"Capital of France?": "Paris is the capital of France.", "Capital of Italy?": "Rome.",
           "Capital of Spain?": "Madrid is the capital of Spain, in its centre."}


def backend_for(router_tokenizer, **kwargs) -> FakeBackend:
    return FakeBackend(router_tokenizer, reply_of=lambda prompt: REPLIES.get(prompt, "Something else."), **kwargs)


def expected_text(backend: FakeBackend, prompt_ids: list[int], index: int, max_tokens: int) -> str:
    params = dataclasses.replace(backend.seen[0].params, max_tokens=max_tokens)
    return backend.tokenizer.decode(backend.completion_ids(params, index, prompt_ids)[0])


def test_prompts_give_choices_in_vllms_order_with_usage_summed(router_tokenizer):
    backend = backend_for(router_tokenizer)

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            answer = await client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=50, echo=True)
            return answer, served.count("tandem_request_status_total", code="OK")

    answer, num_ok = asyncio.run(run())
    prompt_ids = [router_tokenizer.encode(p) for p in PROMPTS]
    assert [c.index for c in answer.choices] == list(range(6))
    for choice in answer.choices:
        prompt, j = divmod(choice.index, 2)
        assert choice.text == PROMPTS[prompt] + expected_text(backend, prompt_ids[prompt], j, 50)
        assert choice.finish_reason == "stop"
    num_output = sum(len(backend.completion_ids(backend.seen[0].params, j, ids)[0]) for ids in prompt_ids
                     for j in range(2))
    assert answer.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    assert answer.usage.completion_tokens == num_output
    # One request per prompt on the backend, each with its own id (vLLM's "-i" after the request's).
    seen = sorted(backend.seen, key=lambda s: s.request_id)
    assert [s.request_id for s in seen] == [f"{answer.id}-{i}" for i in range(3)]
    assert [s.prompt_token_ids for s in seen] == prompt_ids
    assert num_ok == 3 and sorted(backend.finished) == [s.request_id for s in seen]


@pytest.mark.parametrize("prompt, expected_prompts", [
    ("Capital of Italy?", ["Capital of Italy?"]),
    (["Capital of Italy?"], ["Capital of Italy?"]),
    ([[1, 2, 3]], [[1, 2, 3]]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3, 4, 5], [6]], [[1, 2], [3, 4, 5], [6]]),
    (["Capital of Italy?", "Capital of Spain?"], ["Capital of Italy?", "Capital of Spain?"]),
])
def test_the_four_forms_of_prompt(router_tokenizer, prompt, expected_prompts):
    backend = backend_for(router_tokenizer)

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)

    answer = asyncio.run(run())
    expected_ids = [p if isinstance(p, list) else router_tokenizer.encode(p) for p in expected_prompts]
    assert sorted(s.prompt_token_ids for s in backend.seen) == sorted(expected_ids)
    assert len(answer.choices) == len(expected_prompts)
    if len(expected_prompts) == 1:
        assert backend.seen[0].request_id == answer.id  # one prompt: its own id, unchanged


def test_a_stream_interleaves_the_prompts_and_ends_with_one_usage_chunk(router_tokenizer):
    backend = backend_for(router_tokenizer, step_delay_s=0.005)
    body = {"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    async def run():
        async with openai_serving(backend) as served, aiohttp.ClientSession() as session:
            async with session.post(served.base_url + "/completions", json=body) as response:
                return response.status, (await response.text()).strip().split("\n\n")

    status, events = asyncio.run(run())
    assert status == 200 and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    *text_chunks, usage_chunk = chunks
    order = [c["choices"][0]["index"] for c in text_chunks]
    assert set(order) == {0, 1, 2, 3}
    assert order.index(2) < max(i for i, index in enumerate(order) if index == 0)  # both prompts at once
    prompt_ids = [router_tokenizer.encode(p) for p in PROMPTS[:2]]
    for index in range(4):
        text = "".join(c["choices"][0]["text"] for c in text_chunks if c["choices"][0]["index"] == index)
        assert text == expected_text(backend, prompt_ids[index // 2], index % 2, 50)
        finishes = [c["choices"][0]["finish_reason"] for c in text_chunks if c["choices"][0]["index"] == index]
        assert finishes[-1] == "stop"
    assert usage_chunk["choices"] == [] and [c for c in chunks if c["choices"] == []] == [usage_chunk]
    total = usage_chunk["usage"]
    assert total["prompt_tokens"] == sum(len(ids) for ids in prompt_ids)
    assert total["completion_tokens"] == len(text_chunks)  # one token per chunk from the fake
    so_far = [c["usage"]["completion_tokens"] for c in text_chunks]
    assert so_far == sorted(so_far) and so_far[-1] == total["completion_tokens"]
    assert {c["usage"]["prompt_tokens"] for c in text_chunks} == {total["prompt_tokens"]}


def bad_prompts() -> list[tuple[Any, str]]:
    """(prompt, how the 400's message starts). Any: most are outside the client's own prompt types
    too, and are sent as they are for the server to refuse."""
    return [
        (["Capital of Italy?", ""], "prompt[1]: must not be empty"),
        ([[1, 2], [VOCAB_SIZE]], f"prompt[1][0]: {VOCAB_SIZE} is outside the vocabulary"),
        ([[1, 2], []], "prompt[1]: must hold at least one token id"),
        ([[1, 2], [3, "x"]], "prompt[1][1]: must be an integer"),
        (["Capital of Italy?", [1, 2]], "prompt: must be a string, an array of strings"),
        ([], "prompt: must hold at least one prompt"),
        (["a", "b", "c", "d", "e"], "prompt: 5 prompts, more than the limit max_prompts=4"),
        (["x" * 600, "y" * 600], "prompt: 2 prompts of 1200 characters together, more than the limit "
                                 "max_prompt_chars=1000"),
        ([[5] * 300, [1]], "prompt[0]: the prompt is 300 tokens, more than the limit"),
    ]


def test_any_invalid_prompt_refuses_the_whole_request_before_anything_runs(router_tokenizer):
    backend = backend_for(router_tokenizer)
    limits = RequestLimits(max_prompts=4, max_prompt_chars=1000)

    async def run():
        errors = []
        async with openai_serving(backend, limits=limits) as served, served.async_client() as client:
            for prompt, _ in bad_prompts():
                with pytest.raises(openai.BadRequestError) as error:
                    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
                errors.append(error.value)
            with pytest.raises(openai.BadRequestError) as error:  # one prompt whose max_tokens cannot fit
                await client.completions.create(model=MODEL, prompt=[[5] * 250, [1]], max_tokens=10)
            errors.append(error.value)
        return errors

    errors = asyncio.run(run())
    for (prompt, start), error in zip(bad_prompts(), errors):
        assert (error.status_code, error.param) == (400, "prompt") and error.body["message"].startswith(start), (
            prompt, error.body["message"])
    assert errors[-1].param == "max_tokens" and errors[-1].body["message"].endswith("(prompt[0])")
    assert not backend.seen


def test_a_failed_prompt_aborts_the_others(router_tokenizer):
    backend = backend_for(router_tokenizer, step_delay_s=0.01,
                          fail_prompts={PROMPTS[1]: Overloaded("every worker is full")})

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            with pytest.raises(openai.RateLimitError) as error:
                await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=50)
            await asyncio.sleep(0.05)
            return error.value, served.metrics.num_running, served.count("tandem_request_status_total",
                                                                         code="CANCELLED")

    error, num_running, cancelled = asyncio.run(run())
    assert "every worker is full" in error.message
    assert sorted(backend.closed_early) == sorted(s.request_id for s in backend.seen if s.prompt_token_ids !=
                                                  router_tokenizer.encode(PROMPTS[1]))
    assert not backend.finished and not backend.running and num_running == 0 and cancelled == 2


def test_a_failure_midway_in_a_stream_is_an_error_event_and_aborts_the_others(router_tokenizer):
    backend = backend_for(router_tokenizer, step_delay_s=0.01, worker_failures=[3])

    async def run():
        # (never moved to another worker: router/migration.py)
        async with openai_serving(backend, limits=RequestLimits(max_migrations=0)) as served, \
                served.async_client() as client:
            chunks = []
            with pytest.raises(openai.APIError) as error:
                async for chunk in await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=50,
                                                                   stream=True):
                    chunks.append(chunk)
            await asyncio.sleep(0.05)
            return chunks, error.value, served.metrics.num_running

    chunks, error, num_running = asyncio.run(run())
    assert chunks and "died" in error.message
    # "Rome." (two tokens) was done before the first prompt's worker died; the third was cut short.
    ids = {router_tokenizer.decode(s.prompt_token_ids): s.request_id for s in backend.seen}
    assert backend.finished == [ids[PROMPTS[1]]]
    assert sorted(backend.closed_early) == sorted([ids[PROMPTS[0]], ids[PROMPTS[2]]])
    assert not backend.running and num_running == 0


def test_a_client_gone_away_aborts_every_prompt(router_tokenizer):
    backend = backend_for(router_tokenizer, step_delay_s=0.02)

    async def run():
        async with openai_serving(backend) as served:
            async with served.async_client() as client:
                stream = await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=50, stream=True)
                await stream.__anext__()
                await stream.close()
            for _ in range(100):
                if len(backend.closed_early) == 3:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.05)
            return served.count("tandem_request_status_total", code="CANCELLED"), served.metrics.num_running

    cancelled, num_running = asyncio.run(run())
    assert len(backend.closed_early) == 3 and not backend.finished and not backend.running
    assert cancelled == 3 and num_running == 0


def test_each_prompt_holds_a_place_among_max_concurrent_requests(router_tokenizer):
    backend = backend_for(router_tokenizer)

    async def run():
        async with openai_serving(backend, limits=RequestLimits(max_concurrent_requests=2)) as served, \
                served.async_client() as client:
            with pytest.raises(openai.RateLimitError) as error:
                await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4)
            fits = await client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4)
            return error.value, fits, served.metrics.num_running

    error, fits, num_running = asyncio.run(run())
    assert "max_concurrent_requests=2" in error.message and len(fits.choices) == 2 and num_running == 0
    assert len(backend.seen) == 2


def test_echo_streams_each_prompt_before_its_own_choices(router_tokenizer):
    backend = backend_for(router_tokenizer)

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            stream = await client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=50, echo=True,
                                                     stream=True)
            return [c async for c in stream]

    chunks = asyncio.run(run())
    for index, prompt in enumerate(PROMPTS[:2]):
        text = "".join(c.choices[0].text for c in chunks if c.choices[0].index == index)
        assert text == prompt + REPLIES[prompt]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_aborted_on_the_workers_ends_the_others_at_once(router_tokenizer, stream):
    """One prompt's run ends "abort" (e.g. its worker aborted it): the client gets the error
    then and there, and the other prompts stop generating (closed before their end)."""
    # Replies of 40 tokens, 0.8 s each: the abort comes long before any could end.
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02, reply_of=lambda prompt: " word" * 40)

    async def abort_prompt_1():
        while len(backend.seen) < len(PROMPTS) or not backend.running:
            await asyncio.sleep(0.005)
        ids = {router_tokenizer.decode(s.prompt_token_ids): s.request_id for s in backend.seen}
        await asyncio.sleep(0.03)
        backend.running[ids[PROMPTS[1]]].set()

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            aborter = asyncio.create_task(abort_prompt_1())
            with pytest.raises(openai.APIError) as error:
                answer = await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=50, stream=stream)
                if stream:
                    async for _ in answer:
                        pass
            await aborter
            await asyncio.sleep(0.05)
            return error.value, served.metrics.num_running

    error, num_running = asyncio.run(run())
    assert "aborted" in error.message
    ids = {router_tokenizer.decode(s.prompt_token_ids): s.request_id for s in backend.seen}
    assert sorted(backend.closed_early) == sorted([ids[PROMPTS[0]], ids[PROMPTS[2]]])
    assert set(backend.finished) <= {ids[PROMPTS[1]]} and not backend.running and num_running == 0
