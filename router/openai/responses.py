"""OpenAI's response objects: completions, chat completions, their stream chunks, errors, models.

One ``Responses`` per request holds what every object of it shares (id, created, model) and
builds each in the shape OpenAI's API documents, so that OpenAI's own client parses them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tandem.logprobs import TopLogprobs
from tandem.router.openai.logprobs import chat_logprobs, completion_logprobs
from tandem.router.openai.protocol import CHAT, COMPLETION
from tandem.router.tokenizer import RouterTokenizer

DONE = b"data: [DONE]\n\n"
"""The stream's last event, as OpenAI ends one."""
OWNED_BY = "tandem"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    """The request's token counts (every completion's output together, as OpenAI counts n > 1)."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def new_id(kind: str) -> str:
    """A request's id, as OpenAI spells them ("cmpl-...", "chatcmpl-..."); also its id on the workers."""
    return ("cmpl-" if kind == COMPLETION else "chatcmpl-") + uuid.uuid4().hex


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": OWNED_BY}


def models_list(names: Sequence[str], created: int) -> dict[str, Any]:
    """``GET /v1/models``: the model this server serves, under each of its names."""
    return {"object": "list", "data": [model_card(name, created) for name in names]}


class Responses:
    """Builds one request's response objects (non-streaming or streamed chunks)."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: RouterTokenizer, *,
                 include_usage: bool = False) -> None:
        self.kind = kind
        self.id = request_id
        self.created = int(time.time())
        self.model = model
        self._tokenizer = tokenizer
        self._include_usage = include_usage
        self._text_offsets: dict[int, int] = {}
        """Per choice: characters of token text streamed so far (completions' text_offset)."""
        self._texts: dict[int, str] = {}
        """Each token id's text, decoded alone (top log-probabilities name the same tokens often)."""

    # -- logprobs --------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        # Each token alone, special tokens included: a token that is part of a multi-byte
        # character shows as U+FFFD (its bytes are not the character's), as in vLLM.
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def logprobs(self, index: int, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                 top_logprobs: Sequence[TopLogprobs] | None = None) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens of choice ``index`` (None when none were
        asked for); completions' text offsets go on from the choice's previous tokens."""
        if logprobs is None:
            return None
        if self.kind == CHAT:
            return chat_logprobs(token_ids, logprobs, top_logprobs, self._token_text)
        shaped, self._text_offsets[index] = completion_logprobs(token_ids, logprobs, top_logprobs, self._token_text,
                                                                self._text_offsets.get(index, 0))
        return shaped

    # -- non-streaming ---------------------------------------------------------------------

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if self.kind == COMPLETION:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, choices: list[dict[str, Any]], token_usage: dict[str, int]) -> dict[str, Any]:
        """The whole answer: choices in index order."""
        return {"id": self.id, "object": "text_completion" if self.kind == COMPLETION else "chat.completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": token_usage}

    # -- streaming -------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id, "object": "text_completion" if self.kind == COMPLETION else "chat.completion.chunk",
            "created": self.created, "model": self.model, "choices": choices}
        if self._include_usage:
            chunk["usage"] = None  # only the last chunk carries the usage, as OpenAI streams it
        return chunk

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat: how each completion's stream begins."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def text_chunk(self, index: int, text: str, logprobs: dict[str, Any] | None,
                   finish_reason: str | None = None) -> dict[str, Any]:
        """New text of completion ``index`` (chat: finish_reason comes in its own chunk)."""
        if self.kind == COMPLETION:
            return self._chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])
        return self._chunk([{"index": index, "delta": {"content": text}, "logprobs": logprobs,
                             "finish_reason": finish_reason}])

    def finish_chunk(self, index: int, finish_reason: str) -> dict[str, Any]:
        """Chat: completion ``index`` ended (an empty delta, as OpenAI sends it)."""
        return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, token_usage: dict[str, int]) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices."""
        chunk = self._chunk([])
        chunk["usage"] = token_usage
        return chunk
