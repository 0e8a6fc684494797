"""``simulate``: a workload through a simulated cluster -> the report ``tandem bench serve``
makes of a real run (the same RequestResult fields, the same summarize()), plus what only a
simulation sees: each prefill decision, each request's time by phase, the speed factor."""

from __future__ import annotations

import collections
import functools
import logging
import time
from dataclasses import dataclass, field

from tandem.bench.serving.load import RequestResult, conclude, stats, summarize
from tandem.config import ModelConfig
from tandem.sim.cluster import SimCluster
from tandem.sim.router_sim import SimRouter, SimTrace
from tandem.sim.spec import ClusterSpec, PoolSpec, SimRequest, StepTimeModel
from tandem.worker.api import Role

logger = logging.getLogger(__name__)

PHASES = ("queue", "prefill", "transfer", "decode")
HORIZON_S = 24 * 3600.0
"""Virtual seconds after the last arrival at which a run stops, ended or not."""


@dataclass
class SimReport:
    """What one simulated run gives."""

    metrics: dict
    """tandem.bench.serving.load.summarize()'s dict, as ``tandem bench serve`` reports a run."""
    results: list[RequestResult]
    decisions: dict[str, int]
    """``where/reason`` (router/disagg.py's labels) -> requests so placed (disaggregated only)."""
    breakdown: dict[str, dict]
    """Phase (PHASES) -> stats() of its milliseconds over the completed requests."""
    sim_s: float
    """Virtual seconds from the start to the last request's end."""
    wall_s: float
    """Seconds this process took to simulate it."""
    workers: dict[str, dict] = field(default_factory=dict)
    """Instance -> its steps, busy share, preemptions, swapped blocks."""
    traces: list[SimTrace] = field(default_factory=list)

    @property
    def speed_factor(self) -> float:
        """Simulated seconds per wall second."""
        return self.sim_s / self.wall_s if self.wall_s > 0 else float("inf")


def pools_of(spec: ClusterSpec) -> dict[Role, PoolSpec]:
    """The pools a spec runs, by role; ValueError for a spec that runs none."""
    if spec.mode == "colocated":
        if spec.colocated is None or spec.colocated.num_workers < 1:
            raise ValueError("a colocated cluster needs at least one colocated worker")
        return {Role.COLOCATED: spec.colocated}
    if spec.mode == "disaggregated":
        if spec.prefill is None or spec.decode is None or spec.decode.num_workers < 1:
            raise ValueError("a disaggregated cluster needs a decode pool (and a prefill pool)")
        pools = {Role.DECODE: spec.decode}
        if spec.prefill.num_workers > 0:  # none: every prompt is prefilled locally (no_prefill_worker)
            pools[Role.PREFILL] = spec.prefill
        return pools
    raise ValueError(f"mode must be colocated or disaggregated, got {spec.mode!r}")


def simulate(spec: ClusterSpec, requests: list[SimRequest], step_model: StepTimeModel,
             model_config: ModelConfig, slo: dict[str, float], dtype: str = "float32") -> SimReport:
    """Run ``requests`` through a cluster of ``spec``'s shape whose steps take
    ``step_model``'s time. slo: ``--goodput``'s bounds in ms (tandem.bench.serving.load.parse_goodput).
    dtype: the engines' (it sizes the host swap pool, as on a real worker)."""
    if not requests:
        raise ValueError("no requests to simulate")
    started = time.perf_counter()
    cluster = SimCluster.build(pools_of(spec), model_config, step_model, dtype)
    traces: list[SimTrace] = []
    router = SimRouter(cluster, spec, step_model.kv_bytes_per_token, model_config.num_layers, len(requests),
                       traces.append)
    router.start_polling()
    for i, request in enumerate(requests):
        cluster.clock.at(request.arrival_s + spec.router_overhead_s, functools.partial(router.submit, i, request))
    # NOTE: every request ends (served, refused, or timed out in admission) long before the
    # horizon; it only bounds a stall (a bug), whose load poll would otherwise run forever.
    cluster.clock.run(until=max(r.arrival_s for r in requests) + HORIZON_S)
    wall_s = time.perf_counter() - started
    if len(traces) < len(requests):  # NOTE: a stall here is a bug of the sim (or of the engine)
        ended = {t.index for t in traces}
        logger.error("%d requests never ended", len(requests) - len(traces))
        traces += [SimTrace(i, r, r.arrival_s, code="UNKNOWN", error="UNKNOWN: never ended", end_s=cluster.clock.now)
                   for i, r in enumerate(requests) if i not in ended]
    traces.sort(key=lambda t: t.index)
    results = [request_result(t) for t in traces]
    start_s = min(r.arrival_s for r in requests)
    sim_s = max(_end_s(t) for t in traces) - start_s
    duration_s = max(sim_s, 1e-9)  # NOTE: summarize divides by it (every request refused at once: 0)
    decisions = collections.Counter({f"{where}/{reason}": n for (where, reason), n in router.decisions.items()})
    report = SimReport(summarize(results, duration_s, slo), results, dict(decisions.most_common()), breakdown(traces),
                       sim_s, wall_s, worker_stats(cluster, sim_s), traces)
    logger.info("simulated %.1f s in %.2f s (%.0fx), %d events", sim_s, wall_s, report.speed_factor,
                cluster.clock.num_events)
    return report


def _end_s(t: SimTrace) -> float:
    assert t.end_s is not None, "every trace here has ended"
    return t.end_s


def request_result(t: SimTrace) -> RequestResult:
    """The RequestResult the bench's client would have made of this request's stream (the
    times the router saw are the client's: no hop back is modelled)."""
    r = t.request
    send_s = r.arrival_s
    result = RequestResult(t.index, r.kind, len(r.prompt_token_ids), r.output_len, send_s=send_s, code=t.code,
                           error=t.error, output_tokens=t.num_output_tokens, finish_reason=t.finish_reason,
                           num_chunks=len(t.chunk_s))
    if t.finish_reason is not None:
        result.usage_completion_tokens = t.num_output_tokens
    if t.chunk_s:
        result.ttft_ms = (t.chunk_s[0] - send_s) * 1e3
        result.itl_ms = [(b - a) * 1e3 for a, b in zip(t.chunk_s, t.chunk_s[1:])]
    return conclude(result, send_s, t.end_s)


def phase_ms(t: SimTrace) -> dict[str, float]:
    """A completed request's time by phase (ms): queue (at the router, for a decode worker
    with room), prefill (a remote prefill on the prefill worker, its queue there included;
    else from admission to the first token), transfer (the remote prefill's end to its
    KV's arrival: it overlaps the decode), decode (first token to the end)."""
    admitted = t.admitted_s if t.admitted_s is not None else t.arrive_s
    assert t.first_token_s is not None and t.end_s is not None, "a completed request"
    if t.prefill_end_s is not None:  # a remote prefill
        assert t.prefill_start_s is not None
        prefill_s = t.prefill_end_s - t.prefill_start_s
        transfer_ms = (t.kv_done_s - t.prefill_end_s) * 1e3 if t.kv_done_s is not None else 0.0
    else:
        prefill_s, transfer_ms = t.first_token_s - admitted, 0.0
    return {
        "queue": (admitted - t.arrive_s) * 1e3,
        "prefill": prefill_s * 1e3,
        "transfer": transfer_ms,
        "decode": (t.end_s - t.first_token_s) * 1e3,
    }


def breakdown(traces: list[SimTrace]) -> dict[str, dict]:
    done = [phase_ms(t) for t in traces if t.code == "OK" and t.first_token_s is not None]
    return {phase: stats([p[phase] for p in done]) for phase in PHASES}


def worker_stats(cluster: SimCluster, sim_s: float) -> dict[str, dict]:
    out = {}
    for w in cluster.workers:
        counters = w.engine.counters()
        out[w.instance] = {"steps": w.runner.num_steps, "busy": w.runner.busy_s / sim_s if sim_s > 0 else 0.0,
                           "preemptions": counters.num_preemptions, "swapped_blocks": w.runner.num_swapped_blocks,
                           "prefix_hit_tokens": w.num_prefix_hits}
    return out
