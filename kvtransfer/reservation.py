"""A receiver's reservation for one request, and the rules every LAYER header must follow
against it, whichever path its rows took."""

from __future__ import annotations

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
