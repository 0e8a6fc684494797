"""--served-model-name: the OpenAI API answers to each name, lists them all, reports the first;
any other name is model_not_found. Through OpenAI's own client."""

from __future__ import annotations

import asyncio

import openai
import pytest
from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving

NAMES = ["qwen-small", "Qwen/Qwen2.5-0.5B-Instruct"]


def test_every_served_name_is_answered_and_the_first_reported(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with openai_serving(backend, model_names=NAMES) as served:
            async with served.async_client() as client:
                listed = [m.id for m in (await client.models.list()).data]
                card = await client.models.retrieve(NAMES[1])
                answers = [await client.completions.create(model=name, prompt="hi", max_tokens=2) for name in NAMES]
                with pytest.raises(openai.NotFoundError) as missing:
                    await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                return listed, card, answers, missing.value

    listed, card, answers, missing = asyncio.run(body())
    assert listed == NAMES and card.id == NAMES[1]
    assert [a.model for a in answers] == [NAMES[0], NAMES[0]]
    assert missing.status_code == 404 and missing.body["code"] == "model_not_found"
    assert len(backend.seen) == 2


def test_chat_template_and_served_name_given_to_serve(router_tokenizer):
    """serve(chat_template=..., served_model_names=...) (tandem serve --chat-template,
    --served-model-name): messages are rendered with the given template, and the router's
    metrics carry the served name."""
    from router_harness import serving

    from tandem.proto import generation_pb2 as pb
    from tandem.proto import generation_pb2_grpc as pb_grpc

    backend = FakeBackend(router_tokenizer)
    template = "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"

    async def body():
        async with serving(backend, chat_template=template, served_model_names=NAMES) as (channel, _):
            request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2))
            request.messages.messages.add(role="user", content="Capital of France?")
            async for _ in pb_grpc.GenerationStub(channel).Generate(request):
                pass

    asyncio.run(body())
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(router_tokenizer.spec.tokenizer_json)
    expected = plain.encode("<<user: Capital of France?>>", add_special_tokens=False).ids
    assert backend.seen[0].prompt_token_ids == expected
    assert backend.metrics is not None and backend.metrics.model_name == NAMES[0]
