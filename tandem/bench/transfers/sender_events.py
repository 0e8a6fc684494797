"""Waiting on one request's end from a KVSender, for callers that send one request at a time
and wait for it (the transfer benchmark, the kvtransfer tests); a worker polls instead."""

from __future__ import annotations

import time

from tandem.kvtransfer.protocol import TransferEvent
from tandem.kvtransfer.sender import KVSender


class SenderEvents:
    """A sender's events, polled on demand; those of other requests are kept for their own wait."""

    def __init__(self, sender: KVSender) -> None:
        self.sender = sender
        self._kept: dict[str, TransferEvent] = {}

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferEvent:
        """Poll until `request_id` ends (TimeoutError past `timeout_s`, default the sender's)."""
        deadline = time.monotonic() + (self.sender.timeout_s if timeout_s is None else timeout_s)
        while request_id not in self._kept:
            self._kept.update((e.request_id, e) for e in self.sender.poll())
            if request_id in self._kept:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{request_id}: not ended within the wait")
            time.sleep(0.001)
        return self._kept.pop(request_id)
