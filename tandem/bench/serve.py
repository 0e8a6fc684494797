"""Load-test a tandem router as ``vllm bench serve`` does: disaggregated vs colocated.

Gamma arrivals (burstiness 1: Poisson) at each --request-rate of a seeded mix of short
chats and long prompts; reports request and output-token throughput, TTFT, TPOT, ITL and
end-to-end latency (mean, p50, p90, p99) and goodput under --goodput SLOs. Without
--server it starts, one after the other on one local Ray, a disaggregated cluster
(1 prefill + 1 decode worker) and a colocated one on the same total cores, each behind a
router on a free port, runs the same workload against both and prints the ratios; it also
measures the router hop's added latency. Writes results.json and PNG plots to --out-dir.
It drives the gRPC API, or with --api openai (and --server at the HTTP port) the
OpenAI-compatible one: streamed POST /v1/completions, measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")
DEFAULT_SLO = ["ttft:2000", "tpot:200"]
"""Goodput SLO in ms: a CPU-sized chat SLO (2 s to the first token, 5 tokens/s after it)."""
GOAL_TPOT_RATIO, SETTLE_S = 0.5, 30.0
SEED_WORKLOAD, SEED_ARRIVALS, SEED_WARM_UP, SEED_OVERHEAD = range(4)
"""Second entry of each seed ([--seed, purpose, ...]): every draw has a stream of its own."""


@dataclass(frozen=True)
class Settings:
    """What one run does; ``--quick`` only changes the defaults."""

    rates: list[float]
    num_prompts: int
    short_prompt_len: tuple[int, int]
    long_prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    long_fraction: float
    kv_cache_memory_gib: float
    overhead_requests: int


FULL = Settings([0.25, 0.5, 1.0], 40, (20, 80), (600, 1200), (16, 64), 0.2, 1.0, 20)
QUICK = Settings([2.0], 6, (8, 32), (100, 200), (4, 8), 0.2, 0.1, 4)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench serve``; unset ones take FULL's (or QUICK's) value."""
    from tandem.bench.serving.load import APIS

    a = parser.add_argument
    a("--server", default=None, metavar="HOST:PORT",
      help="drive this running router (one mode) instead of starting clusters; with --api openai its HTTP port")
    a("--api", choices=APIS, default="grpc", help="what to drive: the gRPC API (default) or the OpenAI-compatible "
      "HTTP API (streamed POST /v1/completions, the token ids as prompt; needs --server)")
    a("--model", default=None, help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    a("--quick", action="store_true", help="tiny run: 6 short requests at 2 req/s, small KV pools")
    a("--request-rate", type=float, nargs="+", default=None,
      help="requests/s, 'inf' sends all at once (default: 0.25 0.5 1)")
    a("--num-prompts", type=int, default=None, help="requests per rate (default: 40)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier")
    a("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none, open loop)")
    a("--goodput", nargs="+", default=DEFAULT_SLO, metavar="KEY:MS", help="SLOs in ms, keys ttft tpot e2el "
      f"(default: {' '.join(DEFAULT_SLO)})")
    a("--short-prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
      help="chat prompts (default: 20 80)")
    a("--long-prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
      help="long prompts (default: 600 1200)")
    a("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="default: 16 64")
    a("--long-fraction", type=float, default=None, help="share of long prompts (default: 0.2)")
    a("--seed", type=int, default=0)
    a("--request-timeout", type=float, default=600.0, help="deadline of each call, s")
    a("--modes", nargs="+", choices=MODES, default=list(MODES), help="clusters to start (without --server)")
    a("--cores", type=int, default=None, help="torch threads per mode in all (default: this machine's cores)")
    a("--colocated-workers", type=int, default=1, help="colocated workers, sharing --cores (default: 1)")
    a("--kv-cache-memory-gib", type=float, default=None, help="KV pool of each worker (default: 1.0)")
    a("--max-num-batched-tokens", type=int, default=1024, help="token budget per engine step, every worker")
    a("--overhead-requests", type=int, default=None, help="1-token pairs for the router overhead (default: 20)")
    a("--out-dir", default="bench-results/serve", help="where results.json and the PNGs go")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else FULL
    pick = lambda value, default: default if value is None else value  # noqa: E731
    s = Settings(
        rates=list(pick(args.request_rate, base.rates)), num_prompts=pick(args.num_prompts, base.num_prompts),
        short_prompt_len=tuple(pick(args.short_prompt_len, base.short_prompt_len)),  # type: ignore[arg-type]
        long_prompt_len=tuple(pick(args.long_prompt_len, base.long_prompt_len)),  # type: ignore[arg-type]
        output_len=tuple(pick(args.output_len, base.output_len)),  # type: ignore[arg-type]
        long_fraction=pick(args.long_fraction, base.long_fraction),
        kv_cache_memory_gib=pick(args.kv_cache_memory_gib, base.kv_cache_memory_gib),
        overhead_requests=pick(args.overhead_requests, base.overhead_requests),
    )
    if min(s.rates) <= 0 or s.num_prompts < 1 or s.overhead_requests < 1:
        raise ValueError("request rates must be > 0, --num-prompts and --overhead-requests >= 1")
    if args.api == "openai" and not args.server:
        raise ValueError("--api openai needs --server HOST:PORT (a running `tandem serve`'s HTTP port): the "
                         "clusters this bench starts itself serve the gRPC API only")
    return s


def cluster_configs(cores: int, colocated_workers: int, worker_args: dict) -> dict:
    """Both modes on the same total torch threads: disaggregated 1 prefill + 1 decode worker
    with cores // 2 threads each, colocated N workers with cores // N threads each."""
    from tandem.router.cluster import ClusterConfig

    half, per_colocated = max(1, cores // 2), max(1, cores // colocated_workers)
    return {
        "disaggregated": ClusterConfig(num_prefill=1, num_decode=1, name_prefix="bench-d-",
                                       worker_args={**worker_args, "num_threads": half}),
        "colocated": ClusterConfig(colocated=colocated_workers, name_prefix="bench-c-",
                                   worker_args={**worker_args, "num_threads": per_colocated}),
    }


def token_pool(tokenizer, vocab_size: int, eos_token: str | None):
    """Ids a random prompt may hold: below the vocab, not added/special, not EOS (a ``tokenizers.Tokenizer``)."""
    from tandem.bench.workload import allowed_token_ids

    excluded = set(tokenizer.get_added_tokens_decoder())
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        excluded.add(tokenizer.token_to_id(eos_token))
    return allowed_token_ids(min(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True)), excluded)


class Bench:
    """One run: the workload (built once, the same for every mode) and the results so far."""

    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        from tandem.bench.serving.load import Mix, parse_goodput

        self.args, self.settings = args, settings
        self.slo = parse_goodput(args.goodput)
        self.mix = Mix(settings.short_prompt_len, settings.long_prompt_len, settings.output_len, settings.long_fraction)
        self.workloads: list[list] | None = None
        """One per rate, each drawn with its own seed: a prompt seen at an earlier rate would
        hit the server's prefix cache. The same for every mode."""
        self.pool = None
        self.runs: list[dict] = []
        self.overhead: dict[str, dict] = {}
        self.model: str | None = None
        """With --api openai, the model every body names (the server's, from GET /v1/models)."""

    def build_workload(self, pool) -> None:
        from tandem.bench.serving.load import make_requests

        if self.workloads is None:
            self.pool = pool
            n, seed = self.settings.num_prompts, self.args.seed
            self.workloads = [make_requests(n, pool, self.mix, [seed, SEED_WORKLOAD, i])
                              for i in range(len(self.settings.rates))]

    async def warm_up(self, target: str, mode: str, num_workers: int = 1) -> None:
        """Untimed requests, a short and a long prompt per worker at once, so that first-call
        costs stay out of the figures."""
        from tandem.bench.serving.load import make_requests, run_load

        mix = replace(self.mix, output_len=(4, 4), long_fraction=0.5)
        warm = make_requests(2 * num_workers, self.pool, mix, [self.args.seed, SEED_WARM_UP])
        results, _ = await run_load(target, warm, [0.0] * len(warm), tag=f"warm-{mode}", desc="warm-up",
                                    timeout=self.args.request_timeout, progress=False, api=self.args.api,
                                    model=self.model)
        for result in results:
            if not result.success:
                raise RuntimeError(f"{mode}: warm-up request failed: {result.error}")

    def overhead_prompts(self) -> list[list[int]]:
        """Short prompts of their own (2 per pair, +2 warm-up), so no call hits another's prefix cache."""
        from tandem.bench.serving.load import Mix, make_requests

        n = 2 * self.settings.overhead_requests + 2
        return [r.prompt_token_ids for r in make_requests(n, self.pool, Mix((24, 24), (1, 1), (1, 1), 0.0),
                                                          [self.args.seed, SEED_OVERHEAD])]

    async def run_rates(self, target: str, mode: str, backend=None) -> None:
        """Every rate in turn, each starting on idle workers when the backend is at hand."""
        from tandem.bench.serving.load import arrival_offsets, result_dicts, run_load, summarize

        for rate, requests in zip(self.settings.rates, self.workloads):
            if backend is not None:
                await _settle(backend)
            # The same gaps at every rate, scaled (common random numbers).
            offsets = arrival_offsets(len(requests), rate, self.args.burstiness, [self.args.seed, SEED_ARRIVALS])
            results, duration = await run_load(
                target, requests, offsets, tag=f"{mode}-r{rate:g}", desc=f"{mode} @ {rate:g} req/s",
                timeout=self.args.request_timeout, max_concurrency=self.args.max_concurrency, api=self.args.api,
                model=self.model)
            metrics = summarize(results, duration, self.slo)
            logger.info("%s @ %g req/s: %d/%d completed in %.1f s, p99 TPOT %s ms, goodput %.3f req/s", mode, rate,
                        metrics["completed"], len(results), duration, metrics["tpot_ms"]["p99"], metrics["goodput"])
            self.runs.append({"mode": mode, "rate": rate, "metrics": metrics, "requests": result_dicts(results)})

    def results(self, config: dict) -> dict:
        from tandem.bench.serving.plots import compare

        s = self.settings
        return {
            "config": {**config, "api": self.args.api, "served_model": self.model, "seed": self.args.seed,
                       "rates": s.rates, "num_prompts": s.num_prompts, "burstiness": self.args.burstiness,
                       "max_concurrency": self.args.max_concurrency, "slo_ms": self.slo, "quick": self.args.quick,
                       "kv_cache_memory_gib": s.kv_cache_memory_gib,
                       "max_num_batched_tokens": self.args.max_num_batched_tokens},
            "workload": {"prompts": "uniform random token ids (added, special and EOS ids excluded), "
                                    "no shared prefixes",
                         "short_prompt_len": list(s.short_prompt_len), "long_prompt_len": list(s.long_prompt_len),
                         "output_len": list(s.output_len), "long_fraction": s.long_fraction,
                         "num_long": [sum(r.kind == "long" for r in w) for w in self.workloads or []],
                         "sampling": "temperature=0, ignore_eos=True, max_tokens=output_len",
                         "arrivals": "gamma(shape=burstiness, mean=1/rate) gaps, first request at 0"},
            "runs": self.runs, "router_overhead": self.overhead,
            "comparison": compare(self.runs, GOAL_TPOT_RATIO),
        }


async def _settle(backend, timeout: float = SETTLE_S) -> None:
    """Wait until no worker runs or queues anything (aborts and frees finish in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(l.num_running == 0 and l.num_waiting == 0 for l in await backend.loads()):
            return
        await asyncio.sleep(0.2)
    logger.warning("the workers were still busy %.0f s after the run", timeout)


async def run_local(bench: Bench, configs: dict) -> None:
    """Each mode in turn: start its cluster and router, warm up, overhead pairs, every rate, stop."""
    from tokenizers import Tokenizer

    from tandem.bench.serving.overhead import router_overhead
    from tandem.router.cluster import start_cluster, stop_cluster
    from tandem.router.server import bound_port, drain, serve

    for mode in bench.args.modes:
        logger.info("starting the %s cluster: %s", mode, configs[mode])
        t0 = time.perf_counter()
        backend = await start_cluster(configs[mode])
        server = None
        try:
            backend.start_polling()
            server = await serve(backend, "127.0.0.1", 0)
            target = f"127.0.0.1:{bound_port(server)}"
            logger.info("%s cluster serving on %s after %.1f s", mode, target, time.perf_counter() - t0)
            spec = backend.tokenizer_spec
            bench.build_workload(token_pool(Tokenizer.from_str(spec.tokenizer_json), spec.vocab_size, spec.eos_token))
            await bench.warm_up(target, mode, configs[mode].num_workers)
            bench.overhead[mode] = await router_overhead(target, backend, bench.overhead_prompts(), f"overhead-{mode}")
            await bench.run_rates(target, mode, backend)
        finally:
            if server is not None:
                await drain(server, grace=1.0)
            await backend.stop_polling()
            stop_cluster(backend)


async def run_server(bench: Bench) -> None:
    from tandem.model.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(bench.args.model))
    bench.build_workload(token_pool(tok.backend_tokenizer, len(tok), tok.eos_token))
    if bench.args.api == "openai":
        from tandem.bench.serving.openai_api import served_model

        bench.model = await served_model(bench.args.server)
    await bench.warm_up(bench.args.server, "server")
    await bench.run_rates(bench.args.server, "server")


def run(args: argparse.Namespace) -> int:
    from tandem.bench.serving import plots as serve_plots, report as serve_report

    settings = settings_from_args(args)
    bench = Bench(args, settings)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if getattr(args, "log_level", "INFO").upper() != "DEBUG":  # a line per request: too much next to progress bars
        logging.getLogger("tandem.router").setLevel(logging.WARNING)
    if args.server:
        config = {"server": args.server, "modes": {"server": {"note": "an already running router"}}}
        asyncio.run(run_server(bench))
    else:
        import ray

        cores = args.cores or len(os.sched_getaffinity(0))
        worker_args = {"model": args.model, "kv_cache_memory_gib": settings.kv_cache_memory_gib,
                       "max_num_batched_tokens": args.max_num_batched_tokens}
        configs = cluster_configs(cores, args.colocated_workers, worker_args)
        config = {"cores": cores, "modes": {
            m: {"prefill_workers": c.num_prefill if not c.colocated else 0,
                "decode_workers": c.num_decode if not c.colocated else 0, "colocated_workers": c.colocated,
                "threads_per_worker": c.worker_args["num_threads"],
                "total_threads": c.worker_args["num_threads"] * c.num_workers}
            for m, c in configs.items() if m in args.modes},
            "router": "in the benchmark's process, on the load generator's event loop"}
        # Logical CPUs for Ray's bookkeeping only: workers are limited by their torch threads.
        ray.init(num_cpus=max(4, cores), include_dashboard=False, logging_level="WARNING")
        try:
            asyncio.run(run_local(bench, configs))
        finally:
            ray.shutdown()
    results = bench.results(config)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=2))
    plots = [serve_report.write_distributions(results, out_dir), *serve_plots.write_plots(results, out_dir)]
    paths = [json_path, *plots, serve_report.write_html(results, out_dir, plots)]
    serve_plots.print_report(results)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["metrics"]["failed"] == 0 for r in results["runs"]) else 1
