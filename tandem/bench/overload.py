"""Overload a tandem cluster at --factor x its sustainable rate for --duration seconds.

Starts a disaggregated cluster (1 prefill + 1 decode worker on a local Ray) behind a router in
this process whose --max-concurrent-requests bounds the calls in progress, and sends short
greedy requests (EOS ignored). Phases: the sustainable rate R (completed calls per second of a
closed loop with as many calls in flight as the router admits); a baseline at 0.5 R (Poisson
arrivals); the overload, Poisson at --factor x R for --duration s, sampling every second the
resident memory of the router and of each worker and the router's calls in progress; the drain
(time from the end of the overload until the workers hold nothing); the baseline again
(recovery). Prints the figures, writes results.json and overload.png to --out-dir, and exits 1
when a call ended with a status other than OK or RESOURCE_EXHAUSTED, an accepted call missed
tokens, the workers did not empty, or a call after the overload failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.bench.overloading.traffic import Load
    from tandem.bench.overloading.watch import Watch
    from tandem.bench.serving.load import RequestResult
    from tandem.router.cluster import ClusterConfig
    from tandem.router.policy import WorkerState

logger = logging.getLogger(__name__)

BASELINE_FRACTION = 0.5
"""The baselines before and after the overload run at this fraction of the sustainable rate."""
NUM_WARM_UP = 2
WORKLOAD = {"prompts": "uniform random token ids (added, special and EOS ids excluded), no shared prefixes",
            "sampling": "temperature=0, ignore_eos=True, max_tokens=output_len",
            "arrivals": "a closed loop for the sustainable rate, Poisson (first call at 0) after it; the baseline "
                        "after the overload repeats the one before's arrival times and lengths with fresh prompts"}


@dataclass(frozen=True)
class Settings:
    """What one run does; ``--quick`` only changes the defaults."""

    duration_s: float
    """Of the overload."""
    sustain_rounds: int
    """Calls per slot of the closed loop that measures the sustainable rate (>= 3: its rate
    counts from the first round's end to the last send, see closed_loop_rate)."""
    baseline_requests: int
    """Calls of each baseline (before and after the overload)."""
    concurrency: int | None
    """Calls in flight in that closed loop; None: the router's bound, so that R is what the
    cluster completes with as many calls in progress as the router admits."""


FULL = Settings(60.0, 4, 40, None)
QUICK = Settings(4.0, 3, 8, 16)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench overload``; unset ones take FULL's (or QUICK's) value."""
    a = parser.add_argument
    a("--model", default=None, help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    a("--quick", action="store_true", help=f"tiny run: {QUICK.duration_s:g} s of overload, "
      f"{QUICK.sustain_rounds} rounds of a closed loop of {QUICK.concurrency} calls, 2 x {QUICK.baseline_requests} "
      "calls around it")
    a("--factor", type=float, default=10.0,
      help="offered rate during the overload, x the sustainable rate (default: 10)")
    a("--duration", type=float, default=None, help=f"seconds of overload (default: {FULL.duration_s:g})")
    a("--max-concurrent-requests", type=int, default=32,
      help="the router's bound on calls in progress (default: 32)")
    a("--concurrency", type=int, default=None, help="calls in flight in the closed loop that measures "
      f"the sustainable rate (default: the bound, --max-concurrent-requests; --quick: {QUICK.concurrency})")
    a("--sustain-rounds", type=int, default=None,
      help=f"calls per slot of that closed loop, >= 3 (default: {FULL.sustain_rounds})")
    a("--baseline-requests", type=int, default=None,
      help=f"calls of each baseline at 0.5x the sustainable rate (default: {FULL.baseline_requests})")
    a("--prompt-len", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"), help="default: 16 48")
    a("--output-len", type=int, nargs=2, default=[8, 16], metavar=("MIN", "MAX"), help="default: 8 16")
    a("--kv-cache-memory-gib", type=float, default=0.25, help="KV pool of each worker (default: 0.25)")
    a("--max-num-batched-tokens", type=int, default=1024, help="token budget per engine step, every worker")
    a("--cores", type=int, default=None, help="torch threads of both workers together (default: this machine's cores)")
    a("--seed", type=int, default=0)
    a("--request-timeout", type=float, default=120.0, help="deadline of each call, s (default: 120)")
    a("--drain-timeout", type=float, default=60.0,
      help="most seconds to wait for the workers to empty after the overload (default: 60)")
    a("--out-dir", default="bench-results/overload", help="where results.json and overload.png go")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else FULL
    pick = lambda value, default: default if value is None else value  # noqa: E731
    concurrency = pick(args.concurrency, base.concurrency)
    s = Settings(duration_s=pick(args.duration, base.duration_s),
                 sustain_rounds=pick(args.sustain_rounds, base.sustain_rounds),
                 baseline_requests=pick(args.baseline_requests, base.baseline_requests),
                 concurrency=args.max_concurrent_requests if concurrency is None else concurrency)
    if s.duration_s <= 0 or args.factor <= 0:
        raise ValueError("--duration and --factor must be > 0")
    if min(s.baseline_requests, s.concurrency, args.max_concurrent_requests) < 1:
        raise ValueError("--baseline-requests, --concurrency and --max-concurrent-requests must be >= 1")
    if s.concurrency > args.max_concurrent_requests:
        raise ValueError("--concurrency must be <= --max-concurrent-requests: the closed loop is never refused")
    if s.sustain_rounds < 3:
        raise ValueError("--sustain-rounds must be >= 3: the rate is measured between the first round's end and "
                         "the last send")
    return s


def _check_complete(results: list[RequestResult], phase: str) -> None:
    from tandem.bench.overloading.summary import complete

    if failed := [r.error for r in results if not complete(r)]:
        raise RuntimeError(f"{phase}: {len(failed)} of {len(results)} calls failed, e.g. {failed[0]}")


async def run_phases(load: Load, watch: Watch, workers: list[WorkerState], settings: Settings,
                     args: argparse.Namespace) -> dict:
    """Warm-up, sustainable rate, baseline, overload, drain, baseline again -> their figures."""
    from tandem.bench.overloading.summary import (
        LATENCIES,
        accepted_rate,
        baseline,
        closed_loop_rate,
        last_accepted_end_s,
        outcomes,
        per_second,
        recovery,
        request_records,
    )
    from tandem.bench.overloading.watch import wait_until_empty
    from tandem.bench.serving.load import stats

    watch.mark("warm-up")  # first-call costs stay out of the figures
    _check_complete((await load.closed("warm-up", NUM_WARM_UP, NUM_WARM_UP))[0], "warm-up")
    watch.mark("sustain")
    concurrency = settings.concurrency
    assert concurrency is not None, "settings_from_args() resolves it"
    sustain, sustain_s = await load.closed("sustain", settings.sustain_rounds * concurrency, concurrency)
    _check_complete(sustain, "the closed loop")
    rate = closed_loop_rate(sustain, concurrency)
    logger.info("sustainable rate: %.2f calls/s (%d calls, %d in flight, in %.1f s)", rate, len(sustain),
                concurrency, sustain_s)
    watch.mark("before")
    base_rate = BASELINE_FRACTION * rate
    before = baseline(await load.poisson("before", base_rate, num=settings.baseline_requests), base_rate)
    watch.mark("overload")
    # run_load's clock starts a moment later (it opens a channel): the drain reads that much long.
    window_end = time.perf_counter() + settings.duration_s
    offered = args.factor * rate
    calls = await load.poisson("overload", offered, duration_s=settings.duration_s)
    watch.mark("drain")
    held = await wait_until_empty(workers, args.drain_timeout)
    drain_s = None if held else time.perf_counter() - window_end
    logger.info("drain: %s", f"the workers were empty {drain_s:.1f} s after the overload" if not held
                else f"the workers still hold requests: {held}")
    watch.mark("after")
    after = baseline(await load.poisson("after", base_rate, num=settings.baseline_requests, like="before"), base_rate)
    watch.mark("end")
    last_end = last_accepted_end_s(calls)
    return {
        "sustainable": {"concurrency": concurrency, "num_requests": len(sustain), "duration_s": sustain_s,
                        "rate": rate, **{key: stats([getattr(r, key) for r in sustain]) for key in LATENCIES},
                        "requests": request_records(sustain)},
        "before": before,
        "overload": {"factor": args.factor, "rate": offered, "duration_s": settings.duration_s,
                     "num_requests": len(calls), "sent_rate": len(calls) / settings.duration_s,
                     "max_concurrent_requests": args.max_concurrent_requests,
                     "peak_in_progress": max(s.in_progress_peak for s in watch.samples),
                     "last_accepted_end_s": None if last_end is None else last_end - settings.duration_s,
                     "accepted_rate": accepted_rate(calls),
                     "outcomes": outcomes(calls), "per_second": per_second(calls, settings.duration_s)},
        "drain": {"seconds": drain_s, "timeout_s": args.drain_timeout, "held": held},
        "after": after,
        "recovery": recovery(before, after),
        "requests": request_records(calls),
    }


def cluster_config(args: argparse.Namespace, cores: int) -> ClusterConfig:
    """1 prefill + 1 decode worker, each on half the cores' torch threads."""
    from tandem.config import WorkerConfig
    from tandem.router.cluster import ClusterConfig

    worker = WorkerConfig.build(model=args.model, num_threads=max(1, cores // 2),
                                kv_cache_memory_gib=args.kv_cache_memory_gib,
                                max_num_batched_tokens=args.max_num_batched_tokens)
    return ClusterConfig(num_prefill=1, num_decode=1, name_prefix="overload-", worker=worker,
                         disagg_policy="always")


async def measure(args: argparse.Namespace, settings: Settings, cores: int) -> dict:
    """Start the cluster and its router, run every phase while watching, stop -> the figures."""
    from tokenizers import Tokenizer

    from tandem.bench.overloading.summary import memory, other_cpu_by_phase
    from tandem.bench.overloading.traffic import Load
    from tandem.bench.overloading.watch import Watch, worker_pids
    from tandem.bench.serve import token_pool
    from tandem.bench.serving.load import Mix
    from tandem.router.cluster import start_cluster, stop_cluster
    from tandem.router.limits import RequestLimits
    from tandem.router.server import bound_port, drain, serve

    config = cluster_config(args, cores)
    logger.info("starting the cluster: %s", config)
    t0 = time.perf_counter()
    backend = await start_cluster(config)
    server = None
    try:
        backend.start_polling()
        limits = RequestLimits(max_concurrent_requests=args.max_concurrent_requests)
        server = await serve(backend, "127.0.0.1", 0, limits=limits)
        logger.info("cluster serving on port %d after %.1f s", bound_port(server), time.perf_counter() - t0)
        spec = backend.tokenizer_spec
        pool = token_pool(Tokenizer.from_str(spec.tokenizer_json), spec.vocab_size, spec.eos_token)
        mix = Mix(tuple(args.prompt_len), (1, 1), tuple(args.output_len), long_fraction=0.0)
        load = Load(f"127.0.0.1:{bound_port(server)}", pool, mix, args.seed, args.request_timeout)
        # backend.metrics: the router's, set by serve().
        metrics = backend.metrics
        assert metrics is not None
        async with Watch(await worker_pids(backend.workers), lambda: metrics.num_running) as watch:
            figures = await run_phases(load, watch, backend.workers, settings, args)
    finally:
        if server is not None:
            await drain(server, grace=1.0)
        await backend.stop_polling()
        stop_cluster(backend)
    start = watch.phases["overload"]
    return {**figures, "memory": memory(watch.samples, start, start + settings.duration_s),
            "other_cpu_cores": other_cpu_by_phase(watch.samples, watch.phases),
            "phases": watch.phases, "samples": [asdict(s) for s in watch.samples]}


def run(args: argparse.Namespace) -> int:
    import ray

    from tandem.bench.overloading import plots as overload_plots
    from tandem.bench.overloading.summary import failures

    settings = settings_from_args(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("tandem.router").setLevel(logging.WARNING)  # a line per call: thousands here
    cores = args.cores or len(os.sched_getaffinity(0))
    # Logical CPUs for Ray's bookkeeping only: workers are limited by their torch threads.
    ray.init(num_cpus=max(4, cores), include_dashboard=False, logging_level=logging.WARNING)
    try:
        figures = asyncio.run(measure(args, settings, cores))
    finally:
        ray.shutdown()
    results = {"config": {"cores": cores, "workers": "1 prefill + 1 decode", "threads_per_worker": max(1, cores // 2),
                          "router": "in the benchmark's process, on the load generator's event loop",
                          "factor": args.factor, "duration_s": settings.duration_s,
                          "concurrency": settings.concurrency, "max_concurrent_requests":
                          args.max_concurrent_requests, "quick": args.quick, "seed": args.seed,
                          "kv_cache_memory_gib": args.kv_cache_memory_gib, "request_timeout_s": args.request_timeout},
               "workload": WORKLOAD | {"prompt_len": args.prompt_len, "output_len": args.output_len},
               **figures}
    results["failures"] = failures(results)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=2))
    plot = overload_plots.write_plot(results, out_dir)
    overload_plots.print_report(results)
    print(f"\nwrote {json_path}, {plot}")
    return 1 if results["failures"] else 0
