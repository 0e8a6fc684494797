"""Grants revoked off the receiver's threads: a revoke that must wait for a writer (one stopped
inside a write waits as long as it is stopped) waits here, on a thread of its own, and the
transfer's end is reported only once it has returned.

NOTE: until a reservation's event comes, its blocks stay out of the owner's pool: a block
handed to another request while its old grant still stands could take the old writer's rows.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from tandem.kvtransfer.fence import GrantFence
from tandem.kvtransfer.protocol import TransferEvent

logger = logging.getLogger(__name__)


class Revoker:
    """Revokes grants on its own thread; each revoke's event goes to `events` once it returns."""

    def __init__(self, fence: GrantFence, events: queue.Queue[TransferEvent]) -> None:
        self._fence = fence
        self._events = events
        self._pending: queue.Queue[tuple[Sequence[int], TransferEvent] | None] = queue.Queue()
        self._waiting: set[str] = set()
        """Requests whose revoke waits (guarded by _guard)."""
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-revoker", daemon=True)
        self._thread.start()

    def close_then_report(self, blocks: Sequence[int], event: TransferEvent) -> bool:
        """Revoke `blocks` now when no write is under way, else on the thread. -> whether it
        was done now (then `event` is the caller's to report; else it is reported here, later)."""
        if self._fence.try_revoke(blocks):
            return True
        logger.info("kv receiver: %s's grant is revoked once its writer lets go", event.request_id)
        with self._guard:
            self._waiting.add(event.request_id)
        self._pending.put((blocks, event))
        return False

    def is_revoking(self, request_id: str) -> bool:
        """Whether the request's revoke still waits (its event is yet to come)."""
        with self._guard:
            return request_id in self._waiting

    def close(self) -> None:
        """Stop the thread (a revoke still waiting on a stopped writer is left to the process's end)."""
        self._pending.put(None)
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while (item := self._pending.get()) is not None:
            blocks, event = item
            try:
                self._fence.revoke(blocks)
            except OSError:  # NOTE: the thread outlives any revoke; the blocks stay held, never reused
                logger.exception("kv receiver: revoking %s failed: its blocks stay held", event.request_id)
                continue
            self._events.put(event)  # NOTE: before it stops counting as waiting (see KVReceiver.abort)
            with self._guard:
                self._waiting.discard(event.request_id)
