"""OpenAI bodies -> GenerateRequest, without a server: what is read, and that any JSON at all
ends in a request or a 400/404 APIError, never another exception."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.router.limits import RequestLimits
from tandem.router.openai.errors import APIError
from tandem.router.openai.protocol import CHAT, COMPLETION, parse_request
from tandem.router.openai.validated import validated_all

MODEL = "m"


def test_chat_reads_messages_parts_and_roles():
    parsed = parse_request(CHAT, {"model": MODEL, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "tool_calls": []},
    ], "temperature": None, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}, MODEL, "r1")
    messages = [(m.role, m.content) for m in parsed.request.messages.messages]
    assert messages == [("system", "Be brief."), ("user", "a\nb"), ("assistant", "ok")]
    assert not parsed.request.sampling.HasField("temperature")  # null: not given
    assert parsed.request.request_id == "r1" and parsed.max_tokens_param is None


def test_completion_prompts_a_batch_of_one_and_token_ids():
    assert parse_request(COMPLETION, {"prompt": ["hi"]}, MODEL, "r").request.prompt == "hi"
    assert list(parse_request(COMPLETION, {"prompt": [[5, 6]]}, MODEL, "r").request.token_ids.ids) == [5, 6]
    parsed = parse_request(COMPLETION, {"prompt": [5, 6], "logprobs": 0, "best_of": 2, "n": 2, "echo": False,
                                        "stream": True, "stream_options": {"include_usage": True}}, MODEL, "r")
    assert list(parsed.request.token_ids.ids) == [5, 6] and parsed.logprobs == 0
    assert parsed.request.sampling.HasField("logprobs") and parsed.request.sampling.logprobs == 0
    assert parsed.stream and parsed.include_usage and parsed.request.sampling.n == 2


def test_chat_max_tokens_unset_takes_the_room_left(router_tokenizer):
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    valid = validated_all(parse_request(CHAT, body, MODEL, "r"), router_tokenizer, RequestLimits())[0]
    assert valid.params.max_tokens == router_tokenizer.max_model_len - len(valid.prompt_token_ids)
    valid = validated_all(parse_request(COMPLETION, {"prompt": "Hi"}, MODEL, "r"), router_tokenizer, RequestLimits())[0]
    assert valid.params.max_tokens == 16  # OpenAI's default for completions, as SamplingParams'


def _json() -> st.SearchStrategy:
    scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4)
               | st.sampled_from(["text", "user", "system", MODEL, "image_url", "\ud800", "json_object",
                                  "json_schema"]))
    keys = st.sampled_from(["type", "text", "role", "content", "name", "include_usage", "x", "json_schema", "schema",
                            "json", "regex", "choice", "json_object"])
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                        max_leaves=8)


_PARAMETERS = st.sampled_from([
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed", "stop", "stream",
    "stream_options", "logprobs", "top_logprobs", "user", "top_k", "min_p", "ignore_eos", "use_beam_search",
    "beam_width", "length_penalty", "presence_penalty", "logit_bias", "best_of", "echo", "suffix", "tools",
    "tool_choice", "response_format", "stop_token_ids", "unknown", "repetition_penalty", "frequency_penalty",
    "min_tokens", "skip_special_tokens", "chat_template_kwargs", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice"])


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from([CHAT, COMPLETION]), extra=st.dictionaries(_PARAMETERS, _json(), max_size=3),
       hostile_input=st.none() | _json())
def test_any_json_is_a_request_or_an_api_error(router_tokenizer, kind, extra, hostile_input):
    name = "prompt" if kind == COMPLETION else "messages"
    good = "Hi" if kind == COMPLETION else [{"role": "user", "content": "Hi"}]
    body = {name: good if hostile_input is None else hostile_input, **extra}
    try:
        validated_all(parse_request(kind, body, MODEL, "r"), router_tokenizer, RequestLimits())
    except APIError as e:
        assert e.status in (400, 404) and e.message
        assert e.param is None or isinstance(e.param, str)
