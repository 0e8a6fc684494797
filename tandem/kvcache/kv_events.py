"""A worker's KV block events: which prefix blocks it holds, and where.

The block manager (and its tiers) record a block stored or removed as it happens; the worker
cuts them into numbered batches between steps and publishes them, so that the router's index
(router/kv_index.py) knows where each prefix really lives instead of guessing from what it
sent where. Batches are numbered from 1 per worker life: a number skipped is a batch lost, and
the index then asks the worker for a snapshot (resync). The wire form is JSON: never a pickle.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from enum import Enum


class BlockEventKind(str, Enum):
    STORED = "stored"
    """The block can now be loaded from the tier named."""
    REMOVED = "removed"
    """The block is gone from the tier named (evicted, dropped, or found corrupt)."""


POOL_TIER = "pool"
"""The worker's KV pool itself (a hit there costs nothing to load)."""


@dataclass(frozen=True)
class BlockEvent:
    kind: BlockEventKind
    block_hash: bytes
    tier: str
    """POOL_TIER, or a tier's name ("disk")."""


@dataclass(frozen=True)
class KVEventBatch:
    """The events one worker recorded between two cuts. Crosses the process boundary as JSON."""

    worker: str
    """The worker's instance name."""
    epoch: str
    """Changes when the worker's process restarts: its numbering starts over, its blocks are gone."""
    seq: int
    """1, 2, 3, ... within one epoch."""
    events: tuple[BlockEvent, ...]

    def encode(self) -> bytes:
        return json.dumps({"worker": self.worker, "epoch": self.epoch, "seq": self.seq,
                           "events": [[e.kind.value, e.block_hash.hex(), e.tier] for e in self.events]}).encode()

    @classmethod
    def decode(cls, data: bytes) -> KVEventBatch:
        """-> the batch; ValueError when ``data`` is not one (a peer's bytes are checked, never trusted)."""
        try:
            body = json.loads(data)
            events = tuple(BlockEvent(BlockEventKind(kind), bytes.fromhex(block_hash), str(tier))
                           for kind, block_hash, tier in body["events"])
            batch = cls(str(body["worker"]), str(body["epoch"]), int(body["seq"]), events)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a KV event batch: {e}") from None
        if batch.seq < 1:
            raise ValueError(f"not a KV event batch: seq {batch.seq}")
        return batch


class KVEventLog:
    """Where a worker's block events gather until the next cut. Thread-safe: a tier's writer
    thread records too."""

    def __init__(self, worker: str, epoch: str) -> None:
        self.worker = worker
        self.epoch = epoch
        self._events: list[BlockEvent] = []
        self._seq = 0
        self._lock = threading.Lock()

    def record(self, kind: BlockEventKind, block_hash: bytes, tier: str) -> None:
        with self._lock:
            self._events.append(BlockEvent(kind, block_hash, tier))

    def cut(self) -> KVEventBatch | None:
        """The events recorded since the last cut as the next batch (None: none)."""
        with self._lock:
            if not self._events:
                return None
            self._seq += 1
            events, self._events = tuple(self._events), []
            return KVEventBatch(self.worker, self.epoch, self._seq, events)

    @property
    def last_seq(self) -> int:
        """The number of the last batch cut (0: none yet): a snapshot taken now follows it."""
        with self._lock:
            return self._seq
