"""A StreamDelta on the wire: every field comes back as it was sent, and a frame that is not
a delta of this format is refused whole (never half read, never unpickled)."""

from __future__ import annotations

import math

import msgpack
import pytest

from tandem.logprobs import TopLogprobs
from tandem.worker.api import StreamDelta
from tandem.worker.delta_wire import MAX_FRAME_BYTES, MalformedDelta, decode_delta, encode_delta

FULL = StreamDelta("req-1", [5, 9], "é👍", "stop", 12, 30, logprobs=[-0.5, -math.inf],
                   top_logprobs=[TopLogprobs([5, 2], [-0.5, -1.25]), TopLogprobs([9], [-math.inf])],
                   error="its KV never came", index=2, num_unfinished=1, num_cached_tokens=16)


@pytest.mark.parametrize("delta", [FULL, StreamDelta("r", [], "", None, 0, 0)])
def test_a_delta_comes_back_field_for_field(delta: StreamDelta) -> None:
    got = decode_delta(encode_delta(delta))
    assert got == delta
    assert got.top_logprobs is None or all(isinstance(t, TopLogprobs) for t in got.top_logprobs)


def fields(**changed) -> list:
    """FULL's wire fields, some changed by name."""
    out = msgpack.unpackb(encode_delta(FULL))
    names = list(StreamDelta.__dataclass_fields__)
    for name, value in changed.items():
        out[names.index(name)] = value
    return out


@pytest.mark.parametrize("frame", [
    b"\x80\x04pickle",  # not msgpack
    msgpack.packb({"request_id": "r"}),  # a map, not the array
    msgpack.packb(fields()[:-1]),  # a field short
    msgpack.packb(fields(request_id="")),
    msgpack.packb(fields(request_id=7)),
    msgpack.packb(fields(token_ids=[1, "2"])),
    msgpack.packb(fields(token_ids=[True])),  # a bool is not a token id
    msgpack.packb(fields(text=b"bytes")),
    msgpack.packb(fields(finish_reason=1)),
    msgpack.packb(fields(num_output_tokens=-1)),
    msgpack.packb(fields(index=1.5)),
    msgpack.packb(fields(logprobs=[1])),  # an int where floats go
    msgpack.packb(fields(top_logprobs=[[[5], [-0.5], "x"]])),
    msgpack.packb(fields(top_logprobs=[[[5], [1]]])),
    msgpack.packb(fields(error=["x"])),
], ids=lambda f: f[:12].hex())
def test_a_frame_that_is_not_a_delta_is_refused(frame: bytes) -> None:
    with pytest.raises(MalformedDelta):
        decode_delta(frame)


def test_an_oversized_frame_is_refused_unread() -> None:
    with pytest.raises(MalformedDelta, match="bytes"):
        decode_delta(b"\x90" + bytes(MAX_FRAME_BYTES))
