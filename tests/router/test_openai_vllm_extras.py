"""chat_template_kwargs (variables for the chat template) and stream_options.continuous_usage_stats
(every chunk with the usage so far), as vLLM serves them."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving
from tokenizers import Tokenizer

from tandem.router.limits import RequestLimits
from tandem.router.openai.errors import APIError
from tandem.router.openai.protocol import CHAT, parse_request
from tandem.router.openai.validated import validated_all
from tandem.router.tokenizer import RouterTokenizer

TEMPLATE = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}{{ suffix | default('') }}"
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_chat_template_kwargs_reach_the_template(router_tokenizer):
    served = RouterTokenizer.from_spec(dataclasses.replace(router_tokenizer.spec, chat_template=TEMPLATE))
    plain = Tokenizer.from_str(router_tokenizer.spec.tokenizer_json)

    def ids(body: dict) -> list[int]:
        parsed = parse_request(CHAT, {"messages": MESSAGES, "max_tokens": 4, **body}, MODEL, "r")
        return validated_all(parsed, served, RequestLimits())[0].prompt_token_ids

    assert ids({}) == plain.encode("Hi", add_special_tokens=False).ids
    assert ids({"chat_template_kwargs": {"enable_thinking": True, "suffix": "!"}}) == plain.encode(
        "<think>Hi!", add_special_tokens=False).ids
    # They never replace what the router sets (the messages themselves).
    assert ids({"chat_template_kwargs": {"messages": [{"content": "other"}]}}) == ids({})
    for bad in ([1], {"not an identifier": 1}, {f"k{i}": i for i in range(33)}):
        with pytest.raises(APIError) as error:
            ids({"chat_template_kwargs": bad})
        assert error.value.param == "chat_template_kwargs"


def test_continuous_usage_stats_puts_the_usage_on_every_chunk(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            # continuous_usage_stats is vLLM's, not in the client's stream_options: the whole of
            # stream_options rides in the extra body.
            stream = await client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=6, stream=True,
                extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            return [c async for c in stream]

    chunks = asyncio.run(body())
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks and all(c.usage is not None for c in chunks)
    so_far = [c.usage.completion_tokens for c in text_chunks]
    assert so_far == sorted(so_far) and so_far[-1] == chunks[-1].usage.completion_tokens
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
