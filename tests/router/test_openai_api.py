"""The OpenAI-compatible API with OpenAI's official client (sync and async) over the fake
backend: completions and chat, streamed and not, n > 1, usage, logprobs, models."""

from __future__ import annotations

import asyncio

import pytest
from fake_backend import FakeBackend
from openai.types import Completion
from openai.types.chat import (
    ChatCompletionContentPartTextParam,
    ChatCompletionMessageParam,
    ChatCompletionStreamOptionsParam,
)
from openai.types.completion_create_params import CompletionCreateParamsBase
from openai_harness import MODEL, Served, openai_serving
from router_harness import MAX_MODEL_LEN

PROMPT = "What is the capital of France?"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def test_completion_streamed_text_is_the_whole_text_with_sync_and_async_clients(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    args: CompletionCreateParamsBase = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.5,
                                        "seed": 3}

    def sync_calls(served: Served) -> tuple[Completion, list[Completion]]:
        with served.sync_client() as client:
            whole = client.completions.create(**args)
            chunks = list(client.completions.create(stream=True, **args))
        return whole, chunks

    async def body():
        async with openai_serving(backend) as served:
            sync_whole, sync_chunks = await asyncio.to_thread(sync_calls, served)
            async with served.async_client() as client:
                whole = await client.completions.create(**args)
                chunks = [chunk async for chunk in await client.completions.create(stream=True, **args)]
            return sync_whole, sync_chunks, whole, chunks, served.count("tandem_request_status_total", code="OK")

    sync_whole, sync_chunks, whole, chunks, num_ok = asyncio.run(body())
    expected = router_tokenizer.decode(router_tokenizer.encode(backend.reply)[:6])
    for response, stream in ((sync_whole, sync_chunks), (whole, chunks)):
        assert response.object == "text_completion" and response.id.startswith("cmpl-") and response.model == MODEL
        assert [c.index for c in response.choices] == [0]
        assert response.choices[0].text == expected and response.choices[0].finish_reason == "length"
        assert response.usage.prompt_tokens == len(router_tokenizer.encode(PROMPT))
        assert response.usage.completion_tokens == 6
        assert response.usage.total_tokens == response.usage.prompt_tokens + 6
        assert "".join(c.choices[0].text for c in stream) == expected
        assert [c.choices[0].finish_reason for c in stream][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in stream[:-1])
        assert len({c.id for c in stream}) == 1 and stream[0].usage is None
    assert backend.seen[0].params.temperature == 0.5 and backend.seen[0].params.seed == 3
    assert num_ok == 4 and len(backend.finished) == 4 and not backend.closed_early


def test_chat_without_max_tokens_may_use_the_whole_context(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    def sync_calls(served):
        with served.sync_client() as client:
            whole = client.chat.completions.create(model=MODEL, messages=MESSAGES)
            chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
        return whole, chunks

    async def body():
        async with openai_serving(backend) as served:
            whole, chunks = await asyncio.to_thread(sync_calls, served)
            async with served.async_client() as client:
                parts: list[ChatCompletionContentPartTextParam] = [
                    {"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
                async_whole = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": parts}], max_completion_tokens=4,
                    max_tokens=100)
            return whole, chunks, async_whole

    whole, chunks, async_whole = asyncio.run(body())
    prompt_ids = router_tokenizer.apply_chat_template(MESSAGES)
    assert backend.seen[0].prompt_token_ids == prompt_ids
    assert backend.seen[0].params.max_tokens == MAX_MODEL_LEN - len(prompt_ids)  # OpenAI's unset: no limit
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content == backend.reply
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(router_tokenizer.encode(backend.reply))
    # The stream: a role chunk, content deltas, a finish chunk with an empty delta.
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == backend.reply
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].delta.content is None
    # Text parts are joined; max_completion_tokens wins over max_tokens.
    assert backend.seen[2].prompt_token_ids == router_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital\nof France?"}])
    assert backend.seen[2].params.max_tokens == 4 and async_whole.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_n_gives_one_choice_per_completion(router_tokenizer, stream):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            if stream:
                chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=1, stream=True)
                completion = await client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=50,
                                                             stream=True)
                return [c async for c in chat], [c async for c in completion]
            return (await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=1, stream=False),
                    await client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=50, stream=False))

    chat, completion = asyncio.run(body())
    params = backend.seen[0].params
    texts = [router_tokenizer.decode(backend.completion_ids(params, i)[0]) for i in range(2)]
    if stream:
        by_index: dict[int, list] = {0: [], 1: []}
        for chunk in chat:
            by_index[chunk.choices[0].index].append(chunk.choices[0])
        assert [by_index[i][0].delta.role for i in range(2)] == ["assistant", "assistant"]
        assert ["".join(c.delta.content or "" for c in by_index[i]) for i in range(2)] == texts
        assert [by_index[i][-1].finish_reason for i in range(2)] == ["stop", "stop"]
        joined = ["".join(c.choices[0].text for c in completion if c.choices[0].index == i) for i in range(2)]
        assert joined == texts
    else:
        assert [(c.index, c.message.content, c.finish_reason) for c in chat.choices] == [
            (0, texts[0], "stop"), (1, texts[1], "stop")]
        assert chat.usage.completion_tokens == sum(len(router_tokenizer.encode(t)) for t in texts)
        assert [(c.index, c.text) for c in completion.choices] == [(0, texts[0]), (1, texts[1])]
    assert backend.seen[0].params.n == 2 and backend.seen[0].params.seed == 1


def test_include_usage_sends_a_last_chunk_with_the_usage(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            options: ChatCompletionStreamOptionsParam = {"include_usage": True}
            chat = [c async for c in await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, stream_options=options)]
            completion = [c async for c in await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=5, stream=True, stream_options=options)]
            return chat, completion

    for chunks in asyncio.run(body()):
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


def test_logprobs_come_in_openais_shapes(router_tokenizer):
    backend = FakeBackend(router_tokenizer)  # every token's logprob is -0.5

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                                        top_logprobs=0)
            streamed = [c async for c in await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, stream=True)]
            completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=0)
            plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
            return chat, streamed, completion, plain

    chat, streamed, completion, plain = asyncio.run(body())
    ids = router_tokenizer.encode(backend.reply)[:5]
    tokens = [router_tokenizer.decode([t]) for t in ids]
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.top_logprobs) for c in content] == [(t, -0.5, []) for t in tokens]
    assert content[0].bytes == list(tokens[0].encode())
    streamed_content = [c for chunk in streamed for choice in chunk.choices if choice.logprobs
                        for c in choice.logprobs.content]
    assert [c.token for c in streamed_content] == tokens
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == tokens and logprobs.token_logprobs == [-0.5] * 5
    assert logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(5)]
    assert logprobs.top_logprobs == [{t: -0.5} for t in tokens]
    assert plain.choices[0].logprobs is None and backend.seen[-1].params.logprobs is None


def test_models_lists_the_served_model(router_tokenizer):
    async def body():
        async with openai_serving(FakeBackend(router_tokenizer)) as served, served.async_client() as client:
            return [m async for m in client.models.list()], await client.models.retrieve(MODEL)

    models, model = asyncio.run(body())
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "tandem")]
    assert model.id == MODEL and isinstance(model.created, int)


def test_tandem_extensions_ride_in_the_extra_body(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            await client.completions.create(
                model=MODEL, prompt=[1, 2, 3], max_tokens=3, stop=["\n\n"], user="someone", presence_penalty=0,
                extra_body={"top_k": 20, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [7]})
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, n=2,
                extra_body={"use_beam_search": True, "beam_width": 3, "length_penalty": 0.5})

    asyncio.run(body())
    first, beam = backend.seen[0], backend.seen[1]
    assert first.prompt_token_ids == [1, 2, 3]
    assert (first.params.top_k, first.params.min_p, first.params.ignore_eos) == (20, 0.1, True)
    assert first.params.stop == ("\n\n",) and first.params.stop_token_ids == (7,)
    assert beam.params.use_beam_search
    assert (beam.params.beam_width, beam.params.length_penalty, beam.params.n) == (3, 0.5, 2)
