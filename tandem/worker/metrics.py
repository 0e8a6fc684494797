"""A worker's Prometheus metrics (docs/metrics.md): its own registry, fed by its engine's
events and read from its engine's state when rendered.

NOTE: everything here runs on the worker's engine loop thread (the observer calls, and
`render`, which the worker submits to that loop), so the engine is read between steps.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.engine import LLMEngine
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kvcache.prefix_tier import TierCounters, tiers_of
from tandem.kvtransfer.connectors.registry import path_labels
from tandem.kvtransfer.tier_fetch import PeerFetchCounters
from tandem.worker.api import Role
from tandem.worker.metric_buckets import REQUEST_SECONDS

LABELS = ("model_name", "role", "instance")
TRANSFER_PATHS = path_labels()
"""KV data paths (KVSender.begin), one label per registered connector: torch.distributed
pairs ("dist"), in place by CUDA IPC or in a same-node shared pool, ZMQ frames."""


# (what a reason says, its label), first match wins; anything else is "error".
_FAILURE_KINDS = (("timed out", "timeout"), ("abort", "aborted"), ("refused", "refused"),
                  ("not accepting", "unreachable"), ("checksum", "checksum"))


def failure_kind(reason: str) -> str:
    """A transfer failure's free-text reason -> a label value from a small fixed set."""
    reason = reason.lower()
    return next((kind for words, kind in _FAILURE_KINDS if words in reason), "error")


class WorkerMetrics:
    """Implements EngineObserver for its worker's engine."""

    def __init__(self, role: Role, instance: str, model_name: str) -> None:
        self.label_values = (model_name, role.value, instance)
        self.registry = CollectorRegistry()
        self.queue_time = self._histogram(
            "tandem_request_queue_time_seconds",
            "Prefill, colocated: arrival to first scheduled. Decode: reservation to the start of decoding.")
        # Only the spans this role has: a decode worker runs no prefill, a prefill worker no decode.
        self.prefill_time = None if role is Role.DECODE else self._histogram(
            "tandem_request_prefill_time_seconds", "First scheduled to first token.")
        self.decode_time = None if role is Role.PREFILL else self._histogram(
            "tandem_request_decode_time_seconds", "First token to finish.")
        self.kv_transfer_time = None if role is Role.COLOCATED else self._histogram(
            "tandem_kv_transfer_time_seconds",
            "Per request. Prefill: transfer start to the receiver's acknowledgement; "
            "decode: reservation to the last layer.")
        self._transfer_failures = Counter("tandem_kv_transfer_failures", "KV transfers that did not complete.",
                                          (*LABELS, "reason"), registry=self.registry)
        if role is not Role.COLOCATED:  # every series from the start at 0
            for kind in (*(kind for _, kind in _FAILURE_KINDS), "error"):
                self._transfer_failures.labels(*self.label_values, kind)
        self._transfer_paths: Counter | None = None
        if role is Role.PREFILL:  # the sender picks the path
            self._transfer_paths = Counter("tandem_kv_transfer_paths", "KV transfers begun, by data path.",
                                           (*LABELS, "path"), registry=self.registry)
            for path in TRANSFER_PATHS:
                self._transfer_paths.labels(*self.label_values, path)
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_generated_tokens = 0
        """Tokens sampled since start (one per sampling target and step; accepted drafts aside)."""
        self.last_batch_size = 0
        self.last_batch_tokens = 0
        self.num_transferring: Callable[[], int] = lambda: 0
        """Requests whose KV is in flight now (set by the worker that transfers)."""
        self.kv_bytes: dict[str, Callable[[], int]] = {}
        self.peer_fetch: PeerFetchCounters | None = None
        """The worker's fetches from other workers' KV tiers (None: it has no disk tier)."""
        """Cumulative KV payload bytes by direction ("sent", "received")."""
        self.kv_dropped: Callable[[], dict[str, int]] = dict
        """KV messages a receiver dropped, by reason (a decode worker's: no grant, malformed, ...)."""

    def _histogram(self, name: str, documentation: str):
        return Histogram(name, documentation, LABELS, registry=self.registry,
                         buckets=REQUEST_SECONDS).labels(*self.label_values)

    # -- EngineObserver ---------------------------------------------------------------
    def on_step(self, batch: ScheduledBatch) -> None:
        self.last_batch_size = len(batch.seqs)
        self.last_batch_tokens = batch.num_tokens
        self.num_generated_tokens += sum(len(batch.sample_targets(i)) for i in range(len(batch.seqs)))

    def on_first_token(self, seq: Sequence) -> None:
        assert seq.first_token_time is not None
        # On a decode worker the hits are prompt tokens whose KV was not transferred.
        self.num_prefix_queries += seq.num_prompt_tokens
        self.num_prefix_hits += seq.num_cached_prompt_tokens
        if self.prefill_time is None:  # a decode worker: the prompt was prefilled elsewhere
            self.queue_time.observe(seq.first_token_time - seq.arrival_time)
            return
        assert seq.first_scheduled_time is not None
        self.queue_time.observe(seq.first_scheduled_time - seq.arrival_time)
        self.prefill_time.observe(seq.first_token_time - seq.first_scheduled_time)

    def on_finished(self, seq: Sequence) -> None:
        if self.decode_time is not None and seq.first_token_time is not None:
            self.decode_time.observe(time.monotonic() - seq.first_token_time)

    # -- transfers ----------------------------------------------------------------------
    def transfer_began(self, path: str) -> None:
        """A prefill worker began sending a request's KV by `path` (one of TRANSFER_PATHS)."""
        assert self._transfer_paths is not None, "only a prefill worker sends KV"
        self._transfer_paths.labels(*self.label_values, path).inc()

    def transfer_ended(self, started: float, failure: str | None) -> None:
        """A request's KV transfer ended: well (failure None, its time observed) or not."""
        assert self.kv_transfer_time is not None, "a colocated worker transfers no KV"
        if failure is None:
            self.kv_transfer_time.observe(time.monotonic() - started)
        else:
            self._transfer_failures.labels(*self.label_values, failure_kind(failure)).inc()

    def render(self, engine: LLMEngine) -> str:
        """The Prometheus text exposition of everything above and of ``engine``'s state now
        (call between its steps)."""
        state = CollectorRegistry()
        state.register(_EngineCollector(self, engine))
        return (generate_latest(self.registry) + generate_latest(state)).decode()


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's state at render time."""

    def __init__(self, metrics: WorkerMetrics, engine: LLMEngine) -> None:
        self.metrics = metrics
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        m, engine = self.metrics, self.engine
        load, counters = engine.load(), engine.counters()

        def family(kind, name: str, documentation: str, value: float, **extra: str) -> Metric:
            f = kind(name, documentation, labels=(*LABELS, *extra))
            f.add_metric((*m.label_values, *extra.values()), value)
            return f

        yield family(GaugeMetricFamily, "tandem_num_requests_running", "Sequences in the running batch.",
                     load.num_running)
        yield family(GaugeMetricFamily, "tandem_num_requests_waiting",
                     "Sequences waiting to be scheduled, or (decode) for their KV and first token.",
                     load.num_requests - load.num_running)
        yield family(GaugeMetricFamily, "tandem_num_requests_transferring", "Requests whose KV is in flight.",
                     m.num_transferring())
        yield family(GaugeMetricFamily, "tandem_kv_cache_usage_perc", "Used KV blocks / all blocks (0 to 1).",
                     load.num_used_blocks / load.num_blocks)
        yield family(GaugeMetricFamily, "tandem_kv_cache_used_blocks", "KV blocks held by requests.",
                     load.num_used_blocks)
        yield family(GaugeMetricFamily, "tandem_kv_cache_capacity_blocks", "KV blocks in the pool.", load.num_blocks)
        yield family(CounterMetricFamily, "tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     m.num_prefix_queries)
        yield family(CounterMetricFamily, "tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     m.num_prefix_hits)
        yield family(GaugeMetricFamily, "tandem_prefix_cache_hit_rate", "Prefix cache hits / queries since start.",
                     m.num_prefix_hits / m.num_prefix_queries if m.num_prefix_queries else 0.0)
        yield family(GaugeMetricFamily, "tandem_batch_size", "Sequences in the last engine step.", m.last_batch_size)
        yield family(GaugeMetricFamily, "tandem_batch_tokens", "Tokens in the last engine step.", m.last_batch_tokens)
        yield family(CounterMetricFamily, "tandem_num_preemptions", "Sequences preempted.", counters.num_preemptions)
        yield family(CounterMetricFamily, "tandem_spec_decode_num_draft_tokens",
                     "Draft tokens verified by speculative decoding.", counters.num_draft_tokens)
        yield family(CounterMetricFamily, "tandem_spec_decode_num_accepted_tokens",
                     "Draft tokens accepted by speculative decoding.", counters.num_accepted_draft_tokens)
        yield family(CounterMetricFamily, "tandem_num_swapped_out_blocks", "KV blocks swapped out to host memory.",
                     counters.num_swapped_out_blocks)
        bytes_total = CounterMetricFamily("tandem_kv_transfer_bytes", "KV payload bytes moved.",
                                          labels=(*LABELS, "direction"))
        for direction, read in m.kv_bytes.items():
            bytes_total.add_metric((*m.label_values, direction), read())
        yield bytes_total
        dropped = CounterMetricFamily("tandem_kv_messages_dropped", "KV transfer messages a receiver dropped.",
                                      labels=(*LABELS, "reason"))
        for reason, n in m.kv_dropped().items():
            dropped.add_metric((*m.label_values, reason), n)
        yield dropped
        for tier in tiers_of(engine.block_manager.tier):
            yield from _tier_families(m, tier.name, tier.counters, engine.config.block_size)
        if engine.block_manager.tier is not None:
            charged = CounterMetricFamily("tandem_kv_tier_load_budget_tokens", "Step budget tokens the scheduler "
                                          "charged for prefix blocks loaded from the KV tiers.", labels=LABELS)
            charged.add_metric(m.label_values, engine.scheduler.prefill_packer.load_cost.num_charged_tokens)
            yield charged
        if m.peer_fetch is not None:
            yield from _peer_fetch_families(m, m.peer_fetch)


def _tier_families(m: WorkerMetrics, name: str, c: TierCounters, block_size: int) -> Iterator[Metric]:
    """One KV tier's counters (kvcache/prefix_tier.py), labelled tier=name."""
    labels = (*LABELS, "tier")
    values = (*m.label_values, name)
    hits = CounterMetricFamily("tandem_kv_tier_hit_tokens", "Prompt tokens loaded from a KV tier instead of "
                               "recomputed.", labels=labels)
    hits.add_metric(values, c.num_loaded_blocks * block_size)
    yield hits
    moved = CounterMetricFamily("tandem_kv_tier_bytes", "KV bytes offloaded to a tier and loaded back.",
                                labels=(*labels, "direction"))
    moved.add_metric((*values, "offload"), c.num_offloaded_bytes)
    moved.add_metric((*values, "load"), c.num_loaded_bytes)
    yield moved
    seconds = CounterMetricFamily("tandem_kv_tier_seconds", "Time spent offloading (a writer thread's, off the "
                                  "step) and loading (inside the step's admission).", labels=(*labels, "direction"))
    seconds.add_metric((*values, "offload"), c.offload_seconds)
    seconds.add_metric((*values, "load"), c.load_seconds)
    yield seconds
    lost = CounterMetricFamily("tandem_kv_tier_blocks_lost", "Tier blocks dropped: failing their checksum "
                               "(recomputed) or over the tier's capacity.", labels=(*labels, "reason"))
    lost.add_metric((*values, "corrupt"), c.num_corrupt_blocks)
    lost.add_metric((*values, "capacity"), c.num_dropped_blocks)
    yield lost


def _peer_fetch_families(m: WorkerMetrics, c: PeerFetchCounters) -> Iterator[Metric]:
    """The worker's fetches of prefix blocks from other workers' tiers (kvtransfer/tier_peer.py)."""
    blocks = CounterMetricFamily("tandem_kv_peer_fetch_blocks", "Prefix blocks fetched from other workers' KV "
                                 "tiers instead of computed.", labels=LABELS)
    blocks.add_metric(m.label_values, c.num_blocks)
    yield blocks
    seconds = CounterMetricFamily("tandem_kv_peer_fetch_seconds", "Time fetches from other workers' KV tiers "
                                  "took (before their requests' admission, off the step).", labels=LABELS)
    seconds.add_metric(m.label_values, c.seconds)
    yield seconds
    fetches = CounterMetricFamily("tandem_kv_peer_fetches", "Fetches from other workers' KV tiers: every block "
                                  "the peer held, or stopped short (a peer gone, refused or failing a check).",
                                  labels=(*LABELS, "outcome"))
    fetches.add_metric((*m.label_values, "complete"), c.num_fetches - c.num_failed)
    fetches.add_metric((*m.label_values, "short"), c.num_failed)
    yield fetches
