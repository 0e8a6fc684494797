"""Output constraints over the OpenAI API, as vLLM reads them: response_format (text,
json_object, json_schema) on both endpoints, vLLM's structured_outputs and the older guided_*
fields; each reaches the backend as the right StructuredOutputsParams. More than one, an
unknown response_format type, or a bad constraint is a 400 naming the fields."""

from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest
from fake_backend import FakeBackend
from openai.types.chat import ChatCompletionMessageParam
from openai_harness import MODEL, openai_serving

from tandem.router.limits import RequestLimits
from tandem.structured_outputs import StructuredOutputsParams

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Where is the Eiffel Tower?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))  # the body's key order, kept


def constraints() -> list[tuple[str, dict[str, object], StructuredOutputsParams | None]]:
    """(endpoint, body fields, what the backend must get)."""
    json_schema = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    return [
        ("chat", {"response_format": {"type": "text"}}, None),
        ("chat", {"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ("completions", {"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ("chat", {"response_format": json_schema}, StructuredOutputsParams(json=SCHEMA_TEXT)),
        ("completions", {"response_format": json_schema}, StructuredOutputsParams(json=SCHEMA_TEXT)),
        ("chat", {"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA_TEXT)),
        ("completions", {"structured_outputs": {"json": '{"type": "integer"}'}},
         StructuredOutputsParams(json='{"type": "integer"}')),
        ("chat", {"structured_outputs": {"regex": "[A-Z][a-z]+", "disable_fallback": True}},
         StructuredOutputsParams(regex="[A-Z][a-z]+")),
        ("completions", {"structured_outputs": {"choice": ["Paris", "Rome"]}},
         StructuredOutputsParams(choice=("Paris", "Rome"))),
        ("chat", {"structured_outputs": {"json_object": True, "regex": None}},
         StructuredOutputsParams(json_object=True)),
        ("completions", {"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA_TEXT)),
        ("chat", {"guided_regex": "\\d+"}, StructuredOutputsParams(regex="\\d+")),
        ("completions", {"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"},
         StructuredOutputsParams(choice=("yes", "no"))),
    ]


async def create(client: openai.AsyncOpenAI, endpoint: str, fields: dict[str, object], stream: bool = False) -> None:
    """One request to endpoint ("chat" or "completions") with these body fields as they are."""
    if endpoint == "chat":
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=fields,
                                             stream=stream)
    else:
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=fields, stream=stream)


def test_each_spelling_reaches_the_backend_as_structured_outputs_params(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            for endpoint, fields, _ in constraints():
                await create(client, endpoint, fields)
            await create(client, "chat", {"response_format": {"type": "json_object"}}, stream=True)

    asyncio.run(run())
    got = [seen.params.structured_outputs for seen in backend.seen]
    assert got[:-1] == [expected for _, _, expected in constraints()]
    assert got[-1] == StructuredOutputsParams(json_object=True)


class Place(pydantic.BaseModel):
    city: str
    country: str


def test_openais_own_parse_helper_sends_a_json_schema_and_reads_the_answer(router_tokenizer):
    backend = FakeBackend(router_tokenizer, reply='{"city": "Paris", "country": "France"}')

    async def run():
        async with openai_serving(backend) as served, served.async_client() as client:
            return await client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Place)

    answer = asyncio.run(run())
    assert answer.choices[0].message.parsed == Place(city="Paris", country="France")
    constraint = backend.seen[0].params.structured_outputs
    assert constraint is not None and constraint.json is not None
    schema = json.loads(constraint.json)
    assert schema["properties"].keys() == {"city", "country"} and schema["required"] == ["city", "country"]


def bad_constraints() -> list[tuple[str, dict[str, object], str, str]]:
    """(endpoint, body fields, the 400's param, how its message starts)."""
    return [
        ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format",
         "response_format, guided_regex: only one output constraint may be given per request, got 2"),
        ("completions", {"structured_outputs": {"json": SCHEMA, "regex": "a+"}}, "structured_outputs",
         "structured_outputs.json, structured_outputs.regex: only one output constraint"),
        ("completions", {"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_json",
         "guided_json, guided_choice: only one output constraint"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format",
         "response_format.type: must be one of text, json_object, json_schema, got 'xml'"),
        ("completions", {"response_format": {"type": "structural_tag"}}, "response_format",
         "response_format.type: must be one of"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format",
         "response_format.json_schema: must be an object with name and schema"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format",
         "response_format.json_schema.name: must be a string"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
         "response_format", "response_format.json_schema.schema: must be an object (a JSON Schema)"),
        ("completions", {"guided_json": "{not json"}, "guided_json", "guided_json: is not valid JSON"),
        ("completions", {"guided_json": "[1, 2]"}, "guided_json", "guided_json: must be a JSON Schema"),
        ("chat", {"guided_choice": []}, "guided_choice", "guided_choice: must hold 1 to 256 strings, got 0"),
        ("chat", {"guided_choice": ["a", ""]}, "guided_choice", "guided_choice[1]: must not be empty"),
        ("chat", {"guided_choice": "a"}, "guided_choice", "guided_choice: must be an array of strings"),
        ("completions", {"structured_outputs": {"regex": ""}}, "structured_outputs",
         "structured_outputs.regex: must not be empty"),
        ("completions", {"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs",
         "structured_outputs.grammar: is not supported"),
        ("completions", {"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs",
         "structured_outputs: unknown field 'jsn'"),
        ("completions", {"structured_outputs": {"disable_any_whitespace": True, "json_object": True}},
         "structured_outputs", "structured_outputs.disable_any_whitespace: is not supported"),
        ("completions", {"guided_grammar": "root ::= \"a\""}, "guided_grammar", "guided_grammar: is not supported"),
        ("chat", {"guided_regex": "a" * 101}, "guided_regex",
         "guided_regex: 101 characters, more than the limit max_structured_output_chars=100"),
        ("chat", {"guided_regex": "a+", "use_beam_search": True, "temperature": 0}, "guided_regex",
         "guided_regex: is not supported with beam search"),
    ]


def test_bad_constraints_are_400_naming_the_fields(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def run():
        errors = []
        async with openai_serving(backend, limits=RequestLimits(max_structured_output_chars=100)) as served, \
                served.async_client() as client:
            for endpoint, fields, _, _ in bad_constraints():
                with pytest.raises(openai.BadRequestError) as error:
                    await create(client, endpoint, fields)
                errors.append(error.value)
        return errors

    for (_, fields, param, start), error in zip(bad_constraints(), asyncio.run(run())):
        assert (error.status_code, error.param) == (400, param), (fields, error.body)
        assert error.body["message"].startswith(start), (fields, error.body["message"])
    assert not backend.seen
