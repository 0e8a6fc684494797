"""The decode worker's actions: its engine loop (decode_node/worker.py: `_start`, `_abort`,
`_tick` on the receiver's events, the scheduler finishing a sequence), its receiver thread
(kvtransfer/receiver.py: each message checked against the reservation and its grant, a
layer of an ended request answered with ABORT, the deadline sweep) and its revoker thread
(kvtransfer/revoker.py).

NOTE: the fence. Every way a reservation ends (done, aborted by either side, timed out)
revokes its grant: at once when no in-place write holds the slot's lock, else on the
revoker thread once the writer lets go, and only then is the end reported. The engine frees
the blocks only after the revoke: an abort that finds the revoke waiting keeps them
(ABORTING) until that event.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kvtransfer.handoff_spec.actions import Actions, Out
from tandem.kvtransfer.handoff_spec.state import Delta, Draft, Event, F, G, Mode, Msg, Phase, Sender, Seq, State

_EVENTS = {Event.DONE: "DONE", Event.FAILED: "FAILED", Event.ABORTED: "ABORTED"}


class DecodeSide(Actions):
    def _decode(self, s: State, out: Out) -> None:
        g, reqs = s[0], s[1]
        busy = g[G.D_BUSY]
        for r, q in enumerate(reqs):
            if busy < 0:  # the engine loop is free
                if q[F.CALL_START]:
                    self._start(s, r, out)
                if q[F.CALL_D_ABORT]:
                    out.append(self._abort(s, r))
                if q[F.EVENT]:
                    out.append(self._on_event(s, r))
                if q[F.SEQ] == Seq.RUNNING:
                    d = Draft(s)
                    self._free(d, r, Delta.FINISH)
                    out.append((f"D's scheduler finishes r{r} (a stop or its length) and frees its block", d.state()))
            elif busy == r:
                d = Draft(s)
                d.g[G.D_BUSY] = -1
                self._receiver_abort(d, r)
                out.append((f"D: abort of r{r}, second half: the receiver closes it, revoking its grant", d.state()))
            if q[F.REVOKE] and not self._writing(g, r):
                d = Draft(s)
                q2 = d.req(r)
                self._revoke(d, r)
                q2[F.EVENT], q2[F.REVOKE] = q[F.REVOKE], Event.NONE
                out.append((f"D's revoker: r{r}'s writer let go; the grant is revoked, "
                            f"event {_EVENTS[q[F.REVOKE]]}", d.state()))
            # The deadline: armed by a layer received, or by the first token (all_sent).
            if q[F.OPEN] and (q[F.RX] > 0 or q[F.SEQ] in (Seq.STREAMED, Seq.FINISHED_FIRST)) \
                    and not self.cfg.no_receiver_deadline:
                d = Draft(s)
                if q[F.RX] > 0:  # (the receiver knows the sender once it has sent a layer)
                    d.to_p = d.to_p + ((Msg.FAILED, r, q[F.P_EPOCH]),)
                self._report(d, r, Event.FAILED)
                sender_gone = (g[G.P_MODE] == Mode.STOPPED or q[F.P_EPOCH] != g[G.P_EPOCH]
                               or q[F.SENDER] != Sender.LIVE)
                self._expire(s, sender_gone, f"D's receiver gives up waiting for r{r}'s KV", d, out)
        if s[4]:
            self._receive(s, out)

    def _writing(self, g: Sequence[int], r: int) -> bool:
        """Whether an in-place write into r's blocks holds its slot's lock now."""
        return self.shm and g[G.WRITER] == r and g[G.WRITER_EPOCH] == g[G.D_EPOCH]

    def _revoke(self, d: Draft, r: int) -> None:
        q = d.reqs[r]
        if self.shm and d.grants[q[F.BLOCK]] == q[F.TOKEN]:
            d.grants[q[F.BLOCK]] = 0

    def _report(self, d: Draft, r: int, event: int) -> bool:
        """The receiver expects r no more (`_close`): its grant is revoked and `event`
        reported now, or both later when a write holds the lock. -> whether it was now.
        (An abort by the owner reports nothing when done now.)"""
        q = d.req(r)
        q[F.OPEN] = 0
        if self._writing(d.g, r):
            q[F.REVOKE] = event
            return False
        self._revoke(d, r)
        if event != Event.ABORTED:
            q[F.EVENT] = event
        return True

    def _receiver_abort(self, d: Draft, r: int) -> bool:
        """KVReceiver.abort: -> whether the blocks may go back now (else REVOKING: at the
        ABORTED, or earlier, event)."""
        q = d.req(r)
        if not q[F.OPEN]:
            return not q[F.REVOKE]
        if q[F.RX] > 0:
            d.to_p = d.to_p + ((Msg.ABORT, r, q[F.P_EPOCH]),)
        return self._report(d, r, Event.ABORTED)

    @staticmethod
    def _publish(d: Draft, r: int, delta: int) -> None:
        """A delta into r's stream (nobody reads it once the router has ended r)."""
        q = d.req(r)
        if q[F.PHASE] in (Phase.PREFILLING, Phase.FOLLOWING) and not q[F.DELTA]:
            q[F.DELTA] = delta

    def _free(self, d: Draft, r: int, delta: int = Delta.NONE) -> None:
        q = d.req(r)
        d.owner[q[F.HELD]] = -1
        q[F.HELD], q[F.SEQ] = -1, Seq.FREED
        if delta:
            self._publish(d, r, delta)

    def _start(self, s: State, r: int, out: Out) -> None:
        seq = s[1][r][F.SEQ]
        d, ends = Draft(s), Draft(s)
        d.req(r)[F.CALL_START] = ends.req(r)[F.CALL_START] = 0
        if seq == Seq.RESERVED:
            d.req(r)[F.SEQ] = Seq.STREAMED  # (all_sent: the receiver's deadline is armed)
            out.append((f"D streams r{r}'s first token while its KV arrives", d.state()))
            if self.cfg.first_token_may_finish:
                ends.req(r)[F.SEQ] = Seq.FINISHED_FIRST
                self._publish(ends, r, Delta.FINISH)
                out.append((f"D: r{r}'s first token ends it (its block kept until the transfer ends)", ends.state()))
        elif seq == Seq.ARRIVED:
            d.req(r)[F.SEQ] = Seq.RUNNING
            out.append((f"D: r{r}'s KV is in: it joins the running batch with its first token", d.state()))
            if self.cfg.first_token_may_finish:
                self._free(ends, r, Delta.FINISH)
                out.append((f"D: r{r}'s first token ends it: its block is freed", ends.state()))
        else:
            out.append((f"D: start of r{r} finds it gone", d.state()))

    def _abort(self, s: State, r: int) -> tuple[str, State]:
        d = Draft(s)
        q = d.req(r)
        q[F.CALL_D_ABORT] = 0
        seq = q[F.SEQ]
        if self.cfg.free_before_revoke:  # BUG: the blocks go back first, the receiver is told after
            if seq in Seq.HOLDING and seq != Seq.ABORTING:
                self._free(d, r, Delta.NONE if seq == Seq.FINISHED_FIRST else Delta.ABORT)
            if q[F.OPEN]:
                d.g[G.D_BUSY] = r
            return f"D: abort of r{r} frees its block first (its grant still stands)", d.state()
        fenced = self._receiver_abort(d, r)
        if seq not in Seq.HOLDING or seq == Seq.ABORTING:
            return f"D: abort of r{r} finds nothing left to free", d.state()
        delta = Delta.NONE if seq == Seq.FINISHED_FIRST else Delta.ABORT
        if fenced:
            self._free(d, r, delta)
            return f"D: abort of r{r}: the receiver closes it, its grant revoked; its block is freed", d.state()
        if self.cfg.free_while_revoking:  # BUG: the block goes back while the revoke waits
            self._free(d, r, delta)
            return f"D: abort of r{r}: its writer holds the lock, yet its block is freed", d.state()
        q[F.SEQ] = Seq.ABORTING
        self._publish(d, r, delta)
        return f"D: abort of r{r}: its writer holds the lock: the block stays held until the revoke", d.state()

    def _on_event(self, s: State, r: int) -> tuple[str, State]:
        d = Draft(s)
        q = d.req(r)
        event, seq = q[F.EVENT], q[F.SEQ]
        q[F.EVENT] = Event.NONE
        if seq in (Seq.ABORTING, Seq.FINISHED_FIRST):
            self._free(d, r)
        elif event == Event.DONE and seq in (Seq.STREAMED, Seq.RESERVED):
            q[F.SEQ] = Seq.RUNNING if seq == Seq.STREAMED else Seq.ARRIVED
        elif seq in (Seq.STREAMED, Seq.RESERVED):
            self._free(d, r, Delta.ERROR)
        return f"D's tick handles r{r}'s transfer event {_EVENTS[event]}", d.state()

    def _receive(self, s: State, out: Out) -> None:
        """The receiver thread takes the oldest message in flight to it."""
        g = s[0]
        kind, r, index, token, pe, _ = s[4][0]
        q = s[1][r]
        d = Draft(s)
        d.to_d = s[4][1:]
        name = f"layer {index % self.cfg.layers} (chunk {index // self.cfg.layers})" if kind == Msg.LAYER else "ABORT"
        if not q[F.OPEN] or not self._granted(token, q[F.TOKEN]):
            if kind == Msg.LAYER and not q[F.OPEN] and q[F.RX] >= 0:
                d.to_p = d.to_p + ((Msg.ABORT, r, pe),)
                out.append((f"D drops r{r}'s late {name} and tells its sender to stop", d.state()))
            else:
                out.append((f"D drops r{r}'s {name} (an unknown request, or no grant)", d.state()))
            return
        if kind == Msg.ABORT:
            self._report(d, r, Event.FAILED)
            out.append((f"D's receiver takes r{r}'s ABORT from its sender: it closes r{r}", d.state()))
            return
        if not self.shm:
            d.land(r, g[G.D_EPOCH])
        q2 = d.req(r)
        q2[F.RX] += 1
        complete = q2[F.RX] == self.cfg.messages
        if complete:
            self._report(d, r, Event.DONE)
            d.to_p = d.to_p + ((Msg.DONE, r, pe),)
        did = "checks" if self.shm else "checks and writes"
        out.append((f"D's receiver {did} r{r}'s {name}" + (f": all in, it closes r{r}, DONE" if complete else ""),
                    d.state()))
