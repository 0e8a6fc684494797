"""The OpenAI-compatible API on a real cluster, through OpenAI's official client: the streamed
and the whole greedy answers are the same, and the same as the gRPC API's."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from worker_checks import assert_workers_empty

from tandem import SamplingParams
from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

# The OpenAI layer is the router's, the same over every prefill path: "local" (prefilled on the
# decode workers) is covered below the router by the gRPC tests (test_cluster, test_completions_cluster).
MODES = ["disaggregated", "colocated"]
QUESTION = "What is the capital of France?"


def _grpc_text(cluster, **input_fields) -> str:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0, max_tokens=24), **input_fields)
    return "".join(r.text for r in cluster.stub().Generate(request, timeout=120))


@pytest.mark.parametrize("mode", MODES)
def test_chat_streamed_whole_and_grpc_agree(clusters, mode):
    cluster = clusters[mode]
    client = openai.OpenAI(base_url=cluster.openai_url(), api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = _grpc_text(cluster, messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)]))
    assert whole.choices[0].message.content == streamed == expected
    assert "Paris" in expected
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_async_completions_agree_with_grpc(clusters, mode):
    cluster = clusters[mode]

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=cluster.openai_url(), api_key="unused", max_retries=0)
        model = (await client.models.list()).data[0].id
        whole = await client.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                                max_tokens=24)
        stream = await client.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                                 max_tokens=24, stream=True)
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        await client.close()
        return whole.choices[0].text, streamed

    whole, streamed = asyncio.run(run())
    assert whole == streamed == _grpc_text(cluster, prompt="The capital of France is")
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_n_choices_and_bad_input_on_a_cluster(clusters, mode):
    cluster = clusters[mode]
    client = openai.OpenAI(base_url=cluster.openai_url(), api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                         n=3, seed=5, temperature=0.9, max_tokens=12)
    request = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Name a colour.")]),
        sampling=pb.SamplingParams(n=3, seed=5, temperature=0.9, max_tokens=12))
    grpc_texts = ["", "", ""]
    for r in cluster.stub().Generate(request, timeout=120):
        grpc_texts[r.index] += r.text
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert [c.message.content for c in sorted(out.choices, key=lambda c: c.index)] == grpc_texts
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "temperature"
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_vllm_bench_serves_request_shape_and_penalties(clusters, mode, make_llm):
    """What `vllm bench serve` sends (streamed completions with repetition_penalty 1.0,
    ignore_eos, stream_options) is served unmodified, by raw HTTP; and penalties, a logit bias
    and min_tokens give what one engine gives (the prefill worker samples the first token with
    them, the decode worker the rest)."""
    cluster = clusters[mode]
    client = openai.OpenAI(base_url=cluster.openai_url(), api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    bench = {"model": model, "prompt": "The capital of France is", "temperature": 0.0, "repetition_penalty": 1.0,
             "max_tokens": 12, "logprobs": None, "best_of": 1, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True}
    request = urllib.request.Request(f"{cluster.openai_url()}/completions", data=json.dumps(bench).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [line.removeprefix(b"data: ") for line in response.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 12  # ignore_eos: all of them
    same = pb.GenerateRequest(prompt="The capital of France is",
                              sampling=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "".join(
        r.text for r in cluster.stub().Generate(same, timeout=120))

    prompt = "one two three one two three one two three one two"
    asked: dict[str, Any] = dict(temperature=0, max_tokens=12, frequency_penalty=0.8, logit_bias={"11": 5.0},
                                 extra_body={"repetition_penalty": 1.2, "min_tokens": 10})
    got = client.completions.create(model=model, prompt=prompt, **asked).choices[0].text
    expected = make_llm().generate(prompt, SamplingParams(temperature=0, max_tokens=12, frequency_penalty=0.8,
                                                          logit_bias={11: 5.0}, repetition_penalty=1.2,
                                                          min_tokens=10))[0].text
    assert got == expected
    assert_workers_empty(cluster)

    # The loads the router polls count the work (router/pool_stats.py logs them every 10 s).
    loads = cluster.run(cluster.backend.loads())
    for role in {w.role for w in loads}:
        pool = [w for w in loads if w.role is role]
        assert sum(w.num_generated_tokens for w in pool) > 0 and sum(w.num_prefix_queries for w in pool) > 0, pool
    assert sum(w.num_prompt_tokens for w in loads if w.role.value != "decode") > 0
