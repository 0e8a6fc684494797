"""Turn a ``tandem.v1.GenerateRequest`` into what the workers take, or say which field is wrong.

Every error is a ``ValueError`` whose message starts with the field's path in the request
(``"sampling.temperature: ..."``, ``"messages[1].role: ..."``): the servicer sends it as
the INVALID_ARGUMENT details, so a client can tell what to fix. A request past one of the
``RequestLimits`` is refused the same way, its message naming the limit
(``"sampling.stop: 20 stop strings, more than the limit max_stop_strings=16"``). Sizes are
checked before the costly work they bound (counting before tokenizing, ...), and an error
never echoes more than a few characters of what the client sent.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

from tandem.config.engine_options import PRIORITY_POLICY
from tandem.proto import generation_pb2 as pb
from tandem.router.limits import RequestLimits
from tandem.router.tokenizer import ChatTemplateError, RouterTokenizer
from tandem.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.structured_outputs import MAX_CHOICES, StructuredOutputsParams

MAX_REQUEST_ID_LENGTH = 128
# Ids travel into logs, metrics labels and worker messages: keep them to plain characters.
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]+")
CHAT_ROLES = ("system", "user", "assistant", "tool")
# "SamplingParams.top_p must be in (0, 1], got 2.0" -> field "top_p" (StructuredOutputsParams' alike).
_SAMPLING_ERROR_RE = re.compile(r"^SamplingParams\.(\w+) (.*)$", re.DOTALL)
_CONSTRAINT_ERROR_RE = re.compile(r"^StructuredOutputsParams\.\w+ (.*)$", re.DOTALL)
# The proto's optional scalars, by SamplingParams field name.
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "logprobs",
                             "n", "use_beam_search", "beam_width", "length_penalty", "cache_salt",
                             "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                             "skip_special_tokens", "include_stop_str_in_output")


class ValidRequest(NamedTuple):
    """A request ready for ``Backend.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """vLLM's request priority (nonzero only when the workers schedule by priority)."""


def invalid(field: str, message: str) -> ValueError:
    return ValueError(f"{field}: {message}")


def check_request_id(request_id: str, field: str = "request_id") -> str:
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise invalid(field, f"must be at most {MAX_REQUEST_ID_LENGTH} characters, got {len(request_id)}")
    if not _REQUEST_ID_RE.fullmatch(request_id):
        raise invalid(field, f"may hold only letters, digits and . _ : -, got {shown(request_id)}")
    return request_id


def validate_request(request: pb.GenerateRequest, tokenizer: RouterTokenizer,
                     limits: RequestLimits = RequestLimits(),
                     template_kwargs: Mapping[str, object] | None = None) -> ValidRequest:
    """-> (request_id, prompt_token_ids, params); a ValueError naming the field otherwise.

    An empty request_id gets a random one (uuid4). Unset sampling fields take the model's
    defaults (TokenizerSpec.sampling_defaults, from its generation_config.json), else
    SamplingParams', except that an unset max_tokens is clamped to the room the prompt leaves
    in the context; a max_tokens that was set and does not fit is refused. template_kwargs:
    more variables for the chat template (the OpenAI API's chat_template_kwargs).
    """
    request_id = check_request_id(request.request_id) if request.request_id else uuid.uuid4().hex
    priority = check_priority(request.priority, tokenizer.spec.scheduling_policy)
    params = sampling_params_from(request.sampling, tokenizer.vocab_size, limits,
                                  dict(tokenizer.spec.sampling_defaults))
    max_model_len = tokenizer.max_model_len
    prompt_limit = limits.prompt_token_limit(max_model_len)
    field, prompt_token_ids = _prompt_token_ids(request, tokenizer, limits, prompt_limit, template_kwargs)
    num_prompt = len(prompt_token_ids)
    if num_prompt > prompt_limit:
        # One position must stay free for the first output token (the engine refuses
        # num_tokens >= max_model_len too).
        raise invalid(field, f"the prompt is {num_prompt} tokens, "
                             f"more than the limit {_prompt_limit_text(limits, max_model_len)}")
    room = max_model_len - num_prompt
    if not request.sampling.HasField("max_tokens"):
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
    elif params.max_tokens > room:
        # As vLLM's "maximum context length" error: both numbers, and what would fit.
        raise invalid("sampling.max_tokens",
                      f"the prompt's {num_prompt} tokens plus max_tokens {params.max_tokens} make "
                      f"{num_prompt + params.max_tokens} tokens, more than the model's maximum context length "
                      f"(max_model_len={max_model_len}): ask for at most {room} tokens, or shorten the prompt")
    return ValidRequest(request_id, prompt_token_ids, params, priority)


def check_priority(priority: int, scheduling_policy: str) -> int:
    """``priority`` if the workers' scheduling policy takes it: any int32 under priority, only
    0 under any other policy (vLLM refuses it the same way)."""
    if priority != 0 and scheduling_policy != PRIORITY_POLICY:
        raise invalid("priority", f"is {priority}, but this server schedules requests {scheduling_policy} "
                                  f"(--scheduling-policy {scheduling_policy}), where every request has priority 0: "
                                  f"leave it unset, or start the server with --scheduling-policy {PRIORITY_POLICY}")
    return priority


def _prompt_limit_text(limits: RequestLimits, max_model_len: int) -> str:
    limit = limits.prompt_token_limit(max_model_len)
    if limits.max_prompt_tokens is not None and limits.max_prompt_tokens < max_model_len - 1:
        return f"max_prompt_tokens={limit}"
    return f"max_prompt_tokens={limit} (max_model_len {max_model_len} minus one for the output)"


def sampling_params_from(sampling: pb.SamplingParams, vocab_size: int, limits: RequestLimits = RequestLimits(),
                         defaults: Mapping[str, object] | None = None) -> SamplingParams:
    """The proto's sampling fields -> SamplingParams, whose own checks name the field; an
    unset field takes its value from `defaults` (the model's) when they have it."""
    if len(sampling.stop) > limits.max_stop_strings:
        raise invalid("sampling.stop", f"{len(sampling.stop)} stop strings, more than the limit "
                                       f"max_stop_strings={limits.max_stop_strings}")
    for i, stop in enumerate(sampling.stop):
        if len(stop) > limits.max_stop_string_length:
            raise invalid(f"sampling.stop[{i}]", f"{len(stop)} characters, more than the limit "
                                                 f"max_stop_string_length={limits.max_stop_string_length}")
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise invalid("sampling.stop_token_ids", f"{len(sampling.stop_token_ids)} ids, more than the limit "
                                                 f"max_stop_token_ids={limits.max_stop_token_ids}")
    _check_completions(sampling, limits)
    if sampling.HasField("logprobs") and not 0 <= sampling.logprobs <= MAX_LOGPROBS:
        raise invalid("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}] (0: each chosen token's log-probability, "
                                           f"N: also the N most likely tokens), got {sampling.logprobs}")
    model_defaults = defaults or {}
    kwargs: dict[str, Any] = {
        name: getattr(sampling, name) if sampling.HasField(name) else model_defaults[name]
        for name in _OPTIONAL_SAMPLING_FIELDS if sampling.HasField(name) or name in model_defaults
    }
    kwargs["stop"] = tuple(sampling.stop)
    kwargs["stop_token_ids"] = tuple(sampling.stop_token_ids)
    if len(sampling.logit_bias) > limits.max_logit_bias_tokens:
        raise invalid("sampling.logit_bias", f"{len(sampling.logit_bias)} tokens, more than the limit "
                                             f"max_logit_bias_tokens={limits.max_logit_bias_tokens}")
    kwargs["logit_bias"] = dict(sampling.logit_bias)
    if sampling.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from(sampling.structured_outputs, limits)
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        match = _SAMPLING_ERROR_RE.match(str(e))
        if match is None:
            raise invalid("sampling", str(e)) from e
        raise invalid(f"sampling.{match.group(1)}", match.group(2)) from e
    for i, token_id in enumerate(params.stop_token_ids):
        # SamplingParams knows no vocabulary; an id past it could never match.
        if token_id >= vocab_size:
            raise invalid(f"sampling.stop_token_ids[{i}]", f"{token_id} is outside the vocabulary [0, {vocab_size})")
    for token_id, _ in params.logit_bias:
        if token_id >= vocab_size:
            raise invalid("sampling.logit_bias", f"token {token_id} is outside the vocabulary [0, {vocab_size})")
    return params


def structured_outputs_from(constraint: pb.StructuredOutputs,
                            limits: RequestLimits = RequestLimits()) -> StructuredOutputsParams:
    """``sampling.structured_outputs`` -> StructuredOutputsParams; errors name the constraint's
    field (``sampling.structured_outputs.json_schema: is not valid JSON ...``). The size is
    checked before the text is parsed; the grammar itself is compiled on the workers."""
    kind = constraint.WhichOneof("constraint")
    field = "sampling.structured_outputs"
    if kind is None:
        raise invalid(field, "one of json_schema, json_object, regex or choice must be set")
    field = f"{field}.{kind}"
    if kind == "json_object":
        if not constraint.json_object:
            raise invalid(field, "must be true when set (the output is any JSON object)")
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not 0 < len(choices) <= MAX_CHOICES:
            raise invalid(field, f"must hold 1 to {MAX_CHOICES} strings, got {len(choices)}")
        for i, choice in enumerate(choices):
            if not choice:
                raise invalid(f"{field}[{i}]", "must not be empty")
        text, size = "", sum(len(c) for c in choices)
    else:
        choices, text = [], getattr(constraint, kind)
        if not text:
            raise invalid(field, "must not be empty")
        size = len(text)
    if size > limits.max_structured_output_chars:
        raise invalid(field, f"{size} characters, more than the limit "
                             f"max_structured_output_chars={limits.max_structured_output_chars}")
    try:  # (StructuredOutputsParams parses a schema: once)
        return StructuredOutputsParams(json=text if kind == "json_schema" else None,
                                       regex=text if kind == "regex" else None,
                                       choice=tuple(choices) if kind == "choice" else ())
    except ValueError as e:  # what the checks above missed, still naming the field
        match = _CONSTRAINT_ERROR_RE.match(str(e))
        raise invalid(field, match.group(1) if match else str(e)) from None


def _check_completions(sampling: pb.SamplingParams, limits: RequestLimits) -> None:
    """n, and beam_width with beam search, within max_completions (SamplingParams checks the rest)."""
    most = limits.max_completions
    if sampling.n > most:
        raise invalid("sampling.n", f"{sampling.n} completions, more than the limit max_completions={most}")
    # beam_width is only used (and only costs) with beam search; unset, it is the default's.
    width = sampling.beam_width if sampling.HasField("beam_width") else SamplingParams.beam_width
    if sampling.use_beam_search and width > most:
        default = "" if sampling.HasField("beam_width") else " (the default)"
        raise invalid("sampling.beam_width", f"{width} beams{default}, more than the limit max_completions={most}")


def shown(text: str, most: int = 40) -> str:
    """A client's string, quoted and cut short for an error message (details travel in trailers)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text)} characters)"


def _prompt_token_ids(request: pb.GenerateRequest, tokenizer: RouterTokenizer, limits: RequestLimits,
                      prompt_limit: int, template_kwargs: Mapping[str, object] | None) -> tuple[str, list[int]]:
    """-> (the input field's name, prompt ids); sizes are checked before tokenizing."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise invalid("input", "one of prompt, token_ids or messages must be set")
    if kind == "prompt":
        if not request.prompt:
            raise invalid("prompt", "must not be empty")
        if len(request.prompt) > limits.max_prompt_chars:
            raise invalid("prompt", f"{len(request.prompt)} characters, more than the limit "
                                    f"max_prompt_chars={limits.max_prompt_chars}")
        ids = tokenizer.encode(request.prompt)
        if not ids:
            raise invalid("prompt", "tokenizes to no tokens")
        return kind, ids
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise invalid("token_ids", "must hold at least one token id")
        if len(ids) > prompt_limit:
            raise invalid("token_ids", f"the prompt is {len(ids)} tokens, more than the limit "
                                       f"{_prompt_limit_text(limits, tokenizer.max_model_len)}")
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < tokenizer.vocab_size:
                raise invalid(f"token_ids[{i}]", f"{token_id} is outside the vocabulary [0, {tokenizer.vocab_size})")
        return kind, ids
    messages = request.messages.messages
    if not messages:
        raise invalid("messages", "must hold at least one message")
    if len(messages) > limits.max_messages:
        raise invalid("messages", f"{len(messages)} messages, more than the limit max_messages={limits.max_messages}")
    num_chars = sum(len(m.content) for m in messages)
    if num_chars > limits.max_prompt_chars:
        raise invalid("messages", f"{num_chars} characters of content, more than the limit "
                                  f"max_prompt_chars={limits.max_prompt_chars}")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {shown(message.role)}")
    if not tokenizer.has_chat_template:
        raise invalid("messages", f"model {tokenizer.spec.model_name} has no chat template: send prompt or token_ids")
    try:
        ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                            template_kwargs)
    except ChatTemplateError as e:
        raise invalid("messages", str(e)) from e
    return kind, ids
