"""The handoff model's state: plain tuples of small integers, hashable and cheap to copy.

A state is (globals, requests, owner, grants, to_decode, to_prefill):
- globals (G): both workers (epoch, up or stopped, marked down by the router), the decode
  worker's next grant number and a half-done abort (a planted bug's), the fence lock a
  prefill worker's in-place write holds, the fault and cancel budgets, and the violation a
  step committed ("" when none);
- requests: one tuple per request of the fields F names (the router's view, the calls in
  the workers' inboxes, the decode side, the prefill side);
- owner: the decode pool's blocks, each -1 (free) or the request holding it;
- grants: the pool's grant table (fence.py), each 0 or the token of the reservation that may
  write the block: epoch * TOKEN_EPOCH + its number in that epoch;
- to_decode, to_prefill: messages in flight between the two, oldest first (one ZMQ pair
  keeps its order): (kind, request, index, token, prefill epoch, source allocation) to the
  decode worker, (kind, request, prefill epoch) back.

`Draft` builds a successor from a state, copying only what an action changes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

State = tuple[tuple[Any, ...], tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...],
              tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]

SHM = "shm"
ZMQ = "zmq"
TOKEN_EPOCH = 16


class Status(enum.IntEnum):
    """How a request ended, as its caller sees it (ordered: the worse, the larger)."""

    PENDING = 0
    DONE = 1
    ABORTED = 2
    FAILED = 3


@dataclass(frozen=True)
class Config:
    """What the model explores, and the deliberately wrong variants it can be made into."""

    requests: int = 2
    layers: int = 2
    chunks: int = 1
    """Prefill chunks per prompt, each sending every layer once (chunks * layers messages)."""
    blocks: int = 1
    """Decode pool blocks (a request holds one): fewer than requests forces their reuse."""
    faults: int = 1
    """Crashes, stops (with the resume or kill after, once) and deadlines that expire early."""
    cancels: int = 0
    """Client cancels (or deadlines), at any moment before the request ends."""
    path: str = SHM
    """SHM: the prefill worker writes in place under the fence, then sends the header; ZMQ:
    the rows travel as frames (views of the prefill pool), the receiver writes them."""
    first_token_may_finish: bool = True
    """A first token may end the request (max_tokens 1, a stop token)."""
    free_before_revoke: bool = False
    """BUG: the decode worker's abort frees the blocks, then closes the reservation (revokes)."""
    free_while_revoking: bool = False
    """BUG: the decode worker's abort frees the blocks even when the revoke must wait for a
    write in progress (decode_node/worker.py keeps them until the revoke's event)."""
    no_receiver_deadline: bool = False
    """BUG (liveness): the receiver never gives up on KV that stopped coming."""
    no_epoch_check: bool = False
    """BUG: a grant is compared without its epoch (a per-pool counter over a pool that
    outlives the worker's restart)."""
    prefill_preemption: bool = False
    """The prefill scheduler may preempt a prompt between chunks, freeing its blocks while
    frames sent from them may still be queued (as scheduler.py and preemption.py do)."""

    @property
    def messages(self) -> int:
        """LAYER messages of one request's transfer."""
        return self.chunks * self.layers


class G:
    """Indices of the globals."""

    D_EPOCH, D_MODE, D_MARKED, D_NEXT, D_BUSY, P_EPOCH, P_MODE, P_MARKED, WRITER, WRITER_EPOCH, FAULTS, CANCELS, \
        BAD = range(13)


class F:
    """Indices of a request's fields."""

    # the router: its phase, the status it ended with and how often, where it went (the
    # decode and prefill epochs, the reservation's token and block), the prefill call's result
    PHASE, STATUS, ENDS, D_EPOCH, P_EPOCH, TOKEN, BLOCK, RESULT = range(8)
    # calls waiting in the workers' inboxes (Ray actor calls: taken in any order)
    CALL_START, CALL_D_ABORT, CALL_PREFILL, CALL_P_ABORT = range(8, 12)
    # decode: messages the receiver counted (-1: it does not know the request), whether it
    # expects more (the reservation stands), the event of a close whose revoke waits for a
    # writer (revoker.py), the engine's sequence (Seq) and the block it holds, the event for
    # the engine loop, the delta for the router to read
    RX, OPEN, REVOKE, SEQ, HELD, EVENT, DELTA = range(12, 19)
    # prefill: messages computed, the sequence alive, the sender (Sender), the source
    # blocks held, and their allocation (a preemption frees and allocates them again)
    SENT, ALIVE, SENDER, SRC_HELD, SRC_GEN = range(19, 24)
    COUNT = 24


class Mode:
    UP, STOPPED = range(2)


class Phase:
    NEW, PREFILLING, FOLLOWING, ENDED = range(4)


class Result:
    WAITING, FIRST_TOKEN, ERROR = range(3)


class Seq:
    """The decode engine's sequence (decode_node/handoff.py's states, and the engine's)."""

    NONE, RESERVED, STREAMED, FINISHED_FIRST, ARRIVED, RUNNING, ABORTING, FREED = range(8)
    HOLDING = (RESERVED, STREAMED, FINISHED_FIRST, ARRIVED, RUNNING, ABORTING)


class Event:
    """A transfer's end, as the receiver reports it to the engine loop."""

    NONE, DONE, FAILED, ABORTED = range(4)


class Delta:
    """What the router reads next from the decode worker's stream."""

    NONE, FINISH, ABORT, ERROR = range(4)


class Sender:
    """The prefill side of a transfer: ABORTED is ended by the worker's `abort`."""

    NONE, LIVE, DONE, FAILED, ABORTED, RELEASED = range(6)
    ENDED = (DONE, FAILED, ABORTED)
    HOLDING = (LIVE, DONE, FAILED, ABORTED)


class Msg:
    LAYER, ABORT, DONE, FAILED = range(4)


def initial_state(cfg: Config) -> State:
    g = (0, Mode.UP, 0, 1, -1, 0, Mode.UP, 0, -1, -1, cfg.faults, cfg.cancels, "")
    req = (Phase.NEW, Status.PENDING, 0, -1, -1, 0, -1, Result.WAITING, 0, 0, 0, 0, -1, 0, Event.NONE, Seq.NONE,
           -1, Event.NONE, Delta.NONE, 0, 0, Sender.NONE, 0, 0)
    assert len(req) == F.COUNT
    return (g, (req,) * cfg.requests, (-1,) * cfg.blocks, (0,) * cfg.blocks, (), ())


class Draft:
    """A successor under construction: globals and blocks as lists, requests copied on
    first write (`req`), channels as tuples replaced whole."""

    __slots__ = ("g", "reqs", "owner", "grants", "to_d", "to_p")

    def __init__(self, s: State) -> None:
        self.g = list(s[0])
        self.reqs: list[Any] = list(s[1])
        self.owner = list(s[2])
        self.grants = list(s[3])
        self.to_d = s[4]
        self.to_p = s[5]

    def req(self, r: int) -> list[int]:
        q = self.reqs[r]
        if type(q) is tuple:
            q = self.reqs[r] = list(q)
        return q

    def state(self) -> State:
        reqs = self.reqs
        for r, q in enumerate(reqs):
            if q[F.PHASE] == Phase.ENDED and q[F.TOKEN] and self._forgotten(r, q):
                q = self.req(r)
                q[F.D_EPOCH], q[F.P_EPOCH], q[F.TOKEN], q[F.BLOCK], q[F.RX] = -1, -1, 0, -1, -1
        return (tuple(self.g), tuple([q if type(q) is tuple else tuple(q) for q in reqs]),
                tuple(self.owner), tuple(self.grants), self.to_d, self.to_p)

    def _forgotten(self, r: int, q: Any) -> bool:
        """Whether nothing refers to r's reservation any more (its destination, grant, the
        receiver's memory of its end): those dead fields are then dropped, so that runs
        differing only in them meet in one state."""
        return (not q[F.OPEN] and not q[F.REVOKE] and q[F.SEQ] not in Seq.HOLDING and not q[F.EVENT]
                and q[F.SENDER] not in Sender.HOLDING
                and not (q[F.CALL_START] or q[F.CALL_D_ABORT] or q[F.CALL_PREFILL] or q[F.CALL_P_ABORT])
                and self.g[G.WRITER] != r and self.g[G.D_BUSY] != r
                and all(m[1] != r for m in self.to_d) and all(m[1] != r for m in self.to_p))

    def land(self, r: int, epoch: int) -> None:
        """r's rows land in its block of the pool of the decode worker's `epoch`.
        NOTE: the invariant that matters: the block must be r's. (A write into the pool of
        a dead incarnation touches nothing live: its memory goes with the last mapping.)"""
        if epoch != self.g[G.D_EPOCH]:
            return
        block = self.reqs[r][F.BLOCK]
        owner = self.owner[block]
        if owner < 0:
            self.bad(f"write_after_free: block {block} written for r{r} while free")
        elif owner != r:
            self.bad(f"write_to_other: block {block} written for r{r} while it is r{owner}'s")

    def bad(self, finding: str) -> None:
        """Record the safety violation this step commits ("name: what"); the checker reports it."""
        if not self.g[G.BAD]:
            self.g[G.BAD] = finding


def token_str(token: int) -> str:
    return f"e{token // TOKEN_EPOCH}#{token % TOKEN_EPOCH}" if token else "-"
