"""RequestLimits: every limit refuses with INVALID_ARGUMENT naming the field and the limit,
the context check (prompt + max_tokens <= max_model_len), limits set by config or flags
take effect, and hostile bytes the proto layer refuses (invalid UTF-8)."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from fake_backend import FakeBackend
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_harness import MAX_MODEL_LEN, serving
from test_validation import request

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router import serve_command
from tandem.router.limits import DEFAULT_MAX_PROMPT_CHARS, RequestLimits, limits_from_args
from tandem.router.validation import validate_request

DEFAULTS = RequestLimits()

# (case, request fields, field the error names, the limit it names)
OVER_THE_DEFAULT_LIMITS = [
    ("stop strings", {"prompt": "hi", "sampling": {"stop": ["x"] * 17}}, "sampling.stop", "max_stop_strings=16"),
    ("stop string length", {"prompt": "hi", "sampling": {"stop": ["ok", "y" * 257]}}, "sampling.stop[1]",
     "max_stop_string_length=256"),
    ("stop token ids", {"prompt": "hi", "sampling": {"stop_token_ids": [2] * 65}}, "sampling.stop_token_ids",
     "max_stop_token_ids=64"),
    ("prompt characters", {"prompt": "a" * (DEFAULT_MAX_PROMPT_CHARS + 1)}, "prompt",
     f"max_prompt_chars={DEFAULT_MAX_PROMPT_CHARS}"),
    ("chat characters", {"messages": [("user", "a" * (DEFAULT_MAX_PROMPT_CHARS // 2))] * 3}, "messages",
     f"max_prompt_chars={DEFAULT_MAX_PROMPT_CHARS}"),
    ("messages", {"messages": [("user", "hi")] * 513}, "messages", "max_messages=512"),
    ("prompt tokens (token_ids)", {"token_ids": [5] * MAX_MODEL_LEN}, "token_ids",
     f"max_prompt_tokens={MAX_MODEL_LEN - 1}"),
    ("prompt tokens (text)", {"prompt": "hello " * MAX_MODEL_LEN}, "prompt", f"max_prompt_tokens={MAX_MODEL_LEN - 1}"),
    ("prompt tokens (chat)", {"messages": [("user", "hello " * MAX_MODEL_LEN)]}, "messages",
     f"max_prompt_tokens={MAX_MODEL_LEN - 1}"),
]


@pytest.mark.parametrize("fields, field, limit", [c[1:] for c in OVER_THE_DEFAULT_LIMITS],
                         ids=[c[0] for c in OVER_THE_DEFAULT_LIMITS])
def test_each_limit_names_the_field_and_the_limit(router_tokenizer, fields, field, limit):
    with pytest.raises(ValueError) as error:
        validate_request(request(**fields), router_tokenizer)
    message = str(error.value)
    assert message.startswith(f"{field}: ") and limit in message, message
    assert len(message) < 300, "an error never echoes the client's input at length"


def test_at_the_default_limits_passes(router_tokenizer):
    sampling = {"stop": [f"{i:03d}" + "y" * 253 for i in range(16)], "stop_token_ids": list(range(64)), "max_tokens": 1}
    params = validate_request(request(token_ids=[5] * (MAX_MODEL_LEN - 1), sampling=sampling), router_tokenizer).params
    assert len(params.stop) == 16 and len(params.stop_token_ids) == 64
    validate_request(request(messages=[("user", "hi"), ("assistant", "hi")] * 2), router_tokenizer)


# (case, limits, request fields within the defaults, field, limit named)
TIGHTER_BY_CONFIG = [
    ("stop strings", RequestLimits(max_stop_strings=2), {"prompt": "hi", "sampling": {"stop": ["a", "b", "c"]}},
     "sampling.stop", "max_stop_strings=2"),
    ("no stop strings", RequestLimits(max_stop_strings=0), {"prompt": "hi", "sampling": {"stop": ["a"]}},
     "sampling.stop", "max_stop_strings=0"),
    ("stop string length", RequestLimits(max_stop_string_length=4), {"prompt": "hi", "sampling": {"stop": ["12345"]}},
     "sampling.stop[0]", "max_stop_string_length=4"),
    ("stop token ids", RequestLimits(max_stop_token_ids=1), {"prompt": "hi", "sampling": {"stop_token_ids": [1, 2]}},
     "sampling.stop_token_ids", "max_stop_token_ids=1"),
    ("prompt characters", RequestLimits(max_prompt_chars=10), {"prompt": "a" * 11}, "prompt", "max_prompt_chars=10"),
    ("chat characters", RequestLimits(max_prompt_chars=10), {"messages": [("user", "hello"), ("assistant", "there!")]},
     "messages", "max_prompt_chars=10"),
    ("messages", RequestLimits(max_messages=2), {"messages": [("user", "a"), ("assistant", "b"), ("user", "c")]},
     "messages", "max_messages=2"),
    ("prompt tokens", RequestLimits(max_prompt_tokens=8), {"token_ids": [5] * 9}, "token_ids", "max_prompt_tokens=8"),
    ("prompt tokens (text)", RequestLimits(max_prompt_tokens=3), {"prompt": "one two three four five"}, "prompt",
     "max_prompt_tokens=3"),
]


@pytest.mark.parametrize("limits, fields, field, limit", [c[1:] for c in TIGHTER_BY_CONFIG],
                         ids=[c[0] for c in TIGHTER_BY_CONFIG])
def test_a_limit_set_by_config_takes_effect(router_tokenizer, limits, fields, field, limit):
    validate_request(request(**fields), router_tokenizer)  # within the defaults
    with pytest.raises(ValueError) as error:
        validate_request(request(**fields), router_tokenizer, limits)
    assert str(error.value).startswith(f"{field}: ") and limit in str(error.value), str(error.value)


def test_raised_limits_let_more_through_but_never_past_the_context(router_tokenizer):
    loose = RequestLimits(max_stop_strings=100, max_stop_token_ids=1000, max_prompt_tokens=10 * MAX_MODEL_LEN)
    params = validate_request(request(prompt="hi", sampling={"stop": ["s"] * 100, "stop_token_ids": [3] * 1000}),
                              router_tokenizer, loose).params
    assert len(params.stop) == 100 and len(params.stop_token_ids) == 1000
    with pytest.raises(ValueError, match=rf"^token_ids: .*max_prompt_tokens={MAX_MODEL_LEN - 1} \(max_model_len"):
        validate_request(request(token_ids=[5] * MAX_MODEL_LEN), router_tokenizer, loose)


def test_max_tokens_past_the_context_names_both_numbers(router_tokenizer):
    prompt = [5] * 200
    with pytest.raises(ValueError) as error:
        validate_request(request(token_ids=prompt, sampling={"max_tokens": 57}), router_tokenizer)
    message = str(error.value)
    assert message.startswith("sampling.max_tokens: "), message
    for number in ("200", "57", "257", f"max_model_len={MAX_MODEL_LEN}", "at most 56"):
        assert number in message, (number, message)
    # Exactly filling the context is allowed.
    params = validate_request(request(token_ids=prompt, sampling={"max_tokens": 56}), router_tokenizer).params
    assert params.max_tokens == 56
    with pytest.raises(ValueError, match="^sampling.max_tokens: .*2147483647"):
        validate_request(request(prompt="hi", sampling={"max_tokens": 2**31 - 1}), router_tokenizer)


def test_unset_max_tokens_is_clamped_to_the_room_left(router_tokenizer):
    default = validate_request(request(token_ids=[5] * 10), router_tokenizer).params.max_tokens
    assert default == 16  # SamplingParams' default, room permitting
    params = validate_request(request(token_ids=[5] * (MAX_MODEL_LEN - 3)), router_tokenizer).params
    assert params.max_tokens == 3
    params = validate_request(request(token_ids=[5] * (MAX_MODEL_LEN - 1)), router_tokenizer).params
    assert params.max_tokens == 1


def test_bad_limits_are_refused():
    for bad in ({"max_stop_strings": -1}, {"max_prompt_chars": 0}, {"max_prompt_tokens": 0}, {"max_messages": 1.5},
                {"max_stop_string_length": True}):
        with pytest.raises(ValueError, match=f"RequestLimits.{next(iter(bad))} must be"):
            RequestLimits(**bad)


def test_serve_flags_become_the_limits():
    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    assert limits_from_args(parser.parse_args([])) == RequestLimits()
    args = parser.parse_args(["--max-stop-strings", "3", "--max-stop-string-length", "9", "--max-stop-token-ids", "0",
                              "--max-prompt-chars", "1000", "--max-messages", "4", "--max-prompt-tokens", "100"])
    assert limits_from_args(args) == RequestLimits(max_stop_strings=3, max_stop_string_length=9, max_stop_token_ids=0,
                                                   max_prompt_chars=1000, max_messages=4, max_prompt_tokens=100)
    for bad in (["--max-messages", "0"], ["--max-stop-strings", "-1"], ["--max-prompt-chars", "lots"]):
        with pytest.raises(SystemExit):  # argparse's error, before any worker starts
            parser.parse_args(bad)


def test_serve_passes_the_limits_to_the_servicer(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    few_stops = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop=["a", "b"], max_tokens=2))

    async def body(limits):
        async with serving(backend, limits=limits) as (channel, _):
            try:
                return [r async for r in pb_grpc.GenerationStub(channel).Generate(few_stops)]
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

    assert len(asyncio.run(body(None))) == 2
    code, details = asyncio.run(body(RequestLimits(max_stop_strings=1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("sampling.stop: ") and "max_stop_strings=1" in details


def test_invalid_utf8_is_refused_with_invalid_argument(router_tokenizer):
    """A proto string field with bad UTF-8 never reaches validation or the backend: protobuf
    refuses the bytes while parsing, and the call ends INVALID_ARGUMENT naming the message
    (not grpc's UNKNOWN for a failed parse). Abort likewise. The server keeps serving."""
    backend = FakeBackend(router_tokenizer)
    good = pb.GenerateRequest(request_id="utf8-probe", prompt="ab", sampling=pb.SamplingParams(max_tokens=1))
    raw = good.SerializeToString()
    bad_bytes = [raw.replace(b"ab", b"\xff\xfe"),  # prompt
                 raw.replace(b"utf8-probe", b"utf8\xc0\xafprob"),  # request_id: an overlong "/"
                 raw.replace(b"ab", b"\xed\xa0"),  # half of a UTF-8-encoded surrogate
                 pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="zz")]))
                 .SerializeToString().replace(b"zz", b"\xe2\x82")]  # a cut 3-byte character

    async def body():
        async with serving(backend) as (channel, _):
            generate = channel.unary_stream("/tandem.v1.Generation/Generate", request_serializer=lambda b: b,
                                            response_deserializer=pb.GenerateResponse.FromString)
            statuses = []
            for data in bad_bytes:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    [r async for r in generate(data)]
                statuses.append((error.value.code(), error.value.details()))
            abort = channel.unary_unary("/tandem.v1.Generation/Abort", request_serializer=lambda b: b,
                                        response_deserializer=pb.AbortResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await abort(pb.AbortRequest(request_ids=["zz"]).SerializeToString().replace(b"zz", b"\xff\xff"))
            statuses.append((error.value.code(), error.value.details()))
            ok = [r async for r in generate(raw)]
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            return statuses, ok, health.status

    statuses, ok, health = asyncio.run(body())
    for code, details in statuses:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request: not a valid tandem.v1."), \
            (code, details)
    assert "AbortRequest" in statuses[-1][1]
    assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert [s.request_id for s in backend.seen] == ["utf8-probe"]  # nothing else reached the backend


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nan_and_infinities_are_refused_in_every_float_field(router_tokenizer, field, value):
    with pytest.raises(ValueError, match=rf"^sampling\.{field}: "):
        validate_request(request(prompt="hi", sampling={field: value}), router_tokenizer)


def test_a_message_past_grpcs_receive_limit_is_resource_exhausted(router_tokenizer):
    """A message longer than any request may be (RequestLimits.max_body_bytes) is refused by
    gRPC before the servicer runs."""
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with serving(backend) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in stub.Generate(pb.GenerateRequest(prompt="a" * RequestLimits().max_body_bytes))]
            one_token = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=1))
            ok = [r async for r in stub.Generate(one_token)]
            return error.value.code(), ok

    code, ok = asyncio.run(body())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ok[-1].usage.completion_tokens == 1 and len(backend.seen) == 1
