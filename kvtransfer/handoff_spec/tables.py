"""Each side's life of one request in the KV handoff, as a plain table of allowed moves.

The decode worker (decode_node/worker.py with its KVReceiver) and the prefill worker
(prefill_node/worker.py with its KVSender) each hold a request in one local state at a time;
a recorded sequence of those states (a log, a trace of the model in model.py) must be a path
of the side's table from its initial state. `is_path` checks one; the conformance checks of
the real workers can replay their recorded states through it.

Decode side (decode_node/handoff.py's DecodeHandoff, with RESERVED split in two by the
receiver's count):
- reserved: blocks held, the receiver expects the KV, none of it has arrived.
- receiving: some of the KV arrived; the engine has not yet learnt it is all in.
- first_token_held: the first token came before the KV and waits for it (n > 1, beams).
- first_token_sent: the first token went out while the KV was still arriving.
- ended_before_kv: the first token ended the request before the KV was all in: the
  blocks wait for the transfer's end.
- ready: the whole KV is in (its grant revoked), the first token is awaited.
- running: in the continuous batch (the handoff is over).
- aborting: aborted while an in-place write held its blocks: they wait for the revoke.
- freed: the blocks are back in the pool (an abort, a failed transfer, a first token that
  ended it, the worker's death; a finish once running).

Prefill side (prefill_node/handoff.py's PrefillHandoff):
- prefilling: admitted (the sender began), no layer sent yet.
- sending: some layers sent.
- sent: every layer sent and the first token returned; the ack awaited.
- aborted: ended by the worker's abort; the blocks wait for the sender to let go.
- freed: the transfer ended and the source blocks are free (or the worker died).

`REAL_DECODE` and `REAL_PREFILL` name the table state of each of the workers' own states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DECODE = "decode"
PREFILL = "prefill"

_AFTER_RESERVED = frozenset({"receiving", "first_token_held", "first_token_sent", "ended_before_kv", "ready",
                             "aborting", "freed"})
DECODE_TABLE: Mapping[str, frozenset[str]] = {
    "reserved": _AFTER_RESERVED,
    "receiving": _AFTER_RESERVED,
    "first_token_held": frozenset({"running", "aborting", "freed"}),
    "first_token_sent": frozenset({"running", "aborting", "freed"}),
    "ended_before_kv": frozenset({"aborting", "freed"}),
    "ready": frozenset({"running", "freed"}),
    "running": frozenset({"freed"}),
    "aborting": frozenset({"freed"}),
    "freed": frozenset(),
}
PREFILL_TABLE: Mapping[str, frozenset[str]] = {
    "prefilling": frozenset({"sending", "sent", "aborted", "freed"}),
    "sending": frozenset({"sending", "sent", "aborted", "freed"}),
    "sent": frozenset({"aborted", "freed"}),
    "aborted": frozenset({"freed"}),
    "freed": frozenset(),
}
TABLES: Mapping[str, Mapping[str, frozenset[str]]] = {DECODE: DECODE_TABLE, PREFILL: PREFILL_TABLE}
INITIAL: Mapping[str, str] = {DECODE: "reserved", PREFILL: "prefilling"}
FINAL: Mapping[str, str] = {DECODE: "freed", PREFILL: "freed"}
REAL_DECODE: Mapping[str, str] = {
    "RESERVED": "reserved", "FIRST_TOKEN_HELD": "first_token_held", "FIRST_TOKEN_SENT": "first_token_sent",
    "ENDED_BEFORE_KV": "ended_before_kv", "READY": "ready", "RUNNING": "running", "ABORTING": "aborting",
    "FREED": "freed",
}
"""decode_node/handoff.py's DecodeHandoff names -> this table's states (RESERVED may also
be recorded as receiving, by a recorder that sees the receiver's count)."""
REAL_PREFILL: Mapping[str, str] = {
    "PREFILLING": "prefilling", "SENDING": "sending", "SENT": "sent", "ABORTED": "aborted", "FREED": "freed",
}
"""prefill_node/handoff.py's PrefillHandoff names -> this table's states."""


@dataclass(frozen=True)
class PathVerdict:
    """Whether a recorded sequence of states is a path of a side's table; false with the
    reason when it is not (usable as a bool)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def is_path(side: str, states: Sequence[str]) -> PathVerdict:
    """Whether `states` (one request's local states on `side`, "decode" or "prefill", in the
    order they were entered) starts at the side's initial state and takes only allowed
    moves. A state repeated in a row is a move too: allowed only where the table has the
    loop (a layer more received or sent). The path need not reach the final state (a
    request still under way)."""
    table = TABLES.get(side)
    if table is None:
        return PathVerdict(False, f"no side {side!r} (one of {sorted(TABLES)})")
    if not states:
        return PathVerdict(False, "an empty path")
    unknown = [s for s in states if s not in table]
    if unknown:
        return PathVerdict(False, f"{unknown[0]!r} is no {side} state")
    if states[0] != INITIAL[side]:
        return PathVerdict(False, f"starts at {states[0]!r}, not at {INITIAL[side]!r}")
    for i, (a, b) in enumerate(zip(states, states[1:]), start=1):
        if b not in table[a]:
            return PathVerdict(False, f"move {i}: {a} -> {b} is not allowed (from {a}: {sorted(table[a])})")
    return PathVerdict(True)


def is_move(side: str, before: str | None, after: str | None) -> bool:
    """Whether one step of a model may take a request's local state from `before` to
    `after` (None: the side does not know the request yet). Staying put is always allowed:
    another actor moved."""
    if before == after:
        return True
    if before is None:
        return after == INITIAL[side]
    return after is not None and after in TABLES[side][before]
