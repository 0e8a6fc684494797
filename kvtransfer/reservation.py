"""A receiver's reservation for one request, and the rules every LAYER header must follow
against it, whichever path its rows took."""

from __future__ import annotations

import collections
import hmac
import secrets
from dataclasses import dataclass

import numpy as np

from tandem.kvtransfer.protocol import Destination, KVLayout, LayerHeader, ProtocolError
from tandem.kvtransfer.slots import covering_blocks, token_slots

GRANT_BYTES = 16


@dataclass
class Reservation:
    destination: Destination
    timeout_s: float
    received: list[int]
    """Tokens in place so far, per layer (they arrive in order after the cached prefix)."""
    granted: list[int] | None = None
    """The blocks a same-node sender may write in place (fence.granted_blocks), while the
    reservation stands; None without a shared pool."""
    sender: bytes | None = None
    """ZMQ identity of the sender, once it has sent a layer."""
    deadline: float | None = None
    """When the KV is overdue: timeout_s after the sender's latest layer message, so that a
    reservation whose prompt waits in the prefill queue, or between its chunks, never times
    out; before the first one its owner ends it (NOTE: timeouts count from work, not from
    queues)."""


def new_grant() -> str:
    """A reservation's secret (Destination.grant)."""
    return secrets.token_hex(GRANT_BYTES)


def is_granted(res: Reservation, grant: str) -> bool:
    """Whether a message carrying `grant` may write (or end) the reservation's KV."""
    return hmac.compare_digest(grant.encode(), res.destination.grant.encode())


def check_layer(h: LayerHeader, res: Reservation, layout: KVLayout) -> None:
    """Prove that a LAYER message touches only its reservation's blocks, in order: the next
    tokens of its layer (ProtocolError, naming the rule, when it does not)."""
    dest = res.destination
    if h.layer >= layout.num_layers:
        raise ProtocolError("layer_out_of_range", f"{h.request_id}: layer {h.layer}")
    if h.token_start < res.received[h.layer]:
        raise ProtocolError("duplicate_layer", f"{h.request_id}: layer {h.layer} tokens from {h.token_start} again")
    if h.token_start > res.received[h.layer] or h.num_tokens == 0 \
            or h.token_start + h.num_tokens > dest.num_tokens:
        raise ProtocolError("bad_token_range", f"{h.request_id}: layer {h.layer} tokens "
                            f"[{h.token_start}, {h.token_start + h.num_tokens}) after {res.received[h.layer]}")
    if any(not 0 <= b < layout.num_blocks for b in h.block_ids):
        raise ProtocolError("block_out_of_range", f"{h.request_id}: {h.block_ids}")
    end = h.token_start + h.num_tokens
    if list(h.block_ids) != covering_blocks(dest.block_ids, layout.block_size, h.token_start, end):
        raise ProtocolError("foreign_block", f"{h.request_id}: blocks {h.block_ids} are not its own")


def layer_slots(h: LayerHeader, layout: KVLayout) -> np.ndarray:
    """The pool slots a checked LAYER message's rows go to, in token order."""
    return token_slots(h.block_ids, layout.block_size, h.token_start, h.token_start + h.num_tokens,
                       h.token_start // layout.block_size)


def check_reservation(request_id: str, block_ids: list[int], num_tokens: int, num_cached_tokens: int,
                      layout: KVLayout) -> None:
    """ValueError unless `block_ids` hold exactly `num_tokens` tokens of the pool and the cached
    prefix is whole blocks below them (a block part cached, part written would be shared while
    written)."""
    if num_tokens < 1 or len(block_ids) != -(-num_tokens // layout.block_size):
        raise ValueError(f"{request_id}: {len(block_ids)} blocks cannot hold exactly {num_tokens} tokens")
    if any(not 0 <= b < layout.num_blocks for b in block_ids):
        raise ValueError(f"{request_id}: block ids outside the pool of {layout.num_blocks}")
    if not 0 <= num_cached_tokens < num_tokens or num_cached_tokens % layout.block_size:
        raise ValueError(f"{request_id}: {num_cached_tokens} cached tokens is not a whole number of "
                         f"blocks of {layout.block_size} below {num_tokens}")


class RecentlyEnded:
    """The ids of the requests that ended lately (the newest `limit`), so that their late
    messages are told to stop rather than dropped as unknown."""

    def __init__(self, limit: int = 100_000) -> None:
        self._limit = limit
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        while len(self._ids) > self._limit:
            self._ids.popitem(last=False)

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids
