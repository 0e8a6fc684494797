"""echo on completions: each choice's text starts with the prompt's, whole or streamed; a token
id prompt is echoed as its decoded text (transformers' decode)."""

from __future__ import annotations

import asyncio

from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving


def test_echo_puts_the_prompt_before_each_completion(router_tokenizer, tokenizer):
    backend = FakeBackend(router_tokenizer, reply=" Paris.")
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)

    async def body():
        async with openai_serving(backend) as served, served.async_client() as client:
            whole = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                    echo=True, n=2)
            stream = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, echo=True, stream=True)
            streamed = "".join([c.choices[0].text async for c in stream if c.choices])
            plain = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
            return whole, streamed, plain

    whole, streamed, plain = asyncio.run(body())
    reply = plain.choices[0].text
    assert reply and not reply.startswith("The capital")
    assert len(whole.choices) == 2 and all(c.text.startswith("The capital of France is") for c in whole.choices)
    assert whole.choices[0].text == "The capital of France is" + reply
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True) + reply
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens
