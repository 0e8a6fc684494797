"""The router's precise prefix index: where each prefix block really is, from the workers'
KV events (tandem/kvcache/kv_events.py), not from what the router sent where.

Each worker's holdings are a map block hash -> the tiers holding it, moved by its event
batches in order. A batch whose number does not follow the last one applied (a batch lost,
or a worker restarted: a new epoch) leaves that worker's entry stale until a snapshot of its
holdings replaces it (`resync`); batches numbered at or below the snapshot's are then skipped.
A stale worker is scored as holding nothing: it is better to recompute than to route on a guess.

Workers whose disk tiers keep their files in one folder (one host, or a shared mount) load
each other's disk blocks: a worker is matched with the disk blocks of every worker sharing
its folder (`share_disk`), or it would find hits its index entry never promised.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.kvcache.kv_events import POOL_TIER, BlockEventKind, KVEventBatch

PLACED = "placed"
"""A block of a prompt the router placed on the worker, not yet in its events: it is being
computed (or queued to be), and will be in the pool when the next prompt arrives after it."""
PLACED_S = 30.0
"""How long a placed block counts without the worker's events mentioning it."""
DISK_TIER = "disk"
TIER_WEIGHTS = {POOL_TIER: 1.0, PLACED: 1.0, "host": 0.95, DISK_TIER: 0.8}
"""What a block held in a tier is worth to a request against recomputing it (1: free to use).
A host hit costs a copy over the host link (about 30 us a block at PCIe 4's 25 GB/s); a disk
hit a file read per block (about 0.2 ms for the default model's 720 KiB block,
from the page cache), recomputing its 16 tokens a few ms on the CPU."""


@dataclass
class WorkerHoldings:
    epoch: str | None = None
    seq: int = 0
    """The last batch applied (or the snapshot's)."""
    blocks: dict[bytes, set[str]] = field(default_factory=dict)
    stale: bool = True
    """Waiting for a snapshot: batches were lost, or none came yet."""
    updated_at: float = 0.0
    placed: dict[bytes, float] = field(default_factory=dict)
    """Blocks of prompts the router placed on the worker that its events have not mentioned
    yet, and when: the worker will compute them (PLACED_S bounds a prompt that never runs)."""


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a request's prefix one worker holds, block by block from the start."""

    num_blocks: int
    """Leading blocks held in any tier."""
    tiers: tuple[str, ...]
    """The best tier holding each of those blocks."""

    @property
    def score(self) -> float:
        return sum(TIER_WEIGHTS.get(t, 0.5) for t in self.tiers)


class KVBlockIndex:
    """Every worker's holdings. Not thread-safe: one thread (the router's loop) applies and reads."""

    def __init__(self, clock=time.monotonic) -> None:
        self._workers: dict[str, WorkerHoldings] = {}
        self._clock = clock
        self._disk_shares: dict[str, str] = {}
        """Worker -> the id of its disk tier's folder (DiskTier.share_id)."""
        self.num_resyncs = 0
        self.num_gaps = 0

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one batch. -> False when the worker needs a snapshot (a gap or a new epoch)."""
        w = self._workers.setdefault(batch.worker, WorkerHoldings())
        if batch.epoch == w.epoch and batch.seq <= w.seq:
            return not w.stale  # (already in a snapshot)
        if w.stale or batch.epoch != w.epoch or batch.seq != w.seq + 1:
            if not w.stale:
                self.num_gaps += 1
            w.stale = True
            return False
        for e in batch.events:
            w.placed.pop(e.block_hash, None)  # the events speak for it from now on
            tiers = w.blocks.setdefault(e.block_hash, set())
            if e.kind is BlockEventKind.STORED:
                tiers.add(e.tier)
            else:
                tiers.discard(e.tier)
                if not tiers:
                    del w.blocks[e.block_hash]
        w.seq = batch.seq
        w.updated_at = self._clock()
        return True

    def resync(self, worker: str, epoch: str, seq: int, holdings: dict[bytes, Iterable[str]]) -> None:
        """Replace ``worker``'s entry with its snapshot, taken after its batch ``seq`` was cut."""
        blocks = {h: set(t) for h, t in holdings.items() if t}
        old = self._workers.get(worker)
        placed = {} if old is None else {h: t for h, t in old.placed.items() if h not in blocks}
        self._workers[worker] = WorkerHoldings(epoch, seq, blocks, stale=False, updated_at=self._clock(),
                                               placed=placed)
        self.num_resyncs += 1

    def note_placed(self, worker: str, block_hashes: list[bytes]) -> None:
        """The router sent ``worker`` a prompt with these full blocks: until its events say
        otherwise, :meth:`match` counts them (events lag the placement by the prompt's queue
        and prefill time, and the next prompt sharing them may come within it)."""
        w = self._workers.setdefault(worker, WorkerHoldings())
        now = self._clock()
        for h in block_hashes:
            if h not in w.blocks:
                w.placed[h] = now
        if len(w.placed) > len(block_hashes):  # drop what outlived PLACED_S, now and then
            w.placed = {h: t for h, t in w.placed.items() if now - t < PLACED_S}

    def entries(self) -> list[tuple[str, WorkerHoldings]]:
        """Every worker's entry (a copy of the table: any thread may read it)."""
        return list(self._workers.items())

    def share_disk(self, worker: str, share_id: str | None) -> None:
        """``worker``'s disk tier keeps its files in the folder ``share_id`` names (None: no disk)."""
        if share_id is None:
            self._disk_shares.pop(worker, None)
        else:
            self._disk_shares[worker] = share_id

    def forget(self, worker: str) -> None:
        self._workers.pop(worker, None)
        self._disk_shares.pop(worker, None)

    def is_stale(self, worker: str) -> bool:
        w = self._workers.get(worker)
        return w is None or w.stale

    def match(self, worker: str, block_hashes: list[bytes]) -> PrefixMatch:
        """The leading blocks of ``block_hashes`` (a prompt's chained hashes) ``worker`` holds."""
        w = self._workers.get(worker)
        if w is None or w.stale:
            return PrefixMatch(0, ())
        tiers = []
        now = self._clock()
        sharing = self._sharing_disk(worker)
        for h in block_hashes:
            held = w.blocks.get(h)
            if held:
                tiers.append(max(held, key=lambda t: TIER_WEIGHTS.get(t, 0.5)))
            elif now - w.placed.get(h, -PLACED_S) < PLACED_S:
                tiers.append(PLACED)
            elif any(DISK_TIER in peer.blocks.get(h, ()) for peer in sharing):
                tiers.append(DISK_TIER)
            else:
                break
        return PrefixMatch(len(tiers), tuple(tiers))

    def _sharing_disk(self, worker: str) -> list[WorkerHoldings]:
        """The entries (not stale) of the other workers whose disk folder is ``worker``'s."""
        share_id = self._disk_shares.get(worker)
        if share_id is None:
            return []
        return [w for name, w in self._workers.items()
                if name != worker and not w.stale and self._disk_shares.get(name) == share_id]

    def num_leading_in(self, worker: str, block_hashes: list[bytes], tiers: frozenset[str]) -> int:
        """How many of ``block_hashes``, from the first, ``worker``'s events say one of ``tiers``
        holds (0 while its entry is stale)."""
        w = self._workers.get(worker)
        if w is None or w.stale:
            return 0
        return next((i for i, h in enumerate(block_hashes) if not tiers & w.blocks.get(h, set())), len(block_hashes))

    def staleness_s(self, worker: str) -> float | None:
        """Seconds since ``worker``'s entry last moved (None: never)."""
        w = self._workers.get(worker)
        return None if w is None or not w.updated_at else self._clock() - w.updated_at
