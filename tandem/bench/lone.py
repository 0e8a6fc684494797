"""A lone stream through the whole serving path against the bare engine, side by side.

A lone stream: requests one after another, each a short random prompt (--prompt-len tokens)
and --output-len greedy tokens (EOS ignored). Its time per output token (TPOT: (last token -
first token) / (tokens - 1), as a client sees it) is measured two ways in one run:

- bare: the engine in this process (`LLM`, the default format), stepped by hand: the decode
  step and its detokenizing, nothing else; at each --bare-threads torch thread count;
- served: a fresh `tandem serve` for each measured run (its own process and local Ray; the
  default cluster, and `--colocated`), driven over gRPC from this process: the engine loop,
  each token's frame to the router's inbox socket, the router, gRPC to the client.

The runs alternate (bare, then each mode, the modes' order flipped every --repeats round), so
drift in the machine's speed hits both alike. The table prints each run's median TPOT and its
ratio to the bare engine on all cores (what `tandem bench step --batch-sizes 1` times) and on
the serving worker's own threads. With --threads N it also prints the N threads (of the
server's processes and this one) that took the most CPU per token during the served requests
(serving/thread_cpu.py): where a served token's cycles go beside the step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from pathlib import Path

import numpy as np

from tandem.bench.serving.interference import SUSPECT

logger = logging.getLogger(__name__)

MODES = {"disaggregated": [], "colocated": ["--colocated"]}
"""Each mode's `tandem serve` flags (on top of --serve-arg)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default=None, help="local HF directory or .gguf file (default: the embedded one)")
    a("--modes", nargs="+", choices=tuple(MODES), default=list(MODES), help="served setups (default: both)")
    a("--requests", type=int, default=6, help="measured requests per run, one after another (default 6)")
    a("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    a("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    a("--repeats", type=int, default=2, help="rounds of bare + every mode (default 2)")
    a("--bare-threads", type=int, nargs="+", default=None,
      help="torch threads of the bare engine's runs (default: 1 and all cores)")
    a("--serve-arg", action="append", default=[], metavar="ARG",
      help="one more `tandem serve` argument for every served run (repeat; e.g. --serve-arg=--num-threads=2)")
    a("--env-variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
      help="also serve each mode with these environment variables (repeat for more variants; e.g. "
           "nice0:RAY_worker_niceness=0): the variants run side by side with the plain setup")
    a("--threads", type=int, default=10, metavar="N", help="print the N busiest threads per served run (0: none)")
    a("--seed", type=int, default=0)
    a("--out-dir", default="bench-results/lone", help="where results.json goes")
    a("--quick", action="store_true", help="tiny run: 2 requests of 16 tokens, one round")


def env_variants(given: list[str]) -> dict[str, dict[str, str]]:
    """--env-variant values -> label -> environment; the plain setup ("") first."""
    variants: dict[str, dict[str, str]] = {"": {}}
    for spec in given:
        label, _, pairs = spec.partition(":")
        if not label or not pairs or any("=" not in p for p in pairs.split(",")):
            raise ValueError(f"--env-variant {spec!r}: expected LABEL:KEY=VALUE[,KEY=VALUE]")
        variants[label] = dict(p.split("=", 1) for p in pairs.split(","))
    return variants


def worker_threads(mode: str, cores: int, serve_args: list[str]) -> int:
    """The torch threads the mode's streaming worker gets: --num-threads, else cores / workers."""
    for i, arg in enumerate(serve_args):
        if arg.startswith("--num-threads"):
            return int(arg.split("=", 1)[1] if "=" in arg else serve_args[i + 1])
    return max(1, cores // (1 if mode == "colocated" else 2))


def prompts(pool: np.ndarray, rng: np.random.Generator, count: int, length: int) -> list[list[int]]:
    return [rng.choice(pool, size=length).tolist() for _ in range(count)]


def bare_tpots(llm, prompts_: list[list[int]], output_len: int, tag: str) -> list[float]:
    """The engine stepped in this process, one request at a time -> each request's TPOT (ms)."""
    from tandem.sampling_params import SamplingParams

    engine, tpots = llm.engine, []
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts_):
        engine.add_request(f"{tag}-{i}", prompt, params)
        first = last = None
        tokens = 0
        while engine.has_unfinished:
            for delta in engine.step():
                if delta.new_token_ids:
                    last = time.perf_counter()
                    first = last if first is None else first
                    tokens += len(delta.new_token_ids)
        assert first is not None and last is not None and tokens > 1, "a request made no tokens"
        tpots.append((last - first) / (tokens - 1) * 1e3)
    return tpots


async def _served_tpots(target: str, prompts_: list[list[int]], output_len: int, tag: str,
                        processes: dict[int, str], busiest: int) -> tuple[list[float], float, list, float]:
    from tandem.bench.serving.interference import CpuWatch
    from tandem.bench.serving.load import Request, grpc_client
    from tandem.bench.serving.thread_cpu import cpu_by_thread, snapshot

    tpots, messages = [], 0
    async with grpc_client(target, timeout=600) as send:
        warm = await send(Request(prompts_[0], 8, "short"), 0, f"{tag}-warm")
        if not warm.success:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        before = snapshot(processes)
        watch = CpuWatch([pid for pid in processes if pid != os.getpid()])
        watch.start()
        for i, prompt in enumerate(prompts_[1:]):
            result = await send(Request(prompt, output_len, "short"), i, f"{tag}-{i}")
            if not result.success or result.tpot_ms is None:
                raise RuntimeError(f"request {i} failed: {result.error}")
            tpots.append(result.tpot_ms)
            messages += result.num_chunks
        after = snapshot(processes)
        others = watch.stop()
    tokens = output_len * len(tpots)
    per_token = [(label, name, s / tokens * 1e3) for label, name, s in cpu_by_thread(before, after)[:busiest]]
    return tpots, tokens / messages, per_token, others


def served_run(mode: str, serve_args: list[str], env: dict[str, str], prompts_: list[list[int]], output_len: int,
               tag: str, busiest: int) -> dict:
    """A fresh `tandem serve` of ``mode``: one warm-up request, then ``prompts_[1:]`` one after
    another -> the median TPOT (ms), each request's, output tokens per message the client got,
    the ``busiest`` threads' CPU ms per token, the server's start-up seconds, and the share of the
    CPU other processes took meanwhile (interference.py: 0.1 or more makes the run suspect)."""
    from tandem.bench.serving.served_process import ServedProcess

    server = ServedProcess([*MODES[mode], *serve_args], env)
    t0 = time.perf_counter()
    target = server.start()
    started_s = time.perf_counter() - t0
    try:
        processes = {**server.processes(), os.getpid(): "bench client"}
        tpots, per_message, threads, others = asyncio.run(_served_tpots(target, prompts_, output_len, tag, processes,
                                                                busiest))
    finally:
        server.stop()
    return {"tpot_ms": _median(tpots), "tpots": tpots, "tokens_per_message": per_message, "busiest": threads,
            "server_start_s": started_s, "others_cpu": others}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _quiet(run: dict, cores: int) -> bool:
    """Whether other processes took less than SUSPECT of the CPU in both halves of a pair: on
    a shared machine they halve a 2-thread step's speed (or worse), so a ratio with them is noise."""
    return run["others_cpu"] < SUSPECT and run["bare_others_cpu"].get(str(cores), 0.0) < SUSPECT


def report(runs: list[dict], cores: int, setups: list[str]) -> None:
    """Each served run beside the bare runs just before it, their ratios, and per setup the
    median ratio over the rounds."""
    print("\nlone stream: TPOT (ms, median over the run's requests) as a client sees it; each served run beside "
          "the bare runs just before it")
    print(f"{'round':>5} {'served setup':<28} {'thr':>3} {'served':>7} {'tok/msg':>7} {'bare all':>8} {'ratio':>6} "
          f"{'bare same thr':>13} {'ratio':>6} {'others CPU':>10} {'(bare)':>6}")
    for r in runs:
        bare_all, bare_same = r["bare_ms"].get(str(cores)), r["bare_ms"].get(str(r["threads"]))
        ratio = lambda b: f"{r['tpot_ms'] / b:.2f}x" if b else ""  # noqa: E731
        print(f"{r['round']:>5} {r['setup'][:28]:<28} {r['threads']:>3} {r['tpot_ms']:>7.2f} "
              f"{r['tokens_per_message']:>7.2f} {bare_all or 0:>8.2f} {ratio(bare_all):>6} {bare_same or 0:>13.2f} "
              f"{ratio(bare_same):>6} {r['others_cpu']:>10.0%} {r['bare_others_cpu'].get(str(cores), 0):>6.0%}")
    for setup in setups:
        ratios = [r["tpot_ms"] / r["bare_ms"][str(cores)] for r in runs if r["setup"] == setup and _quiet(r, cores)]
        left_out = sum(1 for r in runs if r["setup"] == setup and not _quiet(r, cores))
        note = (f", {left_out} run(s) left out: other processes took {SUSPECT:.0%} of the CPU or more"
                if left_out else "")
        summary = f"{_median(ratios):.2f}x" if ratios else "none to take"
        print(f"{setup}: served / bare on all {cores} cores, median over {len(ratios)} round(s): {summary} "
              f"(goal: at most 1.10x){note}")
    for r in runs:
        if r.get("busiest"):
            print(f"\nround {r['round']}, served {r['setup']}: CPU ms per output token by thread (busiest first)")
            for label, name, ms in r["busiest"]:
                print(f"  {label:<40} {name:<24} {ms:7.2f}")


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench.serving.interference import CpuWatch
    from tandem.bench.workload import allowed_token_ids
    from tandem.llm import LLM

    if args.quick:
        args.requests, args.output_len, args.repeats = 2, 16, 1
    variants = env_variants(args.env_variant)
    cores = len(os.sched_getaffinity(0))
    bare_threads = args.bare_threads or sorted({1, cores})
    llm = LLM(args.model, kv_cache_memory_gib=0.25)
    # Plain tokens only (no special, added or EOS id), as `tandem bench serve` draws them.
    assert llm.tokenizer is not None, "the served model needs a tokenizer: the router tokenizes"
    pool = allowed_token_ids(llm.engine.config.model.vocab_size, llm.tokenizer.all_special_ids)
    rng = np.random.default_rng(args.seed)
    runs: list[dict] = []
    setups = [(mode, label) for mode in args.modes for label in variants]
    for rnd in range(args.repeats):
        batch = prompts(pool, rng, args.requests + 1, args.prompt_len)  # the first is the warm-up
        for mode, label in setups if rnd % 2 == 0 else list(reversed(setups)):
            bare, bare_others = {}, {}
            for threads in bare_threads:  # right before the served run: the same machine state
                torch.set_num_threads(threads)
                bare_tpots(llm, batch[:1], 8, f"warm-{rnd}-{threads}")
                watch = CpuWatch([])
                watch.start()
                bare[str(threads)] = _median(bare_tpots(llm, batch[1:], args.output_len, f"bare-{rnd}-{threads}"))
                bare_others[str(threads)] = watch.stop()
            torch.set_num_threads(cores)
            setup = f"{mode} {label}".strip()
            served = served_run(mode, args.serve_arg, variants[label], batch, args.output_len, f"{mode}-{label}-{rnd}",
                                args.threads)
            runs.append({"round": rnd, "setup": setup, "threads": worker_threads(mode, cores, args.serve_arg),
                         "bare_ms": bare, "bare_others_cpu": bare_others, **served})
            logger.info("round %d, %s: served %.2f ms a token, bare %s", rnd, setup, served["tpot_ms"],
                        ", ".join(f"{t} thread(s) {ms:.2f}" for t, ms in bare.items()))
    report(runs, cores, [f"{m} {v}".strip() for m, v in setups])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"cores": cores, "args": vars(args), "runs": runs}, indent=1))
    return 0
