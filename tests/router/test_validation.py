"""validate_request: every bad field is refused with its name; good requests become worker inputs."""

from __future__ import annotations

import math
import re

import pytest
from router_harness import MAX_MODEL_LEN, VOCAB_SIZE

from tandem.proto import generation_pb2 as pb
from tandem.router.limits import RequestLimits
from tandem.router.validation import validate_request
from tandem.sampling_params import SamplingParams
from tandem.structured_outputs import StructuredOutputsParams


def request(**fields) -> pb.GenerateRequest:
    sampling = fields.pop("sampling", {})
    messages = fields.pop("messages", None)
    token_ids = fields.pop("token_ids", None)
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields)
    if messages is not None:
        req.messages.SetInParent()
        for role, content in messages:
            req.messages.messages.add(role=role, content=content)
    if token_ids is not None:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(token_ids)
    return req


def so(**constraint) -> pb.StructuredOutputs:
    return pb.StructuredOutputs(**constraint)


# (case, request fields, the field the error must name)
BAD_REQUESTS = [
    ("no input", {}, "input"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty token_ids", {"token_ids": []}, "token_ids"),
    ("empty messages", {"messages": []}, "messages"),
    ("token id negative", {"token_ids": [1, -5]}, "token_ids[1]"),
    ("token id past vocab", {"token_ids": [VOCAB_SIZE]}, "token_ids[0]"),
    ("token ids over the limit", {"token_ids": [5] * MAX_MODEL_LEN}, "token_ids"),
    ("prompt over the limit", {"prompt": "hello " * MAX_MODEL_LEN}, "prompt"),
    ("chat over the limit", {"messages": [("user", "hello " * MAX_MODEL_LEN)]}, "messages"),
    ("unknown role", {"messages": [("user", "hi"), ("wizard", "abracadabra")]}, "messages[1].role"),
    ("empty role", {"messages": [("", "hi")]}, "messages[0].role"),
    ("zero max_tokens", {"prompt": "hi", "sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
    ("negative max_tokens", {"prompt": "hi", "sampling": {"max_tokens": -3}}, "sampling.max_tokens"),
    ("NaN temperature", {"prompt": "hi", "sampling": {"temperature": math.nan}}, "sampling.temperature"),
    ("inf temperature", {"prompt": "hi", "sampling": {"temperature": math.inf}}, "sampling.temperature"),
    ("negative temperature", {"prompt": "hi", "sampling": {"temperature": -0.1}}, "sampling.temperature"),
    ("zero top_p", {"prompt": "hi", "sampling": {"top_p": 0.0}}, "sampling.top_p"),
    ("top_p above 1", {"prompt": "hi", "sampling": {"top_p": 1.5}}, "sampling.top_p"),
    ("top_k below -1", {"prompt": "hi", "sampling": {"top_k": -2}}, "sampling.top_k"),
    ("min_p above 1", {"prompt": "hi", "sampling": {"min_p": 2.0}}, "sampling.min_p"),
    ("empty stop string", {"prompt": "hi", "sampling": {"stop": ["ok", ""]}}, "sampling.stop"),
    ("negative stop token", {"prompt": "hi", "sampling": {"stop_token_ids": [-1]}}, "sampling.stop_token_ids"),
    ("stop token past vocab", {"prompt": "hi", "sampling": {"stop_token_ids": [2, VOCAB_SIZE + 1]}},
     "sampling.stop_token_ids[1]"),
    ("logprobs past 20", {"prompt": "hi", "sampling": {"logprobs": 21}}, "sampling.logprobs"),
    ("negative logprobs", {"prompt": "hi", "sampling": {"logprobs": -1}}, "sampling.logprobs"),
    ("top logprobs with beam search", {"prompt": "hi", "sampling": {"logprobs": 2, "use_beam_search": True,
                                                                   "temperature": 0}}, "sampling.logprobs"),
    ("no constraint set", {"prompt": "hi", "sampling": {"structured_outputs": so()}}, "sampling.structured_outputs"),
    ("json_object false", {"prompt": "hi", "sampling": {"structured_outputs": so(json_object=False)}},
     "sampling.structured_outputs.json_object"),
    ("schema not JSON", {"prompt": "hi", "sampling": {"structured_outputs": so(json_schema="{nope")}},
     "sampling.structured_outputs.json_schema"),
    ("schema a number", {"prompt": "hi", "sampling": {"structured_outputs": so(json_schema="3")}},
     "sampling.structured_outputs.json_schema"),
    ("schema nested too deep", {"prompt": "hi", "sampling": {"structured_outputs": so(json_schema="[" * 100_000)}},
     "sampling.structured_outputs.json_schema"),
    ("empty regex", {"prompt": "hi", "sampling": {"structured_outputs": so(regex="")}},
     "sampling.structured_outputs.regex"),
    ("regex past the limit", {"prompt": "hi", "sampling": {"structured_outputs": so(regex="a" * (2**16 + 1))}},
     "sampling.structured_outputs.regex"),
    ("no choices", {"prompt": "hi", "sampling": {"structured_outputs": so(choice=pb.StringChoices())}},
     "sampling.structured_outputs.choice"),
    ("an empty choice", {"prompt": "hi", "sampling": {"structured_outputs": so(choice=pb.StringChoices(
        choices=["a", ""]))}}, "sampling.structured_outputs.choice[1]"),
    ("constraint with beam search", {"prompt": "hi", "sampling": {"structured_outputs": so(regex="a+"),
                                                                  "use_beam_search": True, "temperature": 0}},
     "sampling.structured_outputs"),
    ("request_id too long", {"prompt": "hi", "request_id": "x" * 129}, "request_id"),
    ("request_id odd characters", {"prompt": "hi", "request_id": "id with spaces\n"}, "request_id"),
    ("request_id slash", {"prompt": "hi", "request_id": "../../etc"}, "request_id"),
]


@pytest.mark.parametrize("fields, field", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_field_is_named(router_tokenizer, fields, field):
    with pytest.raises(ValueError) as error:
        validate_request(request(**fields), router_tokenizer)
    assert str(error.value).startswith(f"{field}: "), str(error.value)


def test_unset_sampling_fields_take_the_defaults(router_tokenizer):
    _, ids, params, _ = validate_request(request(prompt="Hello world"), router_tokenizer)
    assert params == SamplingParams()
    assert ids == router_tokenizer.encode("Hello world")


def test_zero_is_not_unset(router_tokenizer):
    # proto3 optional: temperature 0 (greedy) and top_k 0 must arrive, not become the defaults.
    params = validate_request(request(prompt="hi", sampling={"temperature": 0.0, "top_k": 0, "seed": 0}),
                              router_tokenizer).params
    assert params.temperature == 0.0 and params.top_k == 0 and params.seed == 0


def test_every_sampling_field_arrives(router_tokenizer):
    sampling = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 1234,
                "stop": ["\n\n", "END"], "stop_token_ids": [2, 0], "ignore_eos": True, "logprobs": 3}
    params = validate_request(request(prompt="hi", sampling=sampling), router_tokenizer).params
    assert params == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=1234,
                                    stop=("\n\n", "END"), stop_token_ids=(2, 0), ignore_eos=True, logprobs=3)


def test_request_id_kept_or_assigned(router_tokenizer):
    kept = validate_request(request(prompt="hi", request_id="client-7:a.b_c"), router_tokenizer).request_id
    assert kept == "client-7:a.b_c"
    first = validate_request(request(prompt="hi"), router_tokenizer).request_id
    second = validate_request(request(prompt="hi"), router_tokenizer).request_id
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second


def test_inputs_become_the_model_prompt(router_tokenizer):
    messages = [("system", "Be brief."), ("user", "Capital of France?")]
    ids = validate_request(request(messages=messages), router_tokenizer).prompt_token_ids
    assert ids == router_tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages])
    ids = validate_request(request(token_ids=[1, 2, VOCAB_SIZE - 1]), router_tokenizer).prompt_token_ids
    assert ids == [1, 2, VOCAB_SIZE - 1]


def test_longest_allowed_prompt_passes(router_tokenizer):
    ids = validate_request(request(token_ids=[5] * (MAX_MODEL_LEN - 1)), router_tokenizer).prompt_token_ids
    assert len(ids) == MAX_MODEL_LEN - 1


@pytest.mark.parametrize("constraint, expected", [
    (so(json_schema='{"type": "object", "properties": {"b": {}, "a": {}}}'),
     StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')),
    (so(json_object=True), StructuredOutputsParams(json_object=True)),
    (so(regex="[0-9]+"), StructuredOutputsParams(regex="[0-9]+")),
    (so(choice=pb.StringChoices(choices=["yes", "no"])), StructuredOutputsParams(choice=("yes", "no"))),
], ids=["json_schema", "json_object", "regex", "choice"])
def test_structured_outputs_arrive(router_tokenizer, constraint, expected):
    params = validate_request(request(prompt="hi", sampling={"structured_outputs": constraint}),
                              router_tokenizer).params
    assert params.structured_outputs == expected
    assert validate_request(request(prompt="hi"), router_tokenizer).params.structured_outputs is None


def test_logprobs_unset_zero_and_a_count(router_tokenizer):
    def logprobs(**sampling) -> int | None:
        return validate_request(request(prompt="hi", sampling=sampling), router_tokenizer).params.logprobs

    assert (logprobs(), logprobs(logprobs=0), logprobs(logprobs=20)) == (None, 0, 20)


def test_limits_bound_structured_outputs(router_tokenizer):
    limits = RequestLimits(max_structured_output_chars=10)
    for constraint in (so(regex="a" * 11), so(choice=pb.StringChoices(choices=["abcdef", "ghijk"]))):
        with pytest.raises(ValueError, match="max_structured_output_chars=10"):
            validate_request(request(prompt="hi", sampling={"structured_outputs": constraint}), router_tokenizer,
                             limits)
