"""The completions ``prompt`` in vLLM's four forms: a string, an array of strings, an array of
token ids, or an array of token id arrays (one form per request). Each prompt of an array
becomes a request of its own; their choices are numbered ``prompt_index * n + j``.

Errors name the parameter ``prompt`` and, in the message, the prompt (``prompt[1]: ...``).
"""

from __future__ import annotations

from typing import cast

from tandem.router.openai.errors import APIError
from tandem.router.openai.fields import integer, json_kind

Prompt = str | list[int]
"""One prompt: text, or token ids."""

_FORMS = "a string, an array of strings, an array of token ids, or an array of token id arrays"


def completion_prompts(value: object) -> list[Prompt]:
    """The body's ``prompt`` -> its prompts, in order (a 400 naming the prompt otherwise).

    Only the shape is checked here; emptiness, sizes and the vocabulary are
    ``router.validation``'s, for each prompt.
    """
    if value is None:
        raise _invalid("prompt", "is required")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise _invalid("prompt", f"must be {_FORMS}, got {json_kind(value)}")
    if not value:
        raise _invalid("prompt", "must hold at least one prompt")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if all(isinstance(p, list) for p in value):
        return [_token_ids(f"prompt[{i}]", ids) for i, ids in enumerate(value)]
    if not any(isinstance(p, (str, list)) for p in value):
        return [_token_ids("prompt", value)]
    raise _invalid("prompt", f"must be {_FORMS} (one form, not a mixture)")


def _token_ids(field: str, value: list[object]) -> list[int]:
    if not value:
        raise _invalid(field, "must hold at least one token id")
    for i, token_id in enumerate(value):
        try:
            integer(f"{field}[{i}]", token_id)
        except APIError as e:
            e.param = "prompt"
            raise
    return cast(list[int], value)  # every entry checked above


def _invalid(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param="prompt")
