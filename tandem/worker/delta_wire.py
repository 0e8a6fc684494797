"""A StreamDelta as one ZMQ frame: msgpack (never pickle), type-checked on arrival.

The worker sends each delta of a request straight to the router's inbox
(tandem/worker/delta_outbox.py -> router/delta_inbox.py) instead of returning it as a Ray
object: a Ray object per token costs the serving path about 1.5 ms of CPU between the two
processes, which on a small host is taken from the decode step itself.

A frame is a msgpack array of StreamDelta's fields in their order, top_logprobs as
[[token_ids, logprobs], ...].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgpack

from tandem.logprobs import TopLogprobs
from tandem.worker.api import StreamDelta

NUM_FIELDS = len(dataclasses.fields(StreamDelta))
MAX_FRAME_BYTES = 64 << 20
"""A frame larger than this is refused unread (a delta is a few tokens and their text)."""


class MalformedDelta(ValueError):
    """A frame that is not a StreamDelta of this wire format."""


def encode_delta(d: StreamDelta) -> bytes:
    top = None if d.top_logprobs is None else [[t.token_ids, t.logprobs] for t in d.top_logprobs]
    return msgpack.packb([d.request_id, d.token_ids, d.text, d.finish_reason, d.num_prompt_tokens,
                          d.num_output_tokens, d.logprobs, top, d.error, d.index, d.num_unfinished,
                          d.num_cached_tokens])


def _ints(x: Any) -> bool:
    return isinstance(x, list) and all(type(v) is int for v in x)


def _floats(x: Any) -> bool:
    return isinstance(x, list) and all(type(v) is float for v in x)


def _top_logprobs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(p, list) and len(p) == 2 and _ints(p[0]) and _floats(p[1])
                                       for p in x)


def _optional(x: Any, check: Callable[[Any], bool]) -> bool:
    return x is None or check(x)


def decode_delta(frame: bytes) -> StreamDelta:
    """The StreamDelta in ``frame``; MalformedDelta when it is anything else."""
    if len(frame) > MAX_FRAME_BYTES:
        raise MalformedDelta(f"a delta frame of {len(frame)} bytes (at most {MAX_FRAME_BYTES})")
    try:
        fields = msgpack.unpackb(frame, use_list=True, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise MalformedDelta(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(fields, list) or len(fields) != NUM_FIELDS:
        raise MalformedDelta(f"a delta is an array of {NUM_FIELDS} fields")
    (request_id, token_ids, text, finish, num_prompt, num_output, logprobs, top, error, index, num_unfinished,
     num_cached) = fields
    if not (isinstance(request_id, str) and request_id and _ints(token_ids) and isinstance(text, str)
            and _optional(finish, lambda f: isinstance(f, str)) and _optional(error, lambda e: isinstance(e, str))
            and all(type(n) is int and n >= 0 for n in (num_prompt, num_output, index, num_unfinished, num_cached))
            and _optional(logprobs, _floats) and _optional(top, _top_logprobs)):
        raise MalformedDelta("a delta field has the wrong type")
    return StreamDelta(request_id, token_ids, text, finish, num_prompt, num_output, logprobs,
                       None if top is None else [TopLogprobs(ids, lps) for ids, lps in top], error, index,
                       num_unfinished, num_cached)
