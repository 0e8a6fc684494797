"""Top log-probabilities over the OpenAI API, in OpenAI's exact shapes, whole and streamed:
completions ``logprobs: N`` and chat ``logprobs: true`` + ``top_logprobs: N``. The fake
backend's values are known (fake_backend.top_logprobs_at): each chosen token at -0.5, its
position's top N the chosen token then ALTERNATIVES at -1.0, -1.5, ... (or, with
chosen_in_top off, N others at -0.1, -0.2, ...)."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
from fake_backend import ALTERNATIVES, CHOSEN_LOGPROB, FakeBackend, top_logprobs_at
from openai.types.chat import ChatCompletionMessageParam
from openai_harness import MODEL, openai_serving

from tandem.logprobs import TopLogprobs
from tandem.router.openai.logprobs import chat_logprobs, completion_logprobs

PROMPT = "What is the capital of France?"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]


def text_of(router_tokenizer, token_id: int) -> str:
    return router_tokenizer.decode([token_id], skip_special_tokens=False)


async def post(served, path: str, body: dict) -> tuple[int, dict | list[dict]]:
    """Raw HTTP: the JSON answer, or a stream's chunks (without [DONE])."""
    async with aiohttp.ClientSession() as session, session.post(served.base_url + path, json=body) as response:
        if not body.get("stream"):
            return response.status, await response.json()
        events = (await response.text()).strip().split("\n\n")
        assert events[-1] == "data: [DONE]"
        return response.status, [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def expected_completion_logprobs(router_tokenizer, ids: list[int], num_top: int, chosen_in_top: bool = True) -> dict:
    texts = [text_of(router_tokenizer, t) for t in ids]
    tops = []
    for token_id, text in zip(ids, texts):
        top = {text: CHOSEN_LOGPROB}
        entry = top_logprobs_at(token_id, num_top, chosen_in_top)
        for t, p in zip(entry.token_ids, entry.logprobs):
            top.setdefault(text_of(router_tokenizer, t), p)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [CHOSEN_LOGPROB] * len(ids), "top_logprobs": tops,
            "text_offset": [sum(len(t) for t in texts[:i]) for i in range(len(ids))]}


def expected_chat_content(router_tokenizer, ids: list[int], num_top: int, chosen_in_top: bool = True) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(router_tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id in ids:
        top = top_logprobs_at(token_id, num_top, chosen_in_top) if num_top else TopLogprobs([], [])
        content.append({**entry(token_id, CHOSEN_LOGPROB),
                        "top_logprobs": [entry(t, p) for t, p in zip(top.token_ids, top.logprobs)]})
    return content


@pytest.mark.parametrize("chosen_in_top", [True, False])
def test_completions_logprobs_n_whole_and_streamed(router_tokenizer, chosen_in_top):
    backend = FakeBackend(router_tokenizer, chosen_in_top=chosen_in_top)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "logprobs": 3}

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            whole = await post(served, "/completions", body)
            streamed = await post(served, "/completions", {**body, "stream": True})
            parsed = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3)
            return whole, streamed, parsed

    (status, whole), (stream_status, chunks), parsed = asyncio.run(run())
    ids = router_tokenizer.encode(backend.reply)[:6]
    expected = expected_completion_logprobs(router_tokenizer, ids, 3, chosen_in_top)
    assert status == stream_status == 200
    assert whole["choices"][0]["logprobs"] == expected
    # Up to N + 1 entries: the chosen token, and the N likeliest when it is not among them.
    assert all(len(top) == (3 if chosen_in_top else 4) for top in expected["top_logprobs"])
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for part in streamed for t in part["tokens"]] == expected["tokens"]
    assert [t for part in streamed for t in part["top_logprobs"]] == expected["top_logprobs"]
    assert [o for part in streamed for o in part["text_offset"]] == expected["text_offset"]
    assert parsed.choices[0].logprobs.top_logprobs == expected["top_logprobs"]
    assert {s.params.logprobs for s in backend.seen} == {3}


@pytest.mark.parametrize("chosen_in_top", [True, False])
def test_chat_top_logprobs_whole_and_streamed(router_tokenizer, chosen_in_top):
    backend = FakeBackend(router_tokenizer, chosen_in_top=chosen_in_top)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            whole = await post(served, "/chat/completions", body)
            streamed = await post(served, "/chat/completions", {**body, "stream": True})
            parsed = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                          logprobs=True, top_logprobs=2)
            chosen_only = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                               logprobs=True)
            return whole, streamed, parsed, chosen_only

    (_, whole), (_, chunks), parsed, chosen_only = asyncio.run(run())
    ids = router_tokenizer.encode(backend.reply)[:5]
    expected = expected_chat_content(router_tokenizer, ids, 2, chosen_in_top)
    assert whole["choices"][0]["logprobs"] == {"content": expected, "refusal": None}
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == expected
    # OpenAI's client reads it: the N likeliest, likeliest first.
    first = parsed.choices[0].logprobs.content[0]
    assert [(t.token, t.logprob, t.bytes) for t in first.top_logprobs] == [
        (e["token"], e["logprob"], e["bytes"]) for e in expected[0]["top_logprobs"]]
    if not chosen_in_top:
        assert first.token not in [t.token for t in first.top_logprobs]
    assert [c.top_logprobs for c in chosen_only.choices[0].logprobs.content] == [[]] * 5
    assert [s.params.logprobs for s in backend.seen] == [2, 2, 2, 0]


def test_n_completions_each_carry_their_own_top_logprobs(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def run():
        async with openai_serving(backend) as served:
            return await post(served, "/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 50,
                                                       "n": 2, "logprobs": 1})

    _, whole = asyncio.run(run())
    params = backend.seen[0].params
    for choice in whole["choices"]:
        ids, _ = backend.completion_ids(params, choice["index"])
        assert choice["logprobs"] == expected_completion_logprobs(router_tokenizer, ids, 1)


def test_the_shapes_unit():
    """-inf is shown as -9999.0; tokens of one text share a key (the first kept); bytes of U+FFFD."""
    text_of = {5: "a", 6: "\ufffd", 7: "\ufffd", 8: "b"}.__getitem__
    tops = [TopLogprobs([5, 6, 7], [-0.1, -1.0, -2.0]), TopLogprobs([8, 5], [-0.2, -math.inf])]
    shaped, end = completion_logprobs([5, 8], [-0.1, -math.inf], tops, text_of, offset=3)
    assert shaped == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -9999.0],
                      "top_logprobs": [{"a": -0.1, "\ufffd": -1.0}, {"b": -9999.0, "a": -9999.0}],
                      "text_offset": [3, 4]} and end == 5
    chat = chat_logprobs([6], [-math.inf], [TopLogprobs([6], [-math.inf])], text_of)
    entry = {"token": "\ufffd", "logprob": -9999.0, "bytes": [239, 191, 189]}
    assert chat == {"content": [{**entry, "top_logprobs": [entry]}], "refusal": None}
    assert chat_logprobs([5], [-0.5], None, text_of)["content"][0]["top_logprobs"] == []


def test_alternatives_are_distinct_texts(router_tokenizer):
    """What the exact-shape tests above rely on: the first alternatives are distinct one-character texts."""
    texts = [text_of(router_tokenizer, t) for t in ALTERNATIVES[:4]]
    assert len(set(texts)) == 4 and all(len(t) == 1 for t in texts)
