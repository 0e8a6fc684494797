"""The prefix fetch's messages (tier_peer.py), in the transfer protocol (protocol.py: a msgpack
header, never pickle), each type-checked on arrival.

A fetch goes FETCH -> OFFER -> PULL -> PULLED: the worker names the blocks it lacks; the
tier server says how many of them, from the first, it holds and keeps them staged for it; the
worker reserves that many blocks in its receiver and hands their Destination over; the server
sends them there as any KV transfer (the same handshake, grant, data paths and checks) and says
how the transfer ended.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tandem.kvtransfer.protocol import Destination, ProtocolError


@dataclass(frozen=True)
class FetchRequest:
    """A FETCH message: prefix blocks of one KV layout, asked for by their chained hashes."""

    layout: str
    """The fetcher's layout key (DiskTier.key): blocks are interchangeable only under the same."""
    block_hashes: tuple[bytes, ...]
    """A prompt's consecutive blocks, from the first the fetcher lacks."""


def fetch_request(msg: dict[str, Any], max_blocks: int) -> FetchRequest:
    """The fields of a FETCH message, type-checked."""
    layout, hashes = msg.get("layout"), msg.get("block_hashes")
    if not isinstance(layout, str):
        raise ProtocolError("malformed", "FETCH needs a layout string")
    if not isinstance(hashes, list) or not all(isinstance(x, bytes) for x in hashes) or len(hashes) > max_blocks:
        raise ProtocolError("malformed", f"FETCH needs a list of at most {max_blocks} block hashes (bytes)")
    return FetchRequest(layout, tuple(hashes))


def offer_of(msg: dict[str, Any]) -> tuple[int, str | None]:
    """An OFFER's (number of blocks held, why none when refused)."""
    num_blocks, error = msg.get("num_blocks"), msg.get("error")
    if not isinstance(num_blocks, int) or num_blocks < 0 or not isinstance(error, (str, type(None))):
        raise ProtocolError("malformed", "OFFER needs num_blocks >= 0 and an error string or nil")
    return num_blocks, error


def destination_fields(destination: Destination) -> dict[str, Any]:
    """A PULL's fields: the Destination the worker's receiver made for the offered blocks."""
    return {"destination": asdict(destination)}


_STRINGS = ("request_id", "address", "node_id", "shm_pool", "grant", "device")
_INTS = ("num_tokens", "num_cached_tokens", "shm_grant")


def destination_of(msg: dict[str, Any]) -> Destination:
    """A PULL's Destination, type-checked (the receiver checks every write against its own)."""
    d = msg.get("destination")
    if not isinstance(d, dict) or set(d) != {*_STRINGS, *_INTS, "block_ids"}:
        raise ProtocolError("malformed", "PULL needs a destination with exactly Destination's fields")
    if not all(isinstance(d[f], str) for f in _STRINGS) or not all(isinstance(d[f], int) for f in _INTS):
        raise ProtocolError("malformed", f"a destination's {_STRINGS} are strings, {_INTS} integers")
    block_ids = d["block_ids"]
    if not isinstance(block_ids, list) or not all(isinstance(b, int) for b in block_ids):
        raise ProtocolError("malformed", "a destination's block_ids are integers")
    return Destination(**{**d, "block_ids": tuple(block_ids)})
