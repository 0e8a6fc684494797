"""Parsed OpenAI requests through the gRPC API's own validation (``router.validation``).

``validated_all`` runs ``validate_request`` on each prompt's request, so both APIs accept and
refuse exactly the same requests; its ValueError becomes a 400 naming the OpenAI parameter
(``sampling.temperature`` -> ``temperature``, ``token_ids[3]`` of prompt 1 -> ``prompt[1][3]``,
``sampling.structured_outputs`` -> where the body gave the constraint).
"""

from __future__ import annotations

import dataclasses
import re

from tandem.proto import generation_pb2 as pb
from tandem.router.limits import RequestLimits
from tandem.router.openai.errors import APIError, invalid
from tandem.router.openai.protocol import CHAT, ParsedRequest
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import ValidRequest, validate_request

# "sampling.stop[2]: ..." -> ("stop", "[2]"); "messages[1].role: ..." -> ("messages", "[1].role").
_FIELD_RE = re.compile(r"^(?:sampling\.)?(\w*)(.*)$", re.DOTALL)


# "sampling.structured_outputs.choice[3]" -> "[3]": the part past the proto's own field name.
_CONSTRAINT_KIND_RE = re.compile(r"^\.(?:json_schema|json_object|regex|choice)")


def validated_all(parsed: ParsedRequest, tokenizer: RouterTokenizer, limits: RequestLimits) -> list[ValidRequest]:
    """``validate_request`` on each prompt's request (tokenizes: run it off the event loop);
    any invalid prompt refuses the whole request, before anything runs.

    Its ValueError becomes a 400 naming the OpenAI parameter (``prompt[i]`` for prompt i of a
    list). Past ``limits.max_prompts`` prompts, or max_prompt_chars of them together, refused
    before any is tokenized. A chat request with no max_tokens may use all the room the
    context leaves (OpenAI's "no limit"), unless the model gives a default (its
    generation_config.json's max_new_tokens, within that room).
    """
    num_prompts = parsed.num_prompts
    if num_prompts > limits.max_prompts:
        raise invalid("prompt", f"{num_prompts} prompts, more than the limit max_prompts={limits.max_prompts}")
    num_chars = sum(len(p) for p in parsed.prompts if isinstance(p, str))
    if num_prompts > 1 and num_chars > limits.max_prompt_chars:
        raise invalid("prompt", f"{num_prompts} prompts of {num_chars} characters together, more than the limit "
                                f"max_prompt_chars={limits.max_prompt_chars}")
    several = num_prompts > 1
    # NOTE: prompt 0's validation bounds the sampling fields (stop strings, logit_bias, the
    # constraint) before any further copy of the request is made.
    return [_validated(parsed, parsed.prompt_request(i), i if several else None, tokenizer, limits)
            for i in range(num_prompts)]


def _validated(parsed: ParsedRequest, request: pb.GenerateRequest, prompt_index: int | None,
               tokenizer: RouterTokenizer, limits: RequestLimits) -> ValidRequest:
    try:
        valid = validate_request(request, tokenizer, limits, parsed.chat_template_kwargs)
    except ValueError as e:
        raise _from_validation(str(e), parsed, prompt_index) from e
    model_default = dict(tokenizer.spec.sampling_defaults).get("max_tokens")
    if parsed.kind == CHAT and parsed.max_tokens_param is None and model_default is None:
        room = tokenizer.max_model_len - len(valid.prompt_token_ids)
        valid = valid._replace(params=dataclasses.replace(valid.params, max_tokens=room))
    return valid


def _from_validation(message: str, parsed: ParsedRequest, prompt_index: int | None = None) -> APIError:
    field, _, rest = message.partition(": ")
    match = _FIELD_RE.match(field)
    assert match is not None  # the pattern matches every string
    name, suffix = match.groups()
    if name == "structured_outputs" and parsed.constraint_field is not None and rest:
        # Named as the body gave it: response_format.json_schema.schema, guided_choice[3], ...
        shown_field = parsed.constraint_field + _CONSTRAINT_KIND_RE.sub("", suffix)
        return APIError(400, f"{shown_field}: {rest}", param=re.split(r"[.\[]", shown_field, maxsplit=1)[0])
    renamed = {"token_ids": "prompt", "input": parsed.input_param, "sampling": "",
               "max_tokens": parsed.max_tokens_param or "max_tokens",
               "logprobs": "top_logprobs" if parsed.kind == CHAT else "logprobs"}
    param = renamed.get(name, name) or None
    if param is None or not rest:
        return APIError(400, message, param=param)
    if prompt_index is not None:
        if param == "prompt":
            suffix = f"[{prompt_index}]{suffix}"
        else:
            rest = f"{rest} (prompt[{prompt_index}])"
    return APIError(400, f"{param}{suffix}: {rest}", param=param)
