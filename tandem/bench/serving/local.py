"""The clusters ``tandem bench serve`` starts itself: every measured run on a fresh one.

A run starts its setup's cluster (the disaggregated one, or a colocated one at one prefill
chunk budget) behind a router on free ports, warms it up, waits until it is idle, scrapes
its /metrics, runs the load, waits again, scrapes again, stops the cluster and waits for its
processes to exit (a worker still exiting would steal cycles from the next run). Fresh
clusters keep the prefix cache, the allocator and the queues of one run out of the next. A
run during which other processes took much of the CPU (interference.py) is repeated once,
a few times per invocation at most (--retries).

First the sweep: every rate, and at each rate every setup back to back (so that drift in the
machine's speed hits the setups compared at a rate alike). Then the max-SLO-rate search
(slo_search.py) on the disaggregated setup and the colocated budget sweep.search_budget
picks, their probes alternating.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from tandem.config import WorkerConfig

if TYPE_CHECKING:
    from tandem.bench.serve import Bench
    from tandem.router.cluster import ClusterConfig

logger = logging.getLogger(__name__)

SETTLE_S, EXIT_WAIT_S = 30.0, 30.0


@dataclass(frozen=True)
class Setup:
    """One cluster configuration compared: its mode, its workers' token budget per step, and
    the ClusterConfig that starts it."""

    mode: str
    budget: int
    config: ClusterConfig

    @property
    def label(self) -> str:
        return f"colocated/{self.budget}" if self.mode == "colocated" else self.mode


def make_setups(configs: dict, modes: list[str], disaggregated_budget: int, budgets: list[int]) -> list[Setup]:
    """The disaggregated setup (``disaggregated_budget`` on both workers) and one colocated
    setup per budget in ``budgets``, those of ``modes`` only, from ``serve.cluster_configs``."""
    setups = []
    if "disaggregated" in modes:
        cfg = configs["disaggregated"]
        setups.append(Setup("disaggregated", disaggregated_budget, replace(
            cfg, worker=cfg.worker.with_engine(max_num_batched_tokens=disaggregated_budget))))
    if "colocated" in modes:
        cfg = configs["colocated"]
        for budget in budgets:
            setups.append(Setup("colocated", budget, replace(
                cfg, name_prefix=f"{cfg.name_prefix}{budget}-",
                worker=cfg.worker.with_engine(max_num_batched_tokens=budget))))
    return setups


class Progress:
    """Counts the runs and says which one starts, of how many at most, and the time so far."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def start(self, setup: Setup, rate: float, phase: str) -> None:
        logger.info("run %d of at most %d (%s): %s @ %g req/s, %.0f s so far", self.done + 1, self.total, phase,
                    setup.label, rate, time.perf_counter() - self.t0)

    def finish(self) -> None:
        self.done += 1

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0


async def settle(backend, timeout: float = SETTLE_S) -> None:
    """Wait until no worker runs or queues anything (aborts and frees finish in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(w.num_running == 0 and w.num_waiting == 0 for w in await backend.loads()):
            return
        await asyncio.sleep(0.2)
    logger.warning("the workers were still busy %.0f s after the run", timeout)


async def _wait_exited(pids: list[int], timeout: float = EXIT_WAIT_S) -> None:
    import psutil

    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    if any(psutil.pid_exists(p) for p in pids):
        logger.warning("stopped workers were still running %.0f s later", timeout)


async def fresh_run(bench: Bench, setup: Setup, rate: float, phase: str, progress: Progress) -> dict:
    """One measured run of ``bench``'s workload at ``rate`` on a fresh cluster of ``setup``;
    the first run of each mode also measures the router hop (bench.overhead)."""
    from tokenizers import Tokenizer

    from tandem.bench.serve import token_pool
    from tandem.bench.serving.interference import SUSPECT, CpuWatch
    from tandem.bench.serving.overhead import router_overhead
    from tandem.router.cluster import start_cluster, stop_cluster
    from tandem.router.server import bound_port, drain, metrics_port, serve

    progress.start(setup, rate, phase)
    t0 = time.perf_counter()
    backend = await start_cluster(setup.config)
    server, pids = None, []
    try:
        pids = [await w.handle.pid.remote() for w in backend.workers]
        backend.start_polling()
        server = await serve(backend, "127.0.0.1", 0, metrics_port=0)
        target = f"127.0.0.1:{bound_port(server)}"
        started_s = time.perf_counter() - t0
        logger.info("%s serving on %s after %.1f s", setup.label, target, started_s)
        spec = backend.tokenizer_spec
        tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        bench.build_workload(token_pool(tokenizer, spec.vocab_size, spec.eos_token))
        bench.use_dataset(tokenizer)
        await bench.warm_up(target, setup.label, setup.config.num_workers)
        if setup.mode not in bench.overhead:
            bench.overhead[setup.mode] = await router_overhead(target, backend, bench.overhead_prompts(),
                                                               f"overhead-{setup.mode}")
        await settle(backend)
        watch = CpuWatch(pids)
        watch.start()
        run = await bench.measure(target, setup.label, rate, f"http://127.0.0.1:{metrics_port(server)}/metrics",
                                  lambda: settle(backend))
        run["others_cpu"] = watch.stop()
        if run["others_cpu"] >= SUSPECT:
            logger.warning("%s @ %g req/s: other processes took %.0f%% of the CPU during the run", setup.label,
                           rate, 100 * run["others_cpu"])
    finally:
        if server is not None:
            await drain(server, grace=1.0)
        await backend.stop_polling()
        stop_cluster(backend)
        await _wait_exited(pids)
        progress.finish()
    return {"mode": setup.mode, "budget": setup.budget, "rate": rate, "phase": phase, "label": setup.label,
            "cluster_start_s": started_s, **run}


async def measured_run(bench: Bench, setup: Setup, rate: float, phase: str, progress: Progress) -> dict:
    """fresh_run, repeated once when other processes took SUSPECT or more of the CPU during it
    (while bench.retries_left lasts); the run with the smaller share is kept, the other goes
    to bench.discarded."""
    from tandem.bench.serving.interference import SUSPECT

    run = await fresh_run(bench, setup, rate, phase, progress)
    if run["others_cpu"] < SUSPECT or bench.retries_left <= 0:
        return run
    bench.retries_left -= 1
    progress.total += 1
    logger.info("repeating %s @ %g req/s: other processes took %.0f%% of the CPU", setup.label, rate,
                100 * run["others_cpu"])
    again = await fresh_run(bench, setup, rate, phase + " (repeat)", progress)
    kept, dropped = (again, run) if again["others_cpu"] <= run["others_cpu"] else (run, again)
    bench.discarded.append({key: dropped[key] for key in ("label", "rate", "phase", "others_cpu", "metrics")})
    return kept


async def run_local(bench: Bench, setups: list[Setup]) -> None:
    """The sweep into bench.runs, then (with both modes and a probe budget) the search into
    bench.slo_search."""
    from tandem.bench.serving.sweep import search_budget

    s = bench.settings
    search = s.slo_probes > 0 and {x.mode for x in setups} == {"disaggregated", "colocated"}
    progress = Progress(len(s.rates) * len(setups) + (2 * s.slo_probes if search else 0))
    for rate in s.rates:
        for setup in setups:
            bench.runs.append(await measured_run(bench, setup, rate, "sweep", progress))
    if search:
        budget = search_budget(bench.runs)
        chosen = [x for x in setups if x.mode == "disaggregated" or x.budget == budget]
        bench.slo_search = await search_max_rates(bench, chosen, progress)
    bench.elapsed_s = progress.elapsed_s


async def search_max_rates(bench: Bench, setups: list[Setup], progress: Progress) -> dict:
    """The max-SLO-rate search on each setup, seeded with its sweep runs, probes alternating
    between the setups, at most bench.settings.slo_probes new probes each."""
    from tandem.bench.serving.slo_search import RateSearch, attainment, search_summary

    s, target = bench.settings, bench.args.slo_attainment
    searches = {x.label: RateSearch(start=min(s.rates)) for x in setups}
    probes: dict[str, list[dict]] = {x.label: [] for x in setups}
    left = {x.label: s.slo_probes for x in setups}

    def record(label: str, run: dict, source: str) -> None:
        a = attainment(run["metrics"])
        searches[label].record(run["rate"], a >= target)
        probe = {"rate": run["rate"], "attainment": a, "passed": a >= target, "source": source,
                 "metrics": run["metrics"], "others_cpu": run.get("others_cpu")}
        if source == "probe":
            probe.update(requests=run["requests"], breakdown=run.get("breakdown"))
        probes[label].append(probe)

    for run in bench.runs:
        if run["label"] in searches:
            record(run["label"], run, "sweep")
    while any(left.values()):
        for x in setups:
            rate = searches[x.label].next_rate() if left[x.label] else None
            if rate is None:
                left[x.label] = 0
                continue
            left[x.label] -= 1
            run = await measured_run(bench, x, rate, "slo search", progress)
            record(x.label, run, "probe")
            logger.info("%s @ %g req/s: %.0f%% of requests within the SLO (%s)", x.label, rate,
                        100 * probes[x.label][-1]["attainment"], "met" if probes[x.label][-1]["passed"] else "missed")
    return {"attainment": target, "slo_ms": bench.slo, "num_prompts": s.num_prompts, "max_probes": s.slo_probes,
            "setups": {x.mode: search_summary(searches[x.label], probes[x.label], x.label, x.budget) for x in setups}}


def _describe(c: ClusterConfig) -> dict:
    """A mode's cluster, for results.json."""
    threads = c.worker.num_threads
    assert threads is not None, "cluster_configs gives every worker its threads"
    return {"prefill_workers": c.num_prefill if not c.colocated else 0,
            "decode_workers": c.num_decode if not c.colocated else 0, "colocated_workers": c.colocated,
            "threads_per_worker": threads, "total_threads": threads * c.num_workers,
            **({"disagg_policy": c.disagg_policy} if not c.colocated else {})}


def run_clusters(bench: Bench, cluster_configs: Callable[[int, int, WorkerConfig], dict[str, ClusterConfig]]) -> dict:
    """Everything run_local does, on a local Ray of its own -> the clusters' description for
    results.json. ``cluster_configs``: serve.cluster_configs (cores, workers, the workers' config)."""
    import os

    import ray

    args, settings = bench.args, bench.settings
    cores = args.cores or len(os.sched_getaffinity(0))
    worker = WorkerConfig.build(model=args.model, kv_cache_memory_gib=settings.kv_cache_memory_gib)
    configs = cluster_configs(cores, args.colocated_workers, worker)
    config = {"cores": cores, "modes": {m: _describe(c) for m, c in configs.items() if m in args.modes},
        "router": "in the benchmark's process, on the load generator's event loop",
        "clusters": "a fresh cluster for every run"}
    # Logical CPUs for Ray's bookkeeping only: workers are limited by their torch threads.
    ray.init(num_cpus=max(4, cores), include_dashboard=False, logging_level=logging.WARNING)
    try:
        asyncio.run(run_local(bench, make_setups(configs, args.modes, args.max_num_batched_tokens, settings.budgets)))
    finally:
        ray.shutdown()
    return config
