"""Which worker gets a request: round_robin, least_loaded, prefix_aware or precise_prefix."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from tandem.kvcache.block_hash import prefix_hashes
from tandem.router.kv_index import KVBlockIndex
from tandem.router.prefix_index import PrefixIndex
from tandem.worker.api import WorkerLoad

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "precise_prefix")
PREFIX_POLICIES = ("prefix_aware", "precise_prefix")
"""The policies that predict each worker's prefix-cache hits (Router.num_cached_tokens)."""
RETRY_BASE_S, RETRY_MAX_S = 1.0, 30.0
"""A worker that went down is routed to again this long after, once it answers: doubled for
each further failure within STABLE_S of its last recovery, up to RETRY_MAX_S (a flapping
worker gets ever less traffic; a transient fault costs about a second)."""
STABLE_S = 60.0


@dataclass(eq=False)
class Sent:
    """One placement of the router's that the worker's reported load may not show yet."""

    num_blocks: int
    seen_after_poll: int | None = None
    """Polls started before the worker took it (None: not taken yet): a poll numbered higher
    sees it."""


@dataclass
class WorkerState:
    """The router's view of one worker."""

    instance: str
    handle: Any
    """The worker's Ray actor handle."""
    load: WorkerLoad | None = None
    """Its last reported load."""
    num_in_flight: int = 0
    """Prompts the router sent it to prefill that have not finished prefill yet."""
    num_in_flight_tokens: int = 0
    """Their tokens (uncached ones for a local prefill on a decode worker)."""
    unreported: list[Sent] = field(default_factory=list)
    """Requests the router placed on it that its last polled load may not show yet."""
    num_polls_started: int = 0
    healthy: bool = True
    """Whether it serves (dead and hung workers do not)."""
    draining: bool = False
    """Being drained (router/pool_changes.py): routed nothing new, never again."""
    placement_group: Any = None
    """A tensor-parallel worker's Ray placement group (removed with the worker)."""
    num_failures: int = 0
    """Times it went down, each within STABLE_S of its last recovery."""
    retry_at: float = 0.0
    """When (event-loop seconds) a worker that went down may be routed to again."""
    up_since: float = 0.0
    last_answer: float = 0.0
    """When it last answered a load poll (event-loop seconds)."""

    @property
    def routable(self) -> bool:
        """Whether new requests may go to it."""
        return self.healthy and not self.draining

    def mark_down(self, now: float) -> bool:
        """Route nothing more to it until may_recover -> whether it was up until now."""
        if not self.healthy:
            return False
        self.num_failures = self.num_failures + 1 if now - self.up_since < STABLE_S else 1
        self.retry_at = now + min(RETRY_BASE_S * 2 ** (self.num_failures - 1), RETRY_MAX_S)
        self.healthy = False
        self.load = None
        return True

    def may_recover(self, now: float) -> bool:
        """Down, and its backoff is over (ask only when it has just answered)."""
        return not self.healthy and now >= self.retry_at

    def recover(self, now: float) -> None:
        self.healthy = True
        self.up_since = now

    def pressure(self) -> tuple[int, int, int]:
        """Smaller is less loaded: queued prompt tokens, then fewer sequences, then more free
        blocks; each as last reported plus what the router has placed since (a burst, placed
        before any poll shows its first request, spreads instead of piling on one worker)."""
        load = self.load
        queued = self.num_in_flight_tokens + (load.num_queued_tokens if load else 0)
        num_seqs = len(self.unreported) + (load.num_running + load.num_waiting if load else 0)
        free = (load.num_free_blocks if load else 0) - sum(s.num_blocks for s in self.unreported)
        return queued, num_seqs, -free

    def decode_pressure(self) -> tuple[int, int, int]:
        """A decode worker's order: fewer sequences first (each decode step's cost grows with
        its batch, and a remote prefill's request adds a sequence but no prompt tokens here),
        then queued prompt tokens (its local prefills), then more free blocks."""
        queued, num_seqs, free = self.pressure()
        return num_seqs, queued, free

    def place(self, num_blocks: int) -> Sent:
        """The router is placing a request holding about ``num_blocks`` here: count it until a
        load polled after it took effect shows it (``placed``, then ``load_reported``)."""
        sent = Sent(num_blocks)
        self.unreported.append(sent)
        return sent

    def placed(self, sent: Sent, took: bool) -> None:
        """The worker has taken (``took``) or refused the placement ``sent``."""
        if not took:
            self.unreported.remove(sent)
        else:
            sent.seen_after_poll = self.num_polls_started

    def begin_poll(self) -> int:
        """A load poll starts -> its number, for ``load_reported``."""
        self.num_polls_started += 1
        return self.num_polls_started

    def load_reported(self, load: WorkerLoad, poll: int) -> None:
        """The load that poll number ``poll`` found: placements taken before it began are in it."""
        self.load = load
        self.unreported = [s for s in self.unreported if s.seen_after_poll is None or s.seen_after_poll >= poll]


@dataclass
class Router:
    """Orders a pool's workers for a request.

    prefix_aware: the worker with the fewest queued prompt tokens minus the prompt tokens it
    probably holds already (PrefixIndex) comes first, ties by least_loaded's order. So a
    prefix owner wins while its extra queue is shorter than the prefix it saves recomputing
    (prefill) or transferring (decode); a crowded owner is passed over, and one without
    room answers PoolFull and the next is tried.
    """

    policy: str
    for_decode: bool = False
    """Order decode workers (by WorkerState.decode_pressure), else prefill or colocated ones."""
    kv_index: KVBlockIndex | None = None
    """precise_prefix's: where the workers' KV events say each block is (router/kv_index.py)."""
    _turn: itertools.count = field(default_factory=itertools.count)
    _index: PrefixIndex = field(default_factory=PrefixIndex)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if (self.policy == "precise_prefix") != (self.kv_index is not None):
            raise ValueError("precise_prefix routes by a KV index, and only it")

    def order(self, workers: list[WorkerState], prompt_token_ids: list[int],
              cache_salt: str | None = None) -> list[WorkerState]:
        """Routable workers, the policy's choice first (the rest as fallbacks)."""
        healthy = [w for w in workers if w.routable]
        if not healthy:
            return []
        if self.policy == "round_robin":
            k = next(self._turn) % len(healthy)
            return healthy[k:] + healthy[:k]
        by_load = sorted(healthy, key=WorkerState.decode_pressure if self.for_decode else WorkerState.pressure)
        if self.policy == "least_loaded":
            return by_load
        # prefix_aware, precise_prefix: queued tokens less those the worker need not compute
        return sorted(by_load, key=lambda w: w.pressure()[0] - self.num_cached_tokens(w, prompt_token_ids, cache_salt))

    def num_cached_tokens(self, worker: WorkerState, prompt_token_ids: list[int], cache_salt: str | None = None,
                          weighted: bool = True) -> int:
        """Prompt tokens `worker` holds already under `cache_salt`: as its KV events say
        (precise_prefix), each weighed by its tier's worth, or with ``weighted=False`` each held
        block whole (the hit the worker will report: it loads a disk block back as a hit); or as
        the router remembers (prefix_aware)."""
        if self.kv_index is None:
            return self._index.num_cached_tokens(worker.instance, worker.load, prompt_token_ids, cache_salt)
        if worker.load is None:
            return 0
        bs = worker.load.block_size  # never the last token: the worker always computes one
        match = self.kv_index.match(worker.instance, prefix_hashes(prompt_token_ids, bs,
                                                                  (len(prompt_token_ids) - 1) // bs, cache_salt))
        return int(match.score * bs) if weighted else match.num_blocks * bs

    def record(self, worker: WorkerState, prompt_token_ids: list[int], cache_salt: str | None = None) -> None:
        """Remember that `worker` now holds this prompt's prefix (under `cache_salt`)."""
        if self.policy == "prefix_aware":
            self._index.record(worker.instance, worker.load, prompt_token_ids, cache_salt)
        elif self.kv_index is not None and worker.load is not None:
            self.kv_index.note_placed(worker.instance, prefix_hashes(prompt_token_ids, worker.load.block_size,
                                                                     cache_salt=cache_salt))
