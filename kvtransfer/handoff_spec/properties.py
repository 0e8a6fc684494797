"""What the handoff model must satisfy, and each request's local states on both sides.

Safety, on every state (`invariant`):
- no block is written unless granted to the writing request: never while free, never while
  another request holds it (a step that writes records the breach; see model._write);
- the pool's books agree: a block the pool gives a request is the one that request holds,
  and no block is both free and held;
- no request ends more than once;
- (ZMQ path) frames in flight, views of the prefill worker's blocks, read only blocks their
  request still holds, in the allocation they were sent from.
On every step (`step_invariant`): each request's decode and prefill local states move only
as tables.py allows. At rest (`at_rest`, a state nothing but a fault would change): every
request ended and nothing held (no leak). The checker adds liveness: every state can reach
an end (`is_end`).
"""

from __future__ import annotations

from tandem.kvtransfer.handoff_spec.state import (
    SHM,
    Config,
    F,
    G,
    Mode,
    Msg,
    Phase,
    Sender,
    Seq,
    State,
    Status,
    token_str,
)
from tandem.kvtransfer.handoff_spec.tables import DECODE, PREFILL, is_move

Finding = tuple[str, str]


def decode_local(q: tuple[int, ...]) -> str | None:
    """Request `q`'s state on the decode worker, as tables.DECODE_TABLE names it (None: not
    reserved yet): the worker's handoff state (decode_node/handoff.py), with RESERVED split
    by whether the receiver has counted a layer."""
    seq = q[F.SEQ]
    if seq == Seq.NONE:
        return None
    if seq == Seq.RESERVED:
        return "receiving" if q[F.RX] > 0 else "reserved"
    return _DECODE_NAMES[seq]


_DECODE_NAMES = {Seq.STREAMED: "first_token_sent", Seq.FINISHED_FIRST: "ended_before_kv", Seq.ARRIVED: "ready",
                 Seq.RUNNING: "running", Seq.ABORTING: "aborting", Seq.FREED: "freed"}


def prefill_local(q: tuple[int, ...], num_messages: int) -> str | None:
    """Request `q`'s state on the prefill worker, as tables.PREFILL_TABLE names it (None:
    not admitted yet)."""
    sender = q[F.SENDER]
    if sender == Sender.NONE:
        return None
    if sender == Sender.RELEASED:
        return "freed"
    if sender == Sender.ABORTED:
        return "aborted"
    return "prefilling" if q[F.SENT] == 0 else "sending" if q[F.SENT] < num_messages else "sent"


def invariant(cfg: Config, s: State) -> Finding | None:
    g, reqs, owner = s[0], s[1], s[2]
    if g[G.BAD]:
        name, _, message = g[G.BAD].partition(": ")
        return name, message
    for r, q in enumerate(reqs):
        if q[F.ENDS] > 1:
            return "ends_once", f"r{r} ended {q[F.ENDS]} times"
        block = q[F.HELD]
        if (block >= 0) != (q[F.SEQ] in Seq.HOLDING):
            return "block_books", f"r{r}'s sequence and its block disagree"
        if block >= 0 and owner[block] != r:
            return "block_books", f"r{r} holds block {block}, which the pool gives to {owner[block]}"
    for block, r in enumerate(owner):
        if r >= 0 and reqs[r][F.HELD] != block:
            return "block_books", f"block {block} is given to r{r}, which does not hold it"
    if cfg.path != SHM:
        for m in s[4]:
            if m[0] == Msg.LAYER and m[4] == g[G.P_EPOCH]:
                q = reqs[m[1]]
                if not q[F.SRC_HELD] or q[F.SRC_GEN] != m[5]:
                    return "source_read_after_free", (f"frames of r{m[1]} still queued read source blocks "
                                                      "freed since they were sent")
    return None


def step_invariant(cfg: Config, before: State, after: State) -> Finding | None:
    m = cfg.messages
    for r, (a, b) in enumerate(zip(before[1], after[1])):
        if a is b or a == b:
            continue
        for side, was, now in ((DECODE, decode_local(a), decode_local(b)),
                               (PREFILL, prefill_local(a, m), prefill_local(b, m))):
            if not is_move(side, was, now):
                return "table", f"r{r}'s {side} state moved {was} -> {now}, which tables.py does not allow"
    return None


def held(s: State) -> list[str]:
    """What `s` still holds: blocks, grants, reservations, source blocks, work in flight."""
    g, reqs, owner, grants = s[0], s[1], s[2], s[3]
    out = [f"D block {b} held by r{r}" for b, r in enumerate(owner) if r >= 0]
    out += [f"D grant {token_str(t)} on block {b}" for b, t in enumerate(grants) if t]
    for r, q in enumerate(reqs):
        if q[F.OPEN] or q[F.REVOKE]:
            out.append(f"D's receiver expects r{r}, or revokes its grant")
        if q[F.SRC_HELD] or q[F.ALIVE] or q[F.SENDER] in Sender.HOLDING:
            out.append(f"P holds r{r}")
        if q[F.EVENT] or q[F.CALL_START] or q[F.CALL_D_ABORT] or q[F.CALL_PREFILL] or q[F.CALL_P_ABORT]:
            out.append(f"work for r{r} pending")
    if s[4] or s[5] or g[G.D_BUSY] >= 0 or g[G.WRITER] >= 0:
        out.append("messages or a write in flight")
    return out


def is_end(s: State) -> bool:
    return not s[0][G.BAD] and all(q[F.PHASE] == Phase.ENDED for q in s[1]) and not held(s)


def at_rest(s: State) -> Finding | None:
    if is_end(s):
        return None
    left = held(s)
    if left:
        return "no_leak", "nothing will ever release: " + "; ".join(left)
    pending = [f"r{r}" for r, q in enumerate(s[1]) if q[F.PHASE] != Phase.ENDED]
    return "ends", "requests that never end: " + ", ".join(pending)


_PHASES = ("new", "prefill", "follow", "ENDED")


def describe(cfg: Config, s: State) -> str:
    """One line: the workers, the pool, each request on both sides, the messages in flight."""
    g, reqs = s[0], s[1]
    mode = {Mode.UP: "up", Mode.STOPPED: "STOPPED"}
    parts = [f"D e{g[G.D_EPOCH]} {mode[g[G.D_MODE]]}, P e{g[G.P_EPOCH]} {mode[g[G.P_MODE]]}",
             "blocks [" + " ".join("free" if r < 0 else f"r{r}" for r in s[2]) + "]"]
    if cfg.path == SHM:
        parts.append("grants [" + " ".join(token_str(t) for t in s[3]) + "]")
    for r, q in enumerate(reqs):
        status = Status(q[F.STATUS]).name if q[F.PHASE] == Phase.ENDED else _PHASES[q[F.PHASE]]
        parts.append(f"r{r}: {status}, D {decode_local(q) or '-'}"
                     + (f" {q[F.RX]}/{cfg.messages}" if q[F.SEQ] == Seq.RESERVED and q[F.RX] > 0 else "")
                     + f", P {prefill_local(q, cfg.messages) or '-'}")
    to_d = " ".join(("L" if m[0] == Msg.LAYER else "A") + f"r{m[1]}.{m[2]}" for m in s[4])
    to_p = " ".join({Msg.DONE: "DONE", Msg.FAILED: "FAILED", Msg.ABORT: "ABORT"}[m[0]] + f"r{m[1]}" for m in s[5])
    parts.append(f"to D [{to_d}] to P [{to_p}]")
    if g[G.WRITER] >= 0:
        parts.append(f"P writing r{g[G.WRITER]}")
    return "; ".join(parts)
