"""What an engine tells whoever watches it (a worker's metrics), as it happens."""

from __future__ import annotations

from typing import Protocol

from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence


class EngineObserver(Protocol):
    """Called on the thread that steps the engine; must be quick and must not raise."""

    def on_step(self, batch: ScheduledBatch) -> None:
        """A non-empty batch is about to run."""

    def on_first_token(self, seq: Sequence) -> None:
        """``seq`` got its first output token here (sampled, or handed over by a prefill worker)."""

    def on_finished(self, seq: Sequence) -> None:
        """``seq`` ended (stop, length or abort) and leaves the engine."""
