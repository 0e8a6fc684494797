"""Load-test a tandem router as ``vllm bench serve`` does: disaggregated vs the best colocated.

Gamma arrivals (burstiness 1: Poisson) at each --request-rate of a seeded mix of short
chats and long prompts; reports request and output-token throughput, TTFT, TPOT, ITL and
end-to-end latency (mean, p50, p90, p99) and goodput under the --goodput SLO. Without
--server it starts, on one local Ray, a fresh cluster for every run: the disaggregated one
(1 prefill + 1 decode worker) and colocated ones at each --colocated-budgets prefill chunk
budget, all on the same total cores; it compares disaggregated with the best colocated run
at each rate (sweep.py), searches each mode's highest rate with --slo-attainment of the
requests within the SLO (slo_search.py), breaks each run's time down from the cluster's
/metrics (breakdown.py), and measures the router hop's added latency. Writes results.json
and PNG plots to --out-dir. It drives the gRPC API, or with --api openai (and --server at
the HTTP port) the OpenAI-compatible one: streamed POST /v1/completions, measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.router.auth import AUTH_TOKEN_ENV

if TYPE_CHECKING:
    import numpy as np

    from tandem.bench.serving.load import Request
    from tandem.config import WorkerConfig
    from tandem.router.cluster import ClusterConfig

logger = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")
DEFAULT_SLO = ["ttft:4000", "tpot:200"]
"""The SLO in ms, of goodput and of the max-rate search: sized for the default model on two
CPU cores, where one thread prefills a 1200-token prompt in about 2-3 s unloaded and a
decode step of a few sequences takes 60-100 ms (5 tokens/s after the first at worst)."""
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
    budgets: list[int]
    """The colocated worker's prefill chunk budgets swept (max_num_batched_tokens)."""
    slo_probes: int
    """New probes per mode in the max-SLO-rate search (0: no search)."""


FULL = Settings([0.5, 1.0], 20, (20, 80), (600, 1200), (16, 64), 0.2, 1.0, 20, [128, 256, 512, 1024], 3)
QUICK = Settings([2.0], 6, (8, 32), (100, 200), (4, 8), 0.2, 0.1, 4, [128, 512], 1)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench serve``; unset ones take FULL's (or QUICK's) value."""
    from tandem.bench.serving.load import APIS

    a = parser.add_argument
    a("--server", default=None, metavar="HOST:PORT",
      help="drive this running router (one mode) instead of starting clusters; with --api openai its HTTP port")
    a("--api", choices=APIS, default="grpc", help="what to drive: the gRPC API (default) or the OpenAI-compatible "
      "HTTP API (streamed POST /v1/completions, the token ids as prompt; needs --server)")
    a("--metrics-url", default=None, metavar="URL", help="with --server: the router's /metrics (e.g. "
      "http://127.0.0.1:9464/metrics), scraped before and after each rate for the time breakdown")
    a("--model", default=None, help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    a("--quick", action="store_true", help="tiny run: 6 short requests at 2 req/s, 2 colocated budgets, 1 probe "
      "per mode, small KV pools")
    a("--request-rate", type=float, nargs="+", default=None,
      help="requests/s of the sweep, 'inf' sends all at once (default: 0.5 1); mooncake: the trace's gaps scaled to it")
    a("--num-prompts", type=int, default=None, help="requests per run (default: 20); mooncake: the trace's first")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier")
    a("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none, open loop)")
    a("--goodput", nargs="+", default=DEFAULT_SLO, metavar="KEY:MS", help="the SLO in ms, keys ttft tpot e2el, "
      f"of goodput and of the max-rate search (default: {' '.join(DEFAULT_SLO)})")
    a("--slo-attainment", type=float, default=0.9, help="share of requests within the SLO a sustained rate needs "
      "(default: 0.9)")
    a("--slo-probes", type=int, default=None, help="new probes per mode in the max-SLO-rate search, each on a "
      "fresh cluster; 0: no search (default: 3)")
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
    a("--disagg-policy", default="auto", choices=("auto", "always", "never"),
      help="the disaggregated cluster's --disagg-policy: where each prompt is prefilled (default: auto)")
    a("--colocated-workers", type=int, default=1, help="colocated workers, sharing --cores (default: 1)")
    a("--kv-cache-memory-gib", type=float, default=None, help="KV pool of each worker (default: 1.0)")
    a("--max-num-batched-tokens", type=int, default=1024,
      help="token budget per engine step of the disaggregated workers (default: 1024)")
    a("--colocated-budgets", type=int, nargs="+", default=None, metavar="TOKENS",
      help="the colocated workers' token budgets per step (prefill chunk) swept (default: 128 256 512 1024)")
    a("--retries", type=int, default=2, help="runs repeated (once each) when other processes took >= 10%% of the "
      "CPU during them, at most this many in all (default: 2)")
    a("--overhead-requests", type=int, default=None, help="1-token pairs for the router overhead (default: 20)")
    a("--out-dir", default="bench-results/serve", help="where results.json and the PNGs go")
    a("--save-result", action="store_true", help="also write each run under vLLM's flat keys (mean_ttft_ms, "
      "p99_tpot_ms, request_goodput, ...), one JSON file per run in --out-dir")
    a("--dataset-name", choices=("random", "sharegpt", "multiturn", "mooncake"), default="random",
      help="random token ids (default), ShareGPT conversations from --dataset-path (vLLM's sampling), "
      "multiturn: --num-prompts chat sessions (started at --request-rate a second) each resending its history "
      "every turn (bench/serving/multiturn.py), or mooncake: a trace's requests and gaps (bench/serving/trace.py)")
    a("--num-turns", type=int, default=5, help="multiturn: turns per session (default: 5)")
    a("--system-prompt-len", type=int, default=400, help="multiturn: the system prompt every session shares "
      "(default: 400 tokens); each user turn is --short-prompt-len long, each answer --output-len")
    a("--think-time", type=float, default=2.0, help="multiturn: seconds between an answer and the next turn")
    a("--dataset-path", default=None, help="sharegpt: a ShareGPT JSON file; mooncake: a Mooncake trace (JSON lines)")
    a("--trace-block-size", type=int, default=512, help="mooncake: tokens per trace block, fewer: a smaller copy")
    a("--trace-max-output-len", type=int, default=None, help="mooncake: cap on outputs (default: the trace's)")
    a("--api-key", default=None, help="the router's API key (default: $TANDEM_AUTH_TOKEN)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else FULL
    pick = lambda value, default: default if value is None else value  # noqa: E731
    s = Settings(
        rates=list(pick(args.request_rate, base.rates)), num_prompts=pick(args.num_prompts, base.num_prompts),
        short_prompt_len=tuple(pick(args.short_prompt_len, base.short_prompt_len)),
        long_prompt_len=tuple(pick(args.long_prompt_len, base.long_prompt_len)),
        output_len=tuple(pick(args.output_len, base.output_len)),
        long_fraction=pick(args.long_fraction, base.long_fraction),
        kv_cache_memory_gib=pick(args.kv_cache_memory_gib, base.kv_cache_memory_gib),
        overhead_requests=pick(args.overhead_requests, base.overhead_requests),
        budgets=list(pick(args.colocated_budgets, base.budgets)), slo_probes=pick(args.slo_probes, base.slo_probes),
    )
    if min(s.rates) <= 0 or s.num_prompts < 1 or s.overhead_requests < 1:
        raise ValueError("request rates must be > 0, --num-prompts and --overhead-requests >= 1")
    if min(s.budgets) < 1 or s.slo_probes < 0 or args.retries < 0 or not 0 < args.slo_attainment <= 1:
        raise ValueError("--colocated-budgets must be >= 1, --slo-probes and --retries >= 0, --slo-attainment in "
                         "(0, 1]")
    if (args.dataset_name in ("sharegpt", "mooncake")) != (args.dataset_path is not None):
        raise ValueError("--dataset-name sharegpt or mooncake and --dataset-path FILE go together")
    if args.dataset_name == "multiturn" and args.api != "grpc":
        raise ValueError("--dataset-name multiturn drives the gRPC API (each turn resends the answer's token ids)")
    if args.api == "openai" and not args.server:
        raise ValueError("--api openai needs --server HOST:PORT (a running `tandem serve`'s HTTP port): the "
                         "clusters this bench starts itself serve the gRPC API only")
    return s


def cluster_configs(cores: int, colocated_workers: int, worker: WorkerConfig,
                    disagg_policy: str = "auto") -> dict[str, ClusterConfig]:
    """Both modes on the same total torch threads: disaggregated 1 prefill + 1 decode worker
    with cores // 2 threads each (``disagg_policy`` deciding where each prompt is prefilled),
    colocated N workers with cores // N threads each."""
    from tandem.router.cluster import ClusterConfig

    half, per_colocated = max(1, cores // 2), max(1, cores // colocated_workers)
    return {
        "disaggregated": ClusterConfig(num_prefill=1, num_decode=1, name_prefix="bench-d-", disagg_policy=disagg_policy,
                                       worker=replace(worker, num_threads=half)),
        "colocated": ClusterConfig(colocated=colocated_workers, name_prefix="bench-c-",
                                   worker=replace(worker, num_threads=per_colocated)),
    }


def token_pool(tokenizer, vocab_size: int, eos_token: str | None):
    """Ids a random prompt may hold: below the vocab, not added/special, not EOS (a ``tokenizers.Tokenizer``)."""
    from tandem.bench.workload import allowed_token_ids

    excluded = set(tokenizer.get_added_tokens_decoder())
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        excluded.add(tokenizer.token_to_id(eos_token))
    return allowed_token_ids(min(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True)), excluded)


class Bench:
    """One invocation: the workload (the same request shapes at every rate, for every setup)
    and the results so far."""

    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        from tandem.bench.serving.load import Mix, parse_goodput
        from tandem.bench.serving.trace import TraceReplay

        self.args, self.settings = args, settings
        self.slo = parse_goodput(args.goodput)
        self.mix = Mix(settings.short_prompt_len, settings.long_prompt_len, settings.output_len, settings.long_fraction)
        self.shapes: list[Request] | None = None
        """The requests' kinds and lengths, drawn once: rates differ by their rate alone."""
        self.rate_keys: dict[float, int] = {}
        self.pool: np.ndarray | None = None
        """The token ids prompts are drawn from (build_workload)."""
        self.runs: list[dict] = []
        self.slo_search: dict | None = None
        self.overhead: dict[str, dict] = {}
        self.elapsed_s: float | None = None
        self.retries_left = args.retries
        self.discarded: list[dict] = []
        """Runs repeated because other processes took the CPU during them (local.measured_run)."""
        self.model: str | None = None
        """With --api openai, the model every body names (the server's, from GET /v1/models)."""
        self.dataset: list | None = None
        """--dataset-name sharegpt: the requests of every rate."""
        self.trace = TraceReplay.from_args(args, settings.num_prompts) if args.dataset_name == "mooncake" else None
        """--dataset-name mooncake, read here: a bad trace fails before any cluster starts."""

    def build_workload(self, pool) -> None:
        from tandem.bench.serving.load import make_requests

        if self.shapes is None:
            self.pool = pool
            self.shapes = make_requests(self.settings.num_prompts, pool, self.mix, [self.args.seed, SEED_WORKLOAD])

    def use_dataset(self, tokenizer) -> None:
        """--dataset-name sharegpt: its requests at every rate (real text: a rate repeats the
        prompts of the one before, as vLLM's bench does, so its prefix cache may help)."""
        from tandem.bench.serving.vllm_format import sharegpt_requests

        if self.args.dataset_name == "sharegpt" and self.dataset is None:
            self.dataset = sharegpt_requests(self.args.dataset_path, tokenizer, self.settings.num_prompts,
                                             self.args.seed)

    def workload(self, rate: float) -> list:
        """The shared shapes (a trace's requests) with prompt tokens of this rate's own: against
        one --server, a prompt seen at an earlier rate would hit its prefix cache."""
        from tandem.bench.serving.load import with_fresh_tokens

        if self.dataset is not None:
            return self.dataset
        key = self.rate_keys.setdefault(rate, len(self.rate_keys))
        assert self.shapes is not None and self.pool is not None, "build_workload() comes first"
        if self.trace is not None:
            return self.trace.requests(self.pool, [self.args.seed, SEED_WORKLOAD, key])
        return with_fresh_tokens(self.shapes, self.pool, [self.args.seed, SEED_WORKLOAD, key])

    async def warm_up(self, target: str, mode: str, num_workers: int = 1) -> None:
        """Untimed requests, a short and a long prompt per worker at once, so that first-call
        costs stay out of the figures."""
        from tandem.bench.serving.load import make_requests, run_load

        mix = replace(self.mix, output_len=(4, 4), long_fraction=0.5)
        assert self.pool is not None, "build_workload() comes first"
        warm = make_requests(2 * num_workers, self.pool, mix, [self.args.seed, SEED_WARM_UP])
        tag = f"warm-{mode.replace('/', '-')}"  # request ids hold no "/"
        results, _ = await run_load(target, warm, [0.0] * len(warm), tag=tag, desc="warm-up",
                                    timeout=self.args.request_timeout, progress=False, api=self.args.api,
                                    model=self.model)
        for result in results:
            if not result.success:
                raise RuntimeError(f"{mode}: warm-up request failed: {result.error}")

    def overhead_prompts(self) -> list[list[int]]:
        """Short prompts of their own (2 per pair, +2 warm-up), so no call hits another's prefix cache."""
        from tandem.bench.serving.load import Mix, make_requests

        n = 2 * self.settings.overhead_requests + 2
        assert self.pool is not None, "build_workload() comes first"
        return [r.prompt_token_ids for r in make_requests(n, self.pool, Mix((24, 24), (1, 1), (1, 1), 0.0),
                                                          [self.args.seed, SEED_OVERHEAD])]

    async def measure(self, target: str, label: str, rate: float, metrics_url: str | None = None,
                      settle: Callable[[], Awaitable[None]] | None = None) -> dict:
        """One run at ``rate`` -> its metrics, requests and time breakdown (from ``metrics_url``
        scraped before and after; ``settle``: awaited before the second scrape)."""
        from tandem.bench.serving.breakdown import RunScrapes
        from tandem.bench.serving.load import arrival_offsets, result_dicts, run_load, summarize

        scrapes = RunScrapes(metrics_url)
        await scrapes.start()
        tag, desc = f"{label.replace('/', '-')}-r{rate:g}", f"{label} @ {rate:g} req/s"
        if self.args.dataset_name == "multiturn":
            from tandem.bench.serving.multiturn import run_multiturn

            results, duration = await run_multiturn(self, target, rate, tag=tag, desc=desc)
        else:
            requests = self.workload(rate)
            # The same gaps at every rate, scaled (common random numbers; a trace's own gaps).
            offsets = (self.trace.offsets(rate) if self.trace is not None else
                       arrival_offsets(len(requests), rate, self.args.burstiness, [self.args.seed, SEED_ARRIVALS]))
            results, duration = await run_load(
                target, requests, offsets, tag=tag, desc=desc, timeout=self.args.request_timeout,
                max_concurrency=self.args.max_concurrency, api=self.args.api, model=self.model)
        if settle is not None:
            await settle()
        metrics = summarize(results, duration, self.slo)
        logger.info("%s @ %g req/s: %d/%d completed in %.1f s, p99 TPOT %.1f ms, goodput %.3f req/s", label, rate,
                    metrics["completed"], len(results), duration, metrics["tpot_ms"]["p99"] or float("nan"),
                    metrics["goodput"])
        return {"metrics": metrics, "requests": result_dicts(results), **await scrapes.finish()}


async def run_server(bench: Bench) -> None:
    from tandem.model.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(bench.args.model))
    bench.build_workload(token_pool(tok.backend_tokenizer, len(tok), tok.eos_token))
    bench.use_dataset(tok.backend_tokenizer)
    if bench.args.api == "openai":
        from tandem.bench.serving.openai_api import served_model

        bench.model = await served_model(bench.args.server)
    await bench.warm_up(bench.args.server, "server")
    for rate in bench.settings.rates:
        run = await bench.measure(bench.args.server, "server", rate, bench.args.metrics_url)
        bench.runs.append({"mode": "server", "budget": None, "rate": rate, "phase": "sweep", "label": "server", **run})


def run(args: argparse.Namespace) -> int:
    from tandem.bench.serving import plots as serve_plots
    from tandem.bench.serving import report as serve_report
    from tandem.bench.serving import sweep_plots
    from tandem.bench.serving.results import bench_results, save_flat

    settings = settings_from_args(args)
    if args.api_key:  # what both clients send (router.auth.auth_token_from_env)
        os.environ[AUTH_TOKEN_ENV] = args.api_key
    bench = Bench(args, settings)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if getattr(args, "log_level", "INFO").upper() != "DEBUG":  # a line per request: too much next to progress bars
        logging.getLogger("tandem.router").setLevel(logging.WARNING)
    if args.server:
        config = {"server": args.server, "modes": {"server": {"note": "an already running router"}}}
        asyncio.run(run_server(bench))
    else:
        from tandem.bench.serving.local import run_clusters

        config = run_clusters(bench, functools.partial(cluster_configs, disagg_policy=args.disagg_policy))
    results = bench_results(bench, config)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=2))
    plots = [serve_report.write_distributions(results, out_dir), *serve_plots.write_plots(results, out_dir),
             *sweep_plots.write_sweep_plots(results, out_dir)]
    paths = [json_path, *plots, serve_report.write_html(results, out_dir, plots)]
    if args.save_result:
        paths += save_flat(bench, results["runs"])
    serve_plots.print_report(results)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["metrics"]["failed"] == 0 for r in results["runs"]) else 1
