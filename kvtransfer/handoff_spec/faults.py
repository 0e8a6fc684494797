"""Faults injected into the handoff: a worker crashes (Ray restarts it empty, with a new
epoch: a new pool, grant table and transfer address), or is stopped (SIGSTOP: it does
nothing, messages to it queue) and later resumed, or killed once the router has found it
hung. Each crash or stop spends one of the run's faults; the resume or kill after a stop
does not ("recover: ..."), nor does anything the router does about it.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.kvtransfer.handoff_spec.actions import Actions, Out
from tandem.kvtransfer.handoff_spec.state import Delta, Draft, Event, F, G, Mode, Sender, Seq, State


class Faults(Actions):
    def _faults(self, s: State, out: Out) -> None:
        g = s[0]
        for who, epoch, mode, marked in (("D", G.D_EPOCH, G.D_MODE, G.D_MARKED),
                                         ("P", G.P_EPOCH, G.P_MODE, G.P_MARKED)):
            restart = f"Ray restarts it empty (epoch {g[epoch] + 1})"
            if g[G.FAULTS]:
                self._crashes(s, who, f"fault: {who} crashes; {restart}", True, out)
                d = Draft(s)
                d.g[G.FAULTS] -= 1
                d.g[mode] = Mode.STOPPED
                out.append((f"fault: {who} is stopped (SIGSTOP)", d.state()))
            if g[mode] == Mode.STOPPED:
                d = Draft(s)
                d.g[mode], d.g[marked] = Mode.UP, 0
                out.append((f"recover: {who} resumes (SIGCONT)", d.state()))
                self._crashes(s, who, f"recover: the hung {who} is killed; {restart}", False, out)

    def _crashes(self, s: State, who: str, label: str, spend: bool, out: Out) -> None:
        """A crash, once for each number of the dead worker's messages still in flight that
        had left it (the oldest first: the rest die in its socket)."""
        crash = self._crash_decode if who == "D" else self._crash_prefill
        sent = s[5] if who == "D" else s[4]
        for kept in range(len(sent), -1, -1):
            d = crash(s, spend)
            lost = f" ({len(sent) - kept} of its messages in flight lost)" if kept < len(sent) else ""
            if who == "D":
                d.to_p = sent[:kept]
            else:
                d.to_d = sent[:kept]
            out.append((label + lost, d.state()))

    @staticmethod
    def _restart(s: State, spend: bool, epoch: int, mode: int, marked: int,
                 forget: Callable[[list[int]], None]) -> Draft:
        d = Draft(s)
        d.g[epoch] += 1
        d.g[mode], d.g[marked] = Mode.UP, 0
        d.g[G.FAULTS] -= int(spend)
        for r in range(len(d.reqs)):
            forget(d.req(r))
        return d

    def _crash_decode(self, s: State, spend: bool) -> Draft:
        def forget(q: list[int]) -> None:
            q[F.RX], q[F.OPEN], q[F.REVOKE], q[F.HELD], q[F.EVENT], q[F.DELTA] = -1, 0, 0, -1, Event.NONE, Delta.NONE
            q[F.CALL_START] = q[F.CALL_D_ABORT] = 0  # calls in flight fail with the process
            if q[F.SEQ] in Seq.HOLDING:
                q[F.SEQ] = Seq.FREED  # with the process's pool
        d = self._restart(s, spend, G.D_EPOCH, G.D_MODE, G.D_MARKED, forget)
        d.g[G.D_NEXT], d.g[G.D_BUSY] = 1, -1
        d.owner = [-1] * len(d.owner)
        d.grants = [0] * len(d.grants)
        # NOTE: messages in flight to it stay: a late one may reach the new incarnation.
        return d

    def _crash_prefill(self, s: State, spend: bool) -> Draft:
        def forget(q: list[int]) -> None:
            if q[F.SENDER] in Sender.HOLDING:
                q[F.SENDER] = Sender.RELEASED  # its pool dies with it
            q[F.ALIVE], q[F.SRC_HELD], q[F.SENT], q[F.SRC_GEN] = 0, 0, 0, 0
            q[F.CALL_PREFILL] = q[F.CALL_P_ABORT] = 0
        d = self._restart(s, spend, G.P_EPOCH, G.P_MODE, G.P_MARKED, forget)
        d.g[G.WRITER], d.g[G.WRITER_EPOCH] = -1, -1  # its locks die with it
        return d
