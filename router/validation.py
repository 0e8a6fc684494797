"""Turn a ``tandem.v1.GenerateRequest`` into what the workers take, or say which field is wrong.

Every error is a ``ValueError`` whose message starts with the field's path in the request
(``"sampling.temperature: ..."``, ``"messages[1].role: ..."``): the servicer sends it as
the INVALID_ARGUMENT details, so a client can tell what to fix.
"""

from __future__ import annotations

import re
import uuid
from typing import NamedTuple

from tandem.proto import generation_pb2 as pb
from tandem.router.tokenizer import ChatTemplateError, RouterTokenizer
from tandem.sampling_params import SamplingParams

MAX_REQUEST_ID_LENGTH = 128
# Ids travel into logs, metrics labels and worker messages: keep them to plain characters.
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]+")
CHAT_ROLES = ("system", "user", "assistant", "tool")
# "SamplingParams.top_p must be in (0, 1], got 2.0" -> field "top_p".
_SAMPLING_ERROR_RE = re.compile(r"^SamplingParams\.(\w+) (.*)$", re.DOTALL)
# The proto's optional scalars, by SamplingParams field name.
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "logprobs")


class ValidRequest(NamedTuple):
    """A request ready for ``Backend.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def invalid(field: str, message: str) -> ValueError:
    return ValueError(f"{field}: {message}")


def check_request_id(request_id: str, field: str = "request_id") -> str:
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise invalid(field, f"must be at most {MAX_REQUEST_ID_LENGTH} characters, got {len(request_id)}")
    if not _REQUEST_ID_RE.fullmatch(request_id):
        raise invalid(field, f"may hold only letters, digits and . _ : -, got {request_id!r}")
    return request_id


def validate_request(request: pb.GenerateRequest, tokenizer: RouterTokenizer) -> ValidRequest:
    """-> (request_id, prompt_token_ids, params); a ValueError naming the field otherwise.

    An empty request_id gets a random one (uuid4). Unset sampling fields take
    SamplingParams' defaults.
    """
    request_id = check_request_id(request.request_id) if request.request_id else uuid.uuid4().hex
    params = sampling_params_from(request.sampling, tokenizer.vocab_size)
    field, prompt_token_ids = _prompt_token_ids(request, tokenizer)
    limit = tokenizer.max_model_len - 1
    if len(prompt_token_ids) > limit:
        # One position must stay free for the first output token (the engine refuses
        # num_tokens >= max_model_len too).
        raise invalid(field, f"the prompt is {len(prompt_token_ids)} tokens, more than the limit of {limit} "
                             f"(max_model_len {tokenizer.max_model_len} minus one for the output)")
    return ValidRequest(request_id, prompt_token_ids, params)


def sampling_params_from(sampling: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    """The proto's sampling fields -> SamplingParams, whose own checks name the field."""
    kwargs: dict[str, object] = {
        name: getattr(sampling, name) for name in _OPTIONAL_SAMPLING_FIELDS if sampling.HasField(name)
    }
    kwargs["stop"] = tuple(sampling.stop)
    kwargs["stop_token_ids"] = tuple(sampling.stop_token_ids)
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
    return params


def _prompt_token_ids(request: pb.GenerateRequest, tokenizer: RouterTokenizer) -> tuple[str, list[int]]:
    """-> (the input field's name, prompt ids)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise invalid("input", "one of prompt, token_ids or messages must be set")
    if kind == "prompt":
        if not request.prompt:
            raise invalid("prompt", "must not be empty")
        ids = tokenizer.encode(request.prompt)
        if not ids:
            raise invalid("prompt", "tokenizes to no tokens")
        return kind, ids
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise invalid("token_ids", "must hold at least one token id")
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < tokenizer.vocab_size:
                raise invalid(f"token_ids[{i}]", f"{token_id} is outside the vocabulary [0, {tokenizer.vocab_size})")
        return kind, ids
    messages = request.messages.messages
    if not messages:
        raise invalid("messages", "must hold at least one message")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}")
    if not tokenizer.has_chat_template:
        raise invalid("messages", f"model {tokenizer.spec.model_name} has no chat template: send prompt or token_ids")
    try:
        ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
    except ChatTemplateError as e:
        raise invalid("messages", str(e)) from e
    return kind, ids
