"""Where each request stands on its prefill worker: the states of its handoff and the moves
allowed between them (the worker's table holds it from admission until its blocks are free)."""

from __future__ import annotations

import enum


class PrefillHandoff(enum.IntEnum):
    """A request's place in the handoff on its prefill worker."""

    PREFILLING = 0
    """Admitted: its prompt is queued or being computed; none of its KV has gone out yet."""
    SENDING = 1
    """Some of its KV has gone out; the rest goes as its chunks are computed."""
    SENT = 2
    """Every layer handed to the sender and its first token returned: the receiver's ack is awaited."""
    ABORTED = 3
    """Ended by an abort (or a failed transfer): its blocks wait for the sender to let go of them."""
    FREED = 4
    """The transfer has ended and its blocks are back in the pool (leaves the table)."""


P = PrefillHandoff
TRANSITIONS: dict[PrefillHandoff, frozenset[PrefillHandoff]] = {
    P.PREFILLING: frozenset({P.SENDING, P.ABORTED, P.FREED}),
    P.SENDING: frozenset({P.SENT, P.ABORTED, P.FREED}),
    P.SENT: frozenset({P.ABORTED, P.FREED}),
    P.ABORTED: frozenset({P.FREED}),
    P.FREED: frozenset(),
}
"""The moves allowed. NOTE: FREED only at the sender's end event, never at an abort: ZMQ may
still be reading the blocks."""
