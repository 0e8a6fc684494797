"""The KV handoff as an executable model: every action of the router (here), the decode
worker (decode_side.py), the prefill worker (prefill_side.py) and the faults (faults.py),
as one successor function over state.py's states, for checker.py to explore.

The router (router/ray_backend.py) reserves on the decode worker D (`_reserve`: blocks and
a grant), calls prefill on the prefill worker P, hands P's first token to D (`_prefill`:
`start`) and follows D's stream to its last delta. On any other exit (a cancel, a worker
dead or marked down, a failed prefill) it aborts on both (`_follow`'s finally,
`WorkerCalls.abort_on`: a worker marked down gets the abort when it answers; a restarted
one holds nothing of the request). Admission that finds no room, or no healthy worker,
refuses the request.

Faults are injected from outside (labels "fault: ..."), at most `Config.faults` of them: a
crash, a stop (then a resume, or a kill once it is marked hung: "recover: ..."), or a
deadline that expires while its peer is merely slow. A deadline whose peer is gone or
stopped is no fault ("timeout: ..."): it is how the real workers recover.
"""

from __future__ import annotations

from tandem.kvtransfer.handoff_spec import properties
from tandem.kvtransfer.handoff_spec.actions import Out
from tandem.kvtransfer.handoff_spec.decode_side import DecodeSide
from tandem.kvtransfer.handoff_spec.faults import Faults
from tandem.kvtransfer.handoff_spec.prefill_side import PrefillSide
from tandem.kvtransfer.handoff_spec.state import (
    TOKEN_EPOCH,
    Delta,
    Draft,
    F,
    G,
    Mode,
    Phase,
    Result,
    Seq,
    State,
    Status,
    initial_state,
    token_str,
)

_DELTAS = {Delta.FINISH: "last token", Delta.ABORT: "abort delta", Delta.ERROR: "error delta"}


class HandoffModel(DecodeSide, PrefillSide, Faults):
    """The handoff under `cfg`, as checker.Model."""

    def initial(self) -> State:
        return initial_state(self.cfg)

    def successors(self, s: State) -> Out:
        """Every action enabled in `s`: (its label, the state it leads to)."""
        out: Out = []
        g = s[0]
        if g[G.BAD]:
            return out  # a violation ends the run
        self._router(s, out)
        if g[G.D_MODE] == Mode.UP:
            self._decode(s, out)
        if g[G.P_MODE] == Mode.UP:
            self._prefill(s, out)
        self._faults(s, out)
        return out

    @staticmethod
    def is_fault(label: str) -> bool:
        """Injected from outside: a crash, a stop, a deadline expiring early, a client's
        cancel (not the "recover:" steps after a stop, nor justified "timeout:" steps)."""
        return label.startswith("fault:")

    def invariant(self, s: State) -> tuple[str, str] | None:
        return properties.invariant(self.cfg, s)

    def step_invariant(self, before: State, label: str, after: State) -> tuple[str, str] | None:
        return properties.step_invariant(self.cfg, before, after)

    def at_rest(self, s: State) -> tuple[str, str] | None:
        return properties.at_rest(s)

    def is_end(self, s: State) -> bool:
        return properties.is_end(s)

    def describe(self, s: State) -> str:
        return properties.describe(self.cfg, s)

    # -- the router ---------------------------------------------------------------------
    def _router(self, s: State, out: Out) -> None:
        g, reqs, owner = s[0], s[1], s[2]
        free = owner.index(-1) if -1 in owner else -1
        routable = g[G.D_MODE] == Mode.UP and g[G.D_BUSY] < 0 and not g[G.D_MARKED] and not g[G.P_MARKED]
        for r, q in enumerate(reqs):
            phase = q[F.PHASE]
            if phase == Phase.ENDED:
                continue
            if g[G.CANCELS]:
                d = Draft(s)
                d.g[G.CANCELS] -= 1
                out.append((f"fault: the client cancels r{r}", self._end(d, r, Status.ABORTED)))
            if phase == Phase.NEW:
                if routable and free >= 0:
                    out.append(self._reserve(s, r, free))
                if free < 0 or g[G.D_MARKED] or g[G.P_MARKED]:
                    out.append((f"router refuses r{r} (no room, or no healthy worker)",
                                self._end(Draft(s), r, Status.FAILED)))
                continue
            if q[F.D_EPOCH] != g[G.D_EPOCH] or g[G.D_MARKED]:
                out.append((f"router: D is gone (dead or hung) under r{r}: it aborts on both",
                            self._end(Draft(s), r, Status.FAILED)))
            if q[F.DELTA]:
                status = Status.DONE if q[F.DELTA] == Delta.FINISH else Status.FAILED
                out.append((f"router reads r{r}'s {_DELTAS[q[F.DELTA]]} from D's stream: {status.name}",
                            self._end(Draft(s), r, status)))
            if phase != Phase.PREFILLING:
                continue
            if q[F.RESULT] == Result.FIRST_TOKEN:
                d = Draft(s)
                q2 = d.req(r)
                q2[F.PHASE], q2[F.RESULT] = Phase.FOLLOWING, Result.WAITING
                q2[F.CALL_START] = int(q[F.D_EPOCH] == g[G.D_EPOCH])
                out.append((f"router gets r{r}'s first token from P and hands it to D (start)", d.state()))
            elif q[F.RESULT] == Result.ERROR:
                d = Draft(s)
                q2 = d.req(r)
                q2[F.PHASE], q2[F.RESULT] = Phase.FOLLOWING, Result.WAITING
                q2[F.CALL_D_ABORT] = int(q[F.D_EPOCH] == g[G.D_EPOCH])
                out.append((f"router: r{r}'s prefill call failed: it aborts on D", d.state()))
            elif q[F.P_EPOCH] != g[G.P_EPOCH] or g[G.P_MARKED]:
                out.append((f"router: P is gone (dead or hung) under r{r}: it aborts on both",
                            self._end(Draft(s), r, Status.FAILED)))
        for who, mode, marked in (("D", G.D_MODE, G.D_MARKED), ("P", G.P_MODE, G.P_MARKED)):
            if g[mode] == Mode.STOPPED and not g[marked]:
                d = Draft(s)
                d.g[marked] = 1
                out.append((f"router marks {who} down (no heartbeat for 15 s)", d.state()))

    def _reserve(self, s: State, r: int, block: int) -> tuple[str, State]:
        d = Draft(s)
        g = d.g
        token = g[G.D_EPOCH] * TOKEN_EPOCH + g[G.D_NEXT]
        g[G.D_NEXT] += 1
        d.owner[block] = r
        if self.shm:
            d.grants[block] = token  # fence.grant, in KVReceiver.expect
        q = d.req(r)
        q[F.PHASE], q[F.D_EPOCH], q[F.P_EPOCH] = Phase.PREFILLING, g[G.D_EPOCH], g[G.P_EPOCH]
        q[F.TOKEN], q[F.BLOCK], q[F.RX], q[F.OPEN] = token, block, 0, 1
        q[F.SEQ], q[F.HELD], q[F.CALL_PREFILL] = Seq.RESERVED, block, 1
        return f"router: D reserves block {block} for r{r} (grant {token_str(token)}); prefill called on P", d.state()

    @staticmethod
    def _end(d: Draft, r: int, status: Status) -> State:
        """The request ends for its caller. On any exit but a finish the router aborts it on
        both workers (NOTE: not on a restarted one: it holds nothing of the request)."""
        q = d.req(r)
        was = q[F.PHASE]
        q[F.STATUS], q[F.ENDS], q[F.PHASE] = status, q[F.ENDS] + 1, Phase.ENDED
        q[F.DELTA], q[F.RESULT] = Delta.NONE, Result.WAITING
        if status != Status.DONE and was != Phase.NEW:
            q[F.CALL_D_ABORT] |= int(q[F.D_EPOCH] == d.g[G.D_EPOCH])
            q[F.CALL_P_ABORT] |= int(q[F.P_EPOCH] == d.g[G.P_EPOCH])
        return d.state()
