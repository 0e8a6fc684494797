"""Log-probabilities in OpenAI's shapes: what a body asks for, and the answer's objects.

Asking: completions ``logprobs: N`` and chat ``logprobs: true`` with ``top_logprobs: N``, N in
[0, MAX_LOGPROBS] -> ``sampling.logprobs`` (vLLM's count: 0 the chosen token's, N also the N
most likely at each position).

Answering (each token's text decoded alone, as vLLM does; -inf shown as -9999.0, OpenAI's
word for "very unlikely", which JSON can carry):

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}], "refusal": null}``, the top list the N most likely, most likely first;
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``,
  each top object the chosen token and the N most likely (up to N + 1 entries, as OpenAI
  documents; tokens of the same text share one key, the first kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.logprobs import TopLogprobs
from tandem.router.openai.errors import invalid
from tandem.router.openai.fields import boolean, integer
from tandem.sampling_params import MAX_LOGPROBS

LOWEST_LOGPROB = -9999.0
"""What a log-probability of -inf (or below) is shown as (OpenAI's and vLLM's floor)."""


def requested_logprobs(chat: bool, given: dict[str, Any]) -> int | None:
    """sampling.logprobs for the body's fields (None: no log-probabilities)."""
    if chat:
        wanted = boolean("logprobs", given.get("logprobs", False))
        top = _count("top_logprobs", given["top_logprobs"]) if "top_logprobs" in given else 0
        if top and not wanted:
            raise invalid("top_logprobs", "needs logprobs: true")
        return top if wanted else None
    return _count("logprobs", given["logprobs"]) if "logprobs" in given else None


def _count(name: str, value: object) -> int:
    count = integer(name, value)
    if not 0 <= count <= MAX_LOGPROBS:
        raise invalid(name, f"must be in [0, {MAX_LOGPROBS}], got {count}")
    return count


def shown_logprob(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": shown_logprob(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[TopLogprobs] | None,
                  text_of: Callable[[int], str]) -> dict[str, Any]:
    """Chat's ``choices[].logprobs`` for these tokens (tops: None when only the chosen ones were asked)."""
    content = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        entry = _entry(text_of(token_id), logprob)
        top = tops[position] if tops is not None else None
        entry["top_logprobs"] = ([] if top is None else
                                 [_entry(text_of(t), p) for t, p in zip(top.token_ids, top.logprobs)])
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[TopLogprobs] | None,
                        text_of: Callable[[int], str], offset: int) -> tuple[dict[str, Any], int]:
    """Completions' ``choices[].logprobs`` for these tokens, the first at text ``offset`` ->
    (the object, the offset after the last token)."""
    texts = [text_of(t) for t in token_ids]
    offsets = []
    top_objects = []
    for position, (text, logprob) in enumerate(zip(texts, logprobs)):
        offsets.append(offset)
        offset += len(text)
        top = {text: shown_logprob(logprob)}
        if tops is not None:
            for t, p in zip(tops[position].token_ids, tops[position].logprobs):
                top.setdefault(text_of(t), shown_logprob(p))
        top_objects.append(top)
    return {"tokens": texts, "token_logprobs": [shown_logprob(p) for p in logprobs], "top_logprobs": top_objects,
            "text_offset": offsets}, offset
