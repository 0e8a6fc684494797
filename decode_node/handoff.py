"""Where each request prefilled elsewhere stands on its decode worker: the states of its
handoff, the moves allowed between them, and the worker's table of them (one entry per
request from `reserve` until it joins the running batch, where the engine's scheduler owns
it, or until its blocks are free)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem.engine.sequence import Sequence
from tandem.worker.api import PrefillResult
from tandem.worker.state_table import StateTable


class DecodeHandoff(enum.IntEnum):
    """A request's place in the handoff on its decode worker."""

    RESERVED = 0
    """Blocks held, KV expected; no first token yet."""
    FIRST_TOKEN_HELD = 1
    """Its first token came before its KV and waits for it (n > 1 and beam search fork the
    prompt's blocks, so they start only once the KV is in)."""
    FIRST_TOKEN_SENT = 2
    """Its first token was streamed while the KV still arrives."""
    ENDED_BEFORE_KV = 3
    """Its first token ended it before the KV was all in: the blocks wait for the transfer's end."""
    READY = 4
    """The KV is in; the first token is awaited."""
    RUNNING = 5
    """Joined the running batch: the handoff is over (leaves the table)."""
    ABORTING = 6
    """Ended by an abort while a same-node writer held its blocks: they wait for the revoke."""
    FREED = 7
    """Ended, its blocks back in the pool (leaves the table)."""


S = DecodeHandoff
TRANSITIONS: dict[DecodeHandoff, frozenset[DecodeHandoff]] = {
    S.RESERVED: frozenset({S.FIRST_TOKEN_HELD, S.FIRST_TOKEN_SENT, S.ENDED_BEFORE_KV, S.READY, S.ABORTING, S.FREED}),
    S.FIRST_TOKEN_HELD: frozenset({S.RUNNING, S.ABORTING, S.FREED}),
    S.FIRST_TOKEN_SENT: frozenset({S.RUNNING, S.ABORTING, S.FREED}),
    S.ENDED_BEFORE_KV: frozenset({S.ABORTING, S.FREED}),
    S.READY: frozenset({S.RUNNING, S.FREED}),
    S.ABORTING: frozenset({S.FREED}),
    S.RUNNING: frozenset(),
    S.FREED: frozenset(),
}
"""The moves allowed. NOTE: READY has no ABORTING: its KV is in, so no writer is left."""


@dataclass
class Handoff:
    state: DecodeHandoff = S.RESERVED
    first: PrefillResult | None = None
    """The first token, while FIRST_TOKEN_HELD."""
    seq: Sequence | None = None
    """The ended sequence whose blocks are still held (ENDED_BEFORE_KV, ABORTING)."""


def handoff_table() -> StateTable[DecodeHandoff, Handoff]:
    return StateTable(S.RESERVED, TRANSITIONS)
