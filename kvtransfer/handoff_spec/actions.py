"""What every group of the model's actions shares: the configuration, the grant check and
how a deadline fires (HandoffModel in model.py mixes the groups together)."""

from __future__ import annotations

from tandem.kvtransfer.handoff_spec.state import SHM, TOKEN_EPOCH, Config, Draft, G, State

Out = list[tuple[str, State]]
"""An action's successors: (its label, the state it leads to)."""


class Actions:
    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg or Config()
        self.shm = self.cfg.path == SHM

    def _granted(self, entry: int, token: int) -> bool:
        """Whether a grant table entry (or a reservation's token) lets `token` write."""
        if self.cfg.no_epoch_check:  # BUG: the number alone, whichever pool it came from
            return entry != 0 and entry % TOKEN_EPOCH == token % TOKEN_EPOCH
        return entry == token

    @staticmethod
    def _expire(s: State, justified: bool, label: str, d: Draft, out: Out) -> None:
        """A deadline fires: freely when its peer is gone or stopped ("timeout:"), else
        only as the run's fault (the peer is merely slow)."""
        if justified:
            out.append((f"timeout: {label}", d.state()))
        elif s[0][G.FAULTS]:
            d.g[G.FAULTS] -= 1
            out.append((f"fault: {label}, early (its peer is only slow)", d.state()))
