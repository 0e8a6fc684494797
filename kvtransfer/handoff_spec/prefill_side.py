"""The prefill worker's actions, all on its engine loop (prefill_node/worker.py with its
kvtransfer/sender.py): `_admit` (even after an abort that found nothing: that race is
real), each layer computed and sent (SHM: written in place under the fence, then its
header; ZMQ: frames that are views of its pool), `_abort`, and the tick (`poll`: acks, the
ack deadline, a peer closed while frames of ended requests stay queued; the source blocks
freed once nothing reads them).

NOTE: a transfer's source blocks are freed only once no frame of it is queued (`_pinned`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kvtransfer.handoff_spec.actions import Actions, Out
from tandem.kvtransfer.handoff_spec.state import TOKEN_EPOCH, Draft, F, G, Mode, Msg, Phase, Result, Sender, State

_REPLIES = {Msg.DONE: "DONE", Msg.FAILED: "FAILED", Msg.ABORT: "ABORT"}


class PrefillSide(Actions):
    def _prefill(self, s: State, out: Out) -> None:
        g, reqs = s[0], s[1]
        if g[G.WRITER] >= 0:  # the engine loop is inside an in-place write: only its end
            out.append(self._write_done(s, g[G.WRITER]))
            return
        m = self.cfg.messages
        for r, q in enumerate(reqs):
            if q[F.CALL_PREFILL]:
                d = Draft(s)
                q2 = d.req(r)
                q2[F.CALL_PREFILL], q2[F.ALIVE], q2[F.SENT], q2[F.SENDER], q2[F.SRC_HELD] = 0, 1, 0, Sender.LIVE, 1
                out.append((f"P admits r{r}'s prompt: the sender begins, its blocks are kept", d.state()))
            if q[F.CALL_P_ABORT]:
                out.append(self._abort_prefill(s, r))
            if q[F.ALIVE] and q[F.SENT] < m:
                out.append(self._compute(s, r))
            sender = q[F.SENDER]
            if sender == Sender.LIVE and q[F.SENT] > 0:
                d = Draft(s)
                self._end_transfer(d, r, Sender.FAILED)
                receiver_gone = g[G.D_MODE] == Mode.STOPPED or q[F.D_EPOCH] != g[G.D_EPOCH]
                self._expire(s, receiver_gone, f"P's sender has no ack for r{r}", d, out)
            if sender in Sender.ENDED and not self._pinned(s[4], g, r):
                d = Draft(s)
                self._release(d, r)
                out.append((f"P's tick frees r{r}'s source blocks: its transfer ended, no frame of it is queued",
                            d.state()))
            if self.cfg.prefill_preemption and q[F.ALIVE] and sender == Sender.LIVE and 0 < q[F.SENT] < m \
                    and q[F.SENT] % self.cfg.layers == 0 and not q[F.SRC_GEN]:  # (once: the state space stays finite)
                d = Draft(s)
                d.req(r)[F.SRC_GEN] += 1
                out.append((f"P's scheduler preempts r{r} between chunks: its blocks are freed and taken again",
                            d.state()))
        if s[5]:
            kind, r, pe = s[5][0]
            d = Draft(s)
            d.to_p = s[5][1:]
            if pe == g[G.P_EPOCH] and reqs[r][F.SENDER] == Sender.LIVE:
                self._end_transfer(d, r, Sender.DONE if kind == Msg.DONE else Sender.FAILED)
            out.append((f"P's sender reads D's {_REPLIES[kind]} for r{r}", d.state()))
        if not self.shm:
            self._drop_pinning_peers(s, out)

    def _pinned(self, to_d: tuple, g: Sequence[int], r: int) -> bool:
        """Whether frames of r, views of its source blocks, are still queued."""
        pe = g[G.P_EPOCH]
        return not self.shm and any(m[0] == Msg.LAYER and m[1] == r and m[4] == pe for m in to_d)

    @staticmethod
    def _resolve(d: Draft, r: int, result: int) -> None:
        """The prefill call's outcome, unless it has one (the router waits for it only while prefilling)."""
        q = d.req(r)
        if q[F.PHASE] == Phase.PREFILLING and q[F.RESULT] == Result.WAITING:
            q[F.RESULT] = result

    def _release(self, d: Draft, r: int) -> None:
        """`_tick` on the sender's event: the source blocks are freed (a failed transfer's
        sequence aborted, its call failed)."""
        q = d.req(r)
        if q[F.SENDER] != Sender.DONE:
            q[F.ALIVE] = 0
            self._resolve(d, r, Result.ERROR)
        q[F.SENDER], q[F.SRC_HELD], q[F.SENT], q[F.SRC_GEN] = Sender.RELEASED, 0, 0, 0

    def _end_transfer(self, d: Draft, r: int, how: int) -> None:
        """The sender ends r (in a tick): the same tick releases it, unless frames are queued."""
        d.req(r)[F.SENDER] = how
        if not self._pinned(d.to_d, d.g, r):
            self._release(d, r)

    def _advance(self, d: Draft, r: int) -> None:
        """One more message computed; the last one samples the first token, and the
        sequence ends (its blocks stay until the sender's event)."""
        q = d.req(r)
        q[F.SENT] += 1
        if q[F.SENT] == self.cfg.messages:
            q[F.ALIVE] = 0
            self._resolve(d, r, Result.FIRST_TOKEN)

    def _compute(self, s: State, r: int) -> tuple[str, State]:
        g, q = s[0], s[1][r]
        d = Draft(s)
        k = q[F.SENT]
        name = f"layer {k % self.cfg.layers} (chunk {k // self.cfg.layers}) of r{r}"
        if q[F.SENDER] != Sender.LIVE:
            self._advance(d, r)
            return f"P computes {name}; its transfer has ended: not sent", d.state()
        if self.shm:
            if self._granted(s[3][q[F.BLOCK]], q[F.TOKEN]):
                d.g[G.WRITER], d.g[G.WRITER_EPOCH] = r, g[G.D_EPOCH]
                return f"P computes {name}, takes its slot lock: the grant holds, the write begins", d.state()
            d.req(r)[F.SENDER] = Sender.FAILED  # reported at the next tick
            self._advance(d, r)
            return f"P computes {name}: its grant is revoked, the transfer fails", d.state()
        if q[F.D_EPOCH] != g[G.D_EPOCH]:
            d.req(r)[F.SENDER] = Sender.FAILED
            self._advance(d, r)
            return f"P computes {name}: D's address is gone, the send fails", d.state()
        d.to_d = d.to_d + ((Msg.LAYER, r, k, q[F.TOKEN], g[G.P_EPOCH], q[F.SRC_GEN]),)
        self._advance(d, r)
        return f"P computes {name} and sends it (its frames are views of the blocks)", d.state()

    def _write_done(self, s: State, r: int) -> tuple[str, State]:
        g, q = s[0], s[1][r]
        d = Draft(s)
        d.g[G.WRITER], d.g[G.WRITER_EPOCH] = -1, -1
        d.land(r, g[G.WRITER_EPOCH])
        if q[F.D_EPOCH] == g[G.D_EPOCH]:
            d.to_d = d.to_d + ((Msg.LAYER, r, q[F.SENT], q[F.TOKEN], g[G.P_EPOCH], q[F.SRC_GEN]),)
        else:
            d.req(r)[F.SENDER] = Sender.FAILED  # the header cannot go: that receiver is gone
        self._advance(d, r)
        return f"P's write of r{r} lands in block {q[F.BLOCK]}; the lock is released, the header sent", d.state()

    def _abort_prefill(self, s: State, r: int) -> tuple[str, State]:
        g, q = s[0], s[1][r]
        d = Draft(s)
        q2 = d.req(r)
        q2[F.CALL_P_ABORT] = 0
        if q[F.SENDER] not in Sender.HOLDING or q[F.SENDER] == Sender.ABORTED:
            return f"P: abort of r{r} finds nothing (not admitted yet, aborted, or freed)", d.state()
        q2[F.ALIVE] = 0
        self._resolve(d, r, Result.ERROR)
        if q[F.SENDER] == Sender.LIVE and q[F.D_EPOCH] == g[G.D_EPOCH]:
            d.to_d = d.to_d + ((Msg.ABORT, r, 0, q[F.TOKEN], g[G.P_EPOCH], 0),)
        self._end_transfer(d, r, Sender.ABORTED)
        return f"P: abort of r{r}: its sequence ends, the sender tells D", d.state()

    def _drop_pinning_peers(self, s: State, out: Out) -> None:
        """ZMQ: a peer whose socket still queues frames of ended requests is closed (2 s
        on): its queued messages are dropped, every request to it fails."""
        g, reqs = s[0], s[1]
        pinning = {q[F.D_EPOCH] for r, q in enumerate(reqs) if q[F.SENDER] in Sender.ENDED and self._pinned(s[4], g, r)}
        for epoch in sorted(pinning):
            d = Draft(s)
            pe = g[G.P_EPOCH]
            d.to_d = tuple(m for m in s[4] if m[4] != pe or m[3] // TOKEN_EPOCH != epoch)
            d.to_p = tuple(m for m in s[5] if m[2] != pe or reqs[m[1]][F.D_EPOCH] != epoch)
            for r, q in enumerate(reqs):
                if q[F.D_EPOCH] == epoch and q[F.SENDER] in Sender.HOLDING:
                    self._end_transfer(d, r, Sender.FAILED if q[F.SENDER] == Sender.LIVE else q[F.SENDER])
            stopped = g[G.D_MODE] == Mode.STOPPED or epoch != g[G.D_EPOCH]
            self._expire(s, stopped, "P closes its socket to D: frames of ended requests stayed queued", d, out)
