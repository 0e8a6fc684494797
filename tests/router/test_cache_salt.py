"""cache_salt (vLLM's name) reaches the workers' SamplingParams from both front doors, and a
bad one is refused naming the field."""

from __future__ import annotations

import pytest

from tandem.proto import generation_pb2 as pb
from tandem.router.limits import RequestLimits
from tandem.router.openai.errors import APIError
from tandem.router.openai.protocol import COMPLETION, parse_request
from tandem.router.openai.validated import validated_all
from tandem.router.validation import validate_request
from tandem.sampling_params import MAX_CACHE_SALT_CHARS

MODEL = "SmolLM2-135M-Instruct"


def test_grpc_and_openai_carry_the_salt(router_tokenizer):
    grpc_request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(cache_salt="acme"))
    assert validate_request(grpc_request, router_tokenizer).params.cache_salt == "acme"
    assert validate_request(pb.GenerateRequest(prompt="hi"), router_tokenizer).params.cache_salt is None
    parsed = parse_request(COMPLETION, {"model": MODEL, "prompt": "hi", "cache_salt": "bobs"}, MODEL, "r")
    assert validated_all(parsed, router_tokenizer, RequestLimits())[0].params.cache_salt == "bobs"


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_salt_is_refused_naming_it(router_tokenizer, salt):
    with pytest.raises(ValueError, match="^sampling.cache_salt: must be a non-empty string"):
        validate_request(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(cache_salt=salt)),
                         router_tokenizer)


def test_openai_refuses_a_salt_that_is_not_a_string():
    with pytest.raises(APIError) as error:
        parse_request(COMPLETION, {"model": MODEL, "prompt": "hi", "cache_salt": 7}, MODEL, "r")
    assert error.value.status == 400 and error.value.message.startswith("cache_salt: must be a string")
