"""Structured outputs on the real clusters, both modes: the prefill worker samples the first
token under the grammar's mask, the decode worker rebuilds the grammar's state from that token
and masks the rest. Every output, greedy and sampled, validates (jsonschema: independent of
the grammar library); a constraint that cannot compile is INVALID_ARGUMENT with nothing left."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
from completions_checks import completions
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema
from worker_checks import assert_workers_empty

from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

MODES = ["disaggregated", "colocated", "local"]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
}, "required": ["name", "age"], "additionalProperties": False}
QUESTION = 'Return a JSON object with keys "name" and "age" for Alice, 30.'
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]


@pytest.mark.parametrize("mode", MODES)
def test_json_schema_over_grpc_greedy_and_sampled(clusters, mode):
    cluster = clusters[mode]
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)])
    constraint = pb.StructuredOutputs(json_schema=json.dumps(PERSON))
    for sampling in (pb.SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint),
                     pb.SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=60, structured_outputs=constraint)):
        responses = list(cluster.stub().Generate(pb.GenerateRequest(messages=messages, sampling=sampling), timeout=120))
        for _, text, reason in completions(responses, sampling.n or 1):
            assert reason == pb.FINISH_REASON_STOP, text
            jsonschema.validate(json.loads(text), PERSON)
    regex = pb.SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=20,
                              structured_outputs=pb.StructuredOutputs(regex="[0-9]{2}:[0-9]{2}"))
    responses = list(cluster.stub().Generate(pb.GenerateRequest(prompt="The time is", sampling=regex), timeout=120))
    assert [len(text) for _, text, _ in completions(responses, 2)] == [5, 5]
    with pytest.raises(grpc.RpcError) as caught:
        list(cluster.stub().Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(
            structured_outputs=pb.StructuredOutputs(regex="[a-"))), timeout=120))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in caught.value.details()
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES[:2])  # (the OpenAI layer: the same over every prefill path)
def test_response_format_through_the_official_client(clusters, mode):
    cluster = clusters[mode]
    client = openai.OpenAI(base_url=cluster.openai_url(), api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    schema: ResponseFormatJSONSchema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = client.chat.completions.create(model=model, messages=MESSAGES, response_format=schema, temperature=0.8,
                                         seed=2, n=2, max_tokens=60)
    for choice in out.choices:
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "json_object"},
                                            temperature=0, max_tokens=60, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)
    assert_workers_empty(cluster)
