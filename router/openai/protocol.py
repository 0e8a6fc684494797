"""OpenAI request bodies -> ``tandem.v1.GenerateRequest``, checked by the gRPC API's own validation.

``parse_request`` reads a JSON body of ``/v1/completions`` or ``/v1/chat/completions`` into
protobuf requests (one per prompt: completions take a list of prompts, ``prompts.py``) plus
the options that only shape the response (stream, usage, logprobs); ``validated.py`` then
runs ``router.validation.validate_request`` on each, so both APIs accept and refuse exactly
the same requests. Every refusal is an ``APIError`` in OpenAI's shape whose ``param`` names
the OpenAI parameter. Output constraints are read by ``constraints.py``, log-probability
counts by ``logprobs.py``.

Parameters OpenAI or vLLM know but tandem does not implement are refused unless they hold
their neutral value (``tools: []``, ``guided_grammar`` unset, ...): a client that asks for
something must not silently get something else. Parameters nobody here knows are ignored
with a debug log, as vLLM ignores them. ``null`` means "not given", as in OpenAI.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.proto import generation_pb2 as pb
from tandem.router.openai.chat_messages import chat_messages
from tandem.router.openai.constraints import BODY_FIELDS as CONSTRAINT_FIELDS
from tandem.router.openai.constraints import output_constraint
from tandem.router.openai.errors import APIError, invalid
from tandem.router.openai.fields import boolean, int64, integer, json_kind, number, string
from tandem.router.openai.logprobs import requested_logprobs
from tandem.router.openai.prompts import Prompt, completion_prompts
from tandem.router.validation import shown

logger = logging.getLogger(__name__)

COMPLETION = "completion"
MAX_TEMPLATE_KWARGS = 32
CHAT = "chat"


@dataclass(frozen=True)
class ParsedRequest:
    """A body read into the gRPC request, and what shapes the answer."""

    kind: str
    """COMPLETION or CHAT."""
    base: pb.GenerateRequest
    """The request but for its prompt (chat: with its messages, the whole request)."""
    prompts: tuple[Prompt, ...]
    """Completions: the prompts, in the order given (each a request: ``prompt_request``)."""
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with the usage."""
    logprobs: int | None
    """sampling.logprobs: None none, 0 the chosen tokens', N also the N most likely at each position."""
    max_tokens_param: str | None
    """The parameter that set sampling.max_tokens (max_tokens or max_completion_tokens); None: unset."""
    echo: bool = False
    """Completions: each choice's text starts with the prompt's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Chat: more variables for the chat template (vLLM's field, e.g. {"enable_thinking": false})."""
    continuous_usage: bool = False
    """stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far."""
    constraint_field: str | None = None
    """Where the body gave its output constraint (``response_format.json_schema.schema``, ...)."""

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.kind == COMPLETION else 1

    def prompt_request(self, index: int) -> pb.GenerateRequest:
        """Prompt ``index``'s request (with several, its id is the request's with "-index" after
        it, as vLLM numbers them). Built on demand: the caller bounds the number of prompts and
        the sampling fields' sizes before copying the request once per prompt."""
        if self.kind != COMPLETION:
            return self.base
        request = pb.GenerateRequest()
        request.CopyFrom(self.base)
        if len(self.prompts) > 1:
            request.request_id = f"{self.base.request_id}-{index}"
        prompt = self.prompts[index]
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return request

    @property
    def request(self) -> pb.GenerateRequest:
        """The first prompt's request (the only one, but for a list of prompts)."""
        return self.prompt_request(0)

    @property
    def input_param(self) -> str:
        return "prompt" if self.kind == COMPLETION else "messages"


# Body parameter -> (GenerateRequest.sampling field, reader). Past OpenAI's own, tandem's
# extensions as extra body fields (openai: extra_body={"top_k": 20}), vLLM's names.
_SAMPLING: dict[str, tuple[str, Callable[[str, object], Any]]] = {
    "temperature": ("temperature", number),
    "top_p": ("top_p", number),
    "n": ("n", integer),
    "seed": ("seed", int64),
    "top_k": ("top_k", integer),
    "min_p": ("min_p", number),
    "ignore_eos": ("ignore_eos", boolean),
    "use_beam_search": ("use_beam_search", boolean),
    "beam_width": ("beam_width", integer),
    "length_penalty": ("length_penalty", number),
    "cache_salt": ("cache_salt", string),
    "presence_penalty": ("presence_penalty", number),
    "frequency_penalty": ("frequency_penalty", number),
    "repetition_penalty": ("repetition_penalty", number),
    "min_tokens": ("min_tokens", integer),
    "skip_special_tokens": ("skip_special_tokens", boolean),
    "include_stop_str_in_output": ("include_stop_str_in_output", boolean),
}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "stop_token_ids", "logprobs", "logit_bias",
           "priority", *_SAMPLING, *CONSTRAINT_FIELDS}
# Identifiers for the caller's own bookkeeping: accepted, and without effect on the output.
_IGNORED = {"user", "safety_identifier", "prompt_cache_key"}
_ALLOWED = {COMPLETION: _COMMON | _IGNORED | {"prompt", "echo"},
            CHAT: _COMMON | _IGNORED | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"}}


# Known parameters that tandem does not implement: accepted only with a value that changes
# nothing (what a client library may send by default); any other value is refused.
_NEUTRAL_BOTH: dict[str, Callable[[object, dict[str, Any]], bool]] = {
    # vLLM's extensions, at their defaults.
    "spaces_between_special_tokens": lambda v, b: v is True,
    "guided_grammar": lambda v, b: False,
    "guided_whitespace_pattern": lambda v, b: False,
    "guided_decoding_backend": lambda v, b: isinstance(v, str),  # one backend here: any name
    "prompt_logprobs": lambda v, b: v == 0,
}
_NEUTRAL = {
    COMPLETION: {**_NEUTRAL_BOTH,
                 "suffix": lambda v, b: v == "",
                 "best_of": lambda v, b: type(v) is int and v == (b.get("n") or 1)},
    CHAT: {**_NEUTRAL_BOTH,
           "tools": lambda v, b: v == [],
           "functions": lambda v, b: v == [],
           "tool_choice": lambda v, b: v == "none",
           "function_call": lambda v, b: v == "none",
           "parallel_tool_calls": lambda v, b: isinstance(v, bool),  # no tools, so nothing runs in parallel
           "modalities": lambda v, b: v == ["text"],
           "store": lambda v, b: v is False,
           "metadata": lambda v, b: isinstance(v, dict),  # only kept with store, which is off
           "service_tier": lambda v, b: v in ("auto", "default"),
           "add_generation_prompt": lambda v, b: v is True,
           "continue_final_message": lambda v, b: v is False},
}


def parse_request(kind: str, body: object, model_names: str | Sequence[str], request_id: str) -> ParsedRequest:
    """A decoded JSON body of the ``kind`` endpoint -> the request (APIError when refused).

    A ``model`` not among ``model_names`` (one name, or the served names) is a 404
    ``model_not_found`` (as OpenAI answers); an absent one means the served model.
    """
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
    try:
        return _parse(kind, body, names, request_id)
    except UnicodeEncodeError as e:  # protobuf strings must be UTF-8; JSON can spell "\ud800"
        raise invalid(None, "the request holds a lone surrogate (\\ud800-\\udfff), which is not text") from e


def _parse(kind: str, body: object, model_names: tuple[str, ...], request_id: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {json_kind(body)}")
    _check_parameter_names(kind, body)
    given = {name: value for name, value in body.items() if value is not None}
    model = given.get("model", model_names[0])
    if model not in model_names:
        shown_model = shown(model) if isinstance(model, str) else json_kind(model)
        raise APIError(404, f"The model {shown_model} does not exist: this server serves {model_names[0]!r}",
                       param="model", code="model_not_found")
    request = pb.GenerateRequest(request_id=request_id)
    if "priority" in given:  # vLLM's extra field (GenerateRequest.priority; validation checks the policy)
        request.priority = integer("priority", given["priority"])
    sampling = request.sampling
    for name, (field, read) in _SAMPLING.items():
        if name in given:
            setattr(sampling, field, read(name, given[name]))
    max_tokens_param = None
    for name in ("max_tokens", "max_completion_tokens"):  # the latter (chat's newer name) wins
        if name in given:
            max_tokens_param = name
    if max_tokens_param is not None:
        sampling.max_tokens = integer(max_tokens_param, given[max_tokens_param])
    sampling.stop.extend(_stop(given.get("stop")))
    sampling.stop_token_ids.extend(_token_ids("stop_token_ids", given.get("stop_token_ids", [])))
    sampling.logit_bias.update(_logit_bias(given.get("logit_bias", {})))
    stream = boolean("stream", given.get("stream", False))
    include_usage, continuous_usage = _stream_options(given.get("stream_options"), stream)
    logprobs = requested_logprobs(kind == CHAT, given)
    if logprobs is not None:
        sampling.logprobs = logprobs
    echo = kind == COMPLETION and boolean("echo", given.get("echo", False))
    if echo and logprobs is not None:
        raise invalid("echo", "with logprobs is not supported (it would need the prompt's log-probabilities)")
    constraint = output_constraint(given)
    if constraint is not None:
        sampling.structured_outputs.CopyFrom(constraint.message)
    prompts: tuple[Prompt, ...] = ()
    if kind == COMPLETION:
        prompts = tuple(completion_prompts(given.get("prompt")))
        for prompt in prompts:  # (each goes into a request later, built on demand: checked now)
            if isinstance(prompt, str):
                prompt.encode("utf-8")
    else:
        request.messages.messages.extend(chat_messages(given.get("messages")))
    template_kwargs = _template_kwargs(given.get("chat_template_kwargs")) if kind == CHAT else None
    return ParsedRequest(kind, request, prompts, stream, include_usage, logprobs, max_tokens_param, echo,
                         template_kwargs, continuous_usage, constraint.field if constraint is not None else None)


def _check_parameter_names(kind: str, body: dict[str, Any]) -> None:
    for name, value in body.items():
        if value is None or name in _ALLOWED[kind]:
            continue
        neutral = _NEUTRAL[kind].get(name)
        param = name[:100]
        if neutral is None:
            logger.debug("ignored an unknown request field %s", shown(name))
            continue
        if not neutral(value, body):
            raise invalid(param, "is not supported by this server (only its neutral value is accepted)")


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop", "must be a string or an array of strings")
    return value


def _token_ids(name: str, value: object) -> list[int]:
    if not isinstance(value, list):
        raise invalid(name, f"must be an array of token ids, got {json_kind(value)}")
    for i, token_id in enumerate(value):
        integer(f"{name}[{i}]", token_id)
    return value


def _template_kwargs(value: object) -> dict[str, Any] | None:
    """chat_template_kwargs: an object of at most MAX_TEMPLATE_KWARGS variables named as Jinja names."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs", f"must be an object, got {json_kind(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise invalid("chat_template_kwargs", f"must name at most {MAX_TEMPLATE_KWARGS} variables, each an identifier")
    return value


def _logit_bias(value: object) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias} (JSON keys are strings)."""
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"must be an object mapping token ids to biases, got {json_kind(value)}")
    bias = {}
    for key, b in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise invalid("logit_bias", f"keys must be token ids, got {shown(str(key), 40)}")
        bias[int(key)] = number(f"logit_bias[{key}]", b)
    return bias


def _stream_options(value: object, stream: bool) -> tuple[bool, bool]:
    """-> (include_usage, continuous usage: every chunk with the usage so far, as vLLM's
    continuous_usage_stats with include_usage)."""
    if value is None:
        return False, False
    if not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    if not isinstance(value, dict):
        raise invalid("stream_options", f"must be an object, got {json_kind(value)}")
    for key in value:
        if key not in ("include_usage", "include_obfuscation", "continuous_usage_stats"):
            raise invalid("stream_options", f"unknown option {shown(str(key))}")
    # (No obfuscation here: nothing to turn off.)
    include_usage, continuous = (False if value.get(key) is None else boolean(f"stream_options.{key}", value[key])
                                 for key in ("include_usage", "continuous_usage_stats"))
    return include_usage, include_usage and continuous

