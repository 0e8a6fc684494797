"""The router's own Prometheus metrics (docs/metrics.md): what clients see of each request.

One registry per router (no module-global state), which `serve_metrics` exposes together
with the workers' metrics (`WorkerMetricsCollector`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.router.autoscale import SloWindow
from tandem.router.disagg import DECISION_REASONS
from tandem.router.policy import PREFIX_POLICIES
from tandem.router.prefix_prediction import PREDICTED_ROLES
from tandem.worker.api import Role
from tandem.worker.metric_buckets import REQUEST_SECONDS, TOKEN_LATENCY_SECONDS, TTFT_SECONDS, token_count_buckets

# Refusals before any worker ran the request, by status: tandem_request_rejected_total's reasons.
REJECTION_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
}

# The codes a Generate call can end with (the series start at 0).
STATUS_CODES = (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.INTERNAL, *REJECTION_REASONS)

POOLS = tuple(role.value for role in Role)

class RouterMetrics:
    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None,
                 num_waiting: Callable[[], int] = lambda: 0) -> None:
        """num_waiting: requests in the backend's admission queue now."""
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.num_running = 0
        self.num_waiting = num_waiting
        self.slo_window: SloWindow | None = None
        """Where finished requests' TTFT and TPOT go for the autoscaler (None: no autoscaler)."""
        labels = ("model_name",)

        def histogram(name: str, documentation: str, buckets):
            return Histogram(name, documentation, labels, registry=self.registry, buckets=buckets).labels(model_name)

        def counter(name: str, documentation: str, *extra: str):
            c = Counter(name, documentation, (*labels, *extra), registry=self.registry)
            return c.labels(model_name) if not extra else c

        self.ttft = histogram("tandem_time_to_first_token_seconds", "Arrival at the router to the first token sent.",
                              TTFT_SECONDS)
        self.itl = histogram("tandem_inter_token_latency_seconds", "Gap between consecutive streamed responses.",
                             TOKEN_LATENCY_SECONDS)
        self.tpot = histogram("tandem_request_time_per_output_token_seconds",
                              "Per request: (e2e - TTFT) / (output tokens - 1).", TOKEN_LATENCY_SECONDS)
        self.e2e = histogram("tandem_e2e_request_latency_seconds", "Arrival to the last response.", REQUEST_SECONDS)
        self.queue_time = histogram("tandem_router_queue_time_seconds",
                                    "Time in the router's admission queue (waiting for KV room).", REQUEST_SECONDS)
        tokens = token_count_buckets(max_model_len)
        self.prompt_tokens = histogram("tandem_request_prompt_tokens", "Prompt tokens of finished requests.", tokens)
        self.generation_tokens = histogram("tandem_request_generation_tokens", "Output tokens of finished requests.",
                                           tokens)
        self.prompt_tokens_total = counter("tandem_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens_total = counter("tandem_generation_tokens", "Tokens streamed to clients.")
        self._success = counter("tandem_request_success", "Finished requests by finish reason.", "finished_reason")
        self._status = counter("tandem_request_status", "Generate calls by gRPC status code.", "code")
        self._rejected = counter("tandem_request_rejected", "Requests refused before any worker ran them.", "reason")
        self.reruns = counter("tandem_request_reruns", "Buffered requests run again after a worker failed them.")
        self.migration_seconds = histogram(
            "tandem_request_migration_seconds", "Streams moved to another worker after theirs failed, dead, hung or "
            "drained (one per completion moved): the failure seen to the first token from the new worker.",
            REQUEST_SECONDS)
        self.prefill_decisions = counter("tandem_prefill_decisions", "Where each prompt was prefilled "
                                         "(remote: the prefill pool; local: its decode worker), and why.",
                                         "where", "reason")
        self.pool_changes = counter("tandem_pool_changes", "Workers added to a pool or drained out of it (tandem "
                                    "scale, drain and restart, the autoscaler, a node's preStop hook).", "pool",
                                    "change")
        self._prefix_predicted = counter(
            "tandem_router_prefix_predicted_tokens", "Prompt tokens a prefix-aware policy predicted the worker it "
            "chose holds in its prefix cache (requests whose worker reported its hits).", "policy", "role")
        self._prefix_reported = counter("tandem_router_prefix_reported_tokens", "Prompt tokens the workers reported "
                                        "finding in their prefix caches, for the same requests.", "policy", "role")
        self._prefix_error = counter("tandem_router_prefix_prediction_error_tokens", "Sum over the same requests of "
                                     "|predicted - reported| prompt tokens.", "policy", "role")
        self.registry.register(_RouterGauges(self))
        # Every series from the start at 0, so that rate() and dashboards see them before the first event.
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        for code in STATUS_CODES:
            self._status.labels(model_name, code.name)
        for reason in REJECTION_REASONS.values():
            self._rejected.labels(model_name, reason)
        for where, reason in DECISION_REASONS:
            self.prefill_decisions.labels(model_name, where.value, reason)
        for pool in POOLS:
            for change in ("added", "drained"):
                self.pool_changes.labels(model_name, pool, change)
        for policy in PREFIX_POLICIES:
            for role in PREDICTED_ROLES:
                for c in (self._prefix_predicted, self._prefix_reported, self._prefix_error):
                    c.labels(model_name, policy, role.value)

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)

    def ended(self, code: grpc.StatusCode, rejected: bool) -> None:
        """A Generate call ended with `code`; `rejected`: before any worker ran it."""
        self._status.labels(self.model_name, code.name).inc()
        if rejected and code in REJECTION_REASONS:
            self._rejected.labels(self.model_name, REJECTION_REASONS[code]).inc()

    def prefix_prediction(self, policy: str, role: str, num_predicted_tokens: int, num_reported_tokens: int) -> None:
        """One request's prefix hit: ``num_predicted_tokens`` as ``policy`` predicted it on a
        ``role`` worker, ``num_reported_tokens`` as that worker then found it."""
        self._prefix_predicted.labels(self.model_name, policy, role).inc(num_predicted_tokens)
        self._prefix_reported.labels(self.model_name, policy, role).inc(num_reported_tokens)
        self._prefix_error.labels(self.model_name, policy, role).inc(abs(num_predicted_tokens - num_reported_tokens))

    def finished(self, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_output_tokens)
        self.prompt_tokens_total.inc(num_prompt_tokens)


@dataclass
class RequestTimer:
    """One request's clock at the router: feeds TTFT, inter-token latency, TPOT and e2e."""

    metrics: RouterMetrics
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None

    def tokens_sent(self, num_tokens: int) -> None:
        """A response with `num_tokens` new tokens went to the client."""
        if num_tokens == 0:
            return
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            assert self.last_token is not None  # set with first_token
            self.metrics.itl.observe(now - self.last_token)
        self.last_token = now
        self.metrics.generation_tokens_total.inc(num_tokens)

    def finished(self, num_output_tokens: int) -> None:
        now = time.perf_counter()
        self.metrics.e2e.observe(now - self.arrival)
        tpot = None
        if self.first_token is not None and num_output_tokens > 1:
            tpot = (now - self.first_token) / (num_output_tokens - 1)
            self.metrics.tpot.observe(tpot)
        if self.metrics.slo_window is not None and self.first_token is not None:
            self.metrics.slo_window.record(time.monotonic(), self.first_token - self.arrival, tpot)


class _RouterGauges(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        for name, documentation, value in (
            ("tandem_router_num_requests_running", "Generate calls in progress.", m.num_running),
            ("tandem_router_num_requests_waiting", "Requests in the admission queue.", m.num_waiting()),
        ):
            gauge = GaugeMetricFamily(name, documentation, labels=("model_name",))
            gauge.add_metric((m.model_name,), value)
            yield gauge
