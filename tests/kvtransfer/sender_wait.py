"""`wait(sender, request_id)`: block until one request's transfer ends, keeping the events of
the sender's other requests for their own waits (one SenderEvents per sender)."""

from __future__ import annotations

import weakref

from tandem.bench.transfers.sender_events import SenderEvents
from tandem.kvtransfer.protocol import TransferEvent
from tandem.kvtransfer.sender import KVSender

_EVENTS: weakref.WeakKeyDictionary[KVSender, SenderEvents] = weakref.WeakKeyDictionary()


def wait(sender: KVSender, request_id: str, timeout_s: float | None = None) -> TransferEvent:
    events = _EVENTS.get(sender)
    if events is None:
        events = _EVENTS[sender] = SenderEvents(sender)
    return events.wait(request_id, timeout_s)
