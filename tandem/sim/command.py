"""``tandem simulate``: tandem's own control plane (router policies, admission, the prefill
decision, each worker's scheduler, prefill packing, block manager and preemption) on a
virtual clock, the forward replaced by a step-time model (``--gpu NAME``: a spec-sheet
roofline; else a fit of this machine's CPU steps) and the KV transfer by bytes over a link.

The workload is ``tandem bench serve``'s (the same seeded mix and arrivals, its flags and
defaults) or a Mooncake trace (``--trace``); each run is reported as the bench reports one,
plus each prefill decision, each request's time by phase and the speed factor."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict
from typing import Any

from tandem.config import ModelConfig, gib_to_bytes
from tandem.config.engine_options import ENGINE_DEFAULTS, MODEL_HELP
from tandem.sim.console import say
from tandem.sim.spec import ClusterSpec, PoolSpec, SimRequest, StepTimeModel

logger = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")
DEFAULT_LINK_GB_S = ClusterSpec.link_bytes_per_s / 1e9


def add_args(parser: argparse.ArgumentParser) -> None:
    """``tandem simulate``'s flags (the bench's workload flags by the bench's names and defaults)."""
    from tandem.bench.serve import DEFAULT_SLO, FULL
    from tandem.router.disagg import DEFAULT_MAX_LOCAL_STALL_S, DISAGG_POLICIES
    from tandem.router.policy import POLICIES

    a = parser.add_argument
    a("--mode", choices=MODES, default="disaggregated", help="the cluster's shape (default %(default)s)")
    a("--prefill", type=int, default=1, help="prefill workers (default 1; 0: every prompt prefilled locally)")
    a("--decode", type=int, default=1, help="decode workers (default 1)")
    a("--colocated", type=int, default=1, help="colocated workers, with --mode colocated (default 1)")
    a("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N", help="ranks per worker (default 1)")
    a("--prefill-tp", type=int, default=None, metavar="N", help="ranks per prefill worker (default: -tp)")
    a("--decode-tp", type=int, default=None, metavar="N", help="ranks per decode or colocated worker (default: -tp)")
    a("--policy", choices=POLICIES, default="least_loaded", help="how the router picks workers (default %(default)s)")
    a("--disagg-policy", choices=tuple(DISAGG_POLICIES), default="auto",
      help="where each prompt is prefilled, as tandem serve's flag (default %(default)s)")
    a("--max-local-stall-ms", type=float, default=DEFAULT_MAX_LOCAL_STALL_S * 1e3, metavar="MS",
      help="auto: the most a local prefill may add to a decode worker's streams (default %(default)g)")
    a("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS["max_num_batched_tokens"],
      help="token budget of a step (default %(default)s)")
    a("--max-num-seqs", type=int, default=ENGINE_DEFAULTS["max_num_seqs"], help="default %(default)s")
    a("--block-size", type=int, default=ENGINE_DEFAULTS["block_size"], help="default %(default)s")
    a("--num-kv-blocks", type=int, default=None, help="KV blocks of each worker (default: --kv-cache-memory-gib's)")
    a("--kv-cache-memory-gib", type=float, default=FULL.kv_cache_memory_gib,
      help="KV pool of each worker when --num-kv-blocks is not given (default %(default)s, the bench's)")
    a("--model", default=None, help=MODEL_HELP)
    a("--model-config", default=None, metavar="CONFIG_JSON", help="a model's config.json: its shape instead of "
      "--model's (random prompt tokens below its vocabulary)")
    a("--gpu", default=None, metavar="NAME", help="price steps by this GPU's roofline (tandem/sim/gpus.py); "
      "default: the CPU fit of this machine")
    a("--step-fit", default=None, metavar="JSON", help="the CPU fit to use as it is (default: the cached one, "
      "measured again when it is for another machine, model or thread count)")
    a("--num-threads", type=int, default=1, help="torch threads of the CPU fit's worker (default 1)")
    a("--link-gb-s", type=float, default=None, help="prefill -> decode KV bandwidth, GB/s (default: the GPU's "
      f"link in one direction with --gpu, else {DEFAULT_LINK_GB_S:g})")
    a("--link-latency-us", type=float, default=ClusterSpec.link_latency_s * 1e6, help="default %(default)g")
    a("--router-overhead-ms", type=float, default=0.0, help="added to each request's way in (default 0)")
    a("--trace", default=None, metavar="JSONL", help="a Mooncake trace instead of the bench's mix")
    a("--trace-time-scale", type=float, default=1.0, help="arrival times x this (default 1)")
    a("--request-rate", type=float, nargs="+", default=FULL.rates, help="requests/s of each run, 'inf' all at "
      "once (default: %(default)s, the bench's)")
    a("--num-prompts", type=int, default=None, help=f"requests per run (default {FULL.num_prompts}, the bench's; "
      "with --trace: its first N, default all)")
    add_mix_args(parser)
    a("--goodput", nargs="+", default=DEFAULT_SLO, metavar="KEY:MS", help="the SLO in ms, keys ttft tpot e2el "
      f"(default: {' '.join(DEFAULT_SLO)})")
    a("--json", default=None, metavar="FILE", help="also write every run's report here")
    a("--validate", default=None, metavar="RESULTS_JSON", help="simulate each run of a `tandem bench serve` "
      "results.json (same workload, cluster and policy; the CPU fit of its threads per worker) and print the "
      "simulated TTFT and TPOT p50 and p90 beside the real ones")
    a("--calibrate", default=None, metavar="RESULTS_JSON", help="fit what a served step costs beyond the same "
      "step alone (a scale and an overhead per thread count) on a `tandem bench serve` results.json and keep it "
      "in the CPU fits; check it with --validate on another run's results")


def add_mix_args(parser: argparse.ArgumentParser) -> None:
    """The bench's mix and arrival flags, by its names and defaults (simulate and plan --slo)."""
    from tandem.bench.serve import FULL

    a = parser.add_argument
    a("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier")
    a("--short-prompt-len", type=int, nargs=2, default=FULL.short_prompt_len, metavar=("MIN", "MAX"))
    a("--long-prompt-len", type=int, nargs=2, default=FULL.long_prompt_len, metavar=("MIN", "MAX"))
    a("--output-len", type=int, nargs=2, default=FULL.output_len, metavar=("MIN", "MAX"))
    a("--long-fraction", type=float, default=FULL.long_fraction, help="share of long prompts (default %(default)s)")
    a("--seed", type=int, default=0)


def mix_of(args: argparse.Namespace):
    """add_mix_args' flags as a tandem.bench.serving.load.Mix."""
    from tandem.bench.serving.load import Mix

    return Mix(tuple(args.short_prompt_len), tuple(args.long_prompt_len), tuple(args.output_len), args.long_fraction)


def model_shape(args: argparse.Namespace) -> ModelConfig:
    if args.model_config is None:
        from tandem.plan import read_model_shape

        return read_model_shape(args.model)
    with open(args.model_config, encoding="utf-8") as f:
        cfg = json.load(f)
    name = os.path.basename(os.path.dirname(os.path.abspath(args.model_config))) or "model"
    try:
        return ModelConfig.from_config_dict(cfg, name, where=args.model_config)
    except KeyError as e:
        raise ValueError(f"{args.model_config} has no {e.args[0]!r}") from None


def step_model_of(args: argparse.Namespace, shape: ModelConfig) -> tuple[StepTimeModel, str, str]:
    """-> (the step-time model, the engines' dtype, a line saying what it is)."""
    if args.gpu is not None:
        from tandem.sim.roofline import RooflineStepModel

        model = RooflineStepModel(args.gpu, shape, "bfloat16")
        return model, "bfloat16", f"roofline of {model.gpu.name} ({model.gpu.interconnect}), bfloat16"
    from tandem.sim.step_time import CpuStepModel, load_or_measure

    fit = (CpuStepModel.from_json(args.step_fit) if args.step_fit is not None
           else load_or_measure(None, args.model, args.num_threads))
    if args.model_config is not None:
        logger.warning("the CPU fit was measured on %s, not on %s's shape", fit.meta.get("model", "another model"),
                       args.model_config)
    err = fit.meta.get("held_out_error", {}).get("median")
    about = f", median held-out error {err:.0%}" if err is not None else ""
    return fit, fit.meta.get("dtype", "float32"), f"CPU fit ({fit.meta.get('num_threads', '?')} thread(s){about})"


def cluster_spec(args: argparse.Namespace, shape: ModelConfig, dtype: str) -> ClusterSpec:
    def pool(num_workers: int, tp: int) -> PoolSpec:
        blocks = args.num_kv_blocks
        if blocks is None:  # as EngineConfig.build sizes a pool from kv_cache_memory_gib
            blocks = gib_to_bytes(args.kv_cache_memory_gib) // (args.block_size * shape.kv_bytes_per_token(dtype, tp))
        return PoolSpec(num_workers, tp, args.max_num_seqs, args.max_num_batched_tokens, blocks, args.block_size)

    tp = args.tensor_parallel_size
    decode_tp = args.decode_tp or tp
    if args.link_gb_s is not None:
        link = args.link_gb_s * 1e9
    elif args.gpu is not None:
        from tandem.sim.gpus import gpu

        link = gpu(args.gpu).link_bytes_per_s
    else:
        link = ClusterSpec.link_bytes_per_s
    common = dict(disagg_policy=args.disagg_policy, max_local_stall_s=args.max_local_stall_ms / 1e3,
                  routing_policy=args.policy, link_bytes_per_s=link, link_latency_s=args.link_latency_us / 1e6,
                  router_overhead_s=args.router_overhead_ms / 1e3)
    if args.mode == "colocated":
        return ClusterSpec("colocated", colocated=pool(args.colocated, decode_tp), **common)
    return ClusterSpec("disaggregated", prefill=pool(args.prefill, args.prefill_tp or tp),
                       decode=pool(args.decode, decode_tp), **common)


def workloads(args: argparse.Namespace, shape: ModelConfig) -> list[tuple[float, list[SimRequest]]]:
    """-> (rate, requests) per run: the trace once (its mean rate), or the bench's mix per --request-rate."""
    if args.trace is not None:
        from tandem.sim.traces import read_mooncake_trace

        requests = read_mooncake_trace(args.trace, vocab_size=shape.vocab_size, time_scale=args.trace_time_scale,
                                       limit=args.num_prompts)
        if not requests:
            raise ValueError(f"{args.trace} holds no requests")
        span = requests[-1].arrival_s - requests[0].arrival_s
        return [(len(requests) / span if span > 0 else float("inf"), requests)]
    from tandem.bench.serve import FULL
    from tandem.sim.traces import bench_mix_requests, bench_token_pool

    mix = mix_of(args)
    token_ids = None if args.model_config is not None else bench_token_pool(args.model)
    num = FULL.num_prompts if args.num_prompts is None else args.num_prompts
    return [(rate, bench_mix_requests(num, rate, args.burstiness, args.seed, mix,
                                      vocab_size=shape.vocab_size, token_ids=token_ids, rate_index=i))
            for i, rate in enumerate(args.request_rate)]


def print_sim(report, spec: ClusterSpec) -> None:
    """What only a simulation sees, after the bench's report of the run."""
    from tandem.sim.run import PHASES

    if report.decisions:
        say("prefill decisions: " + ", ".join(f"{k} {n}" for k, n in report.decisions.items()))
    say(f"{'time by phase (ms)':<24}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    for phase in PHASES:
        s = report.breakdown[phase]
        if spec.mode == "colocated" and phase == "transfer":
            continue
        say(f"  {phase:<22}" + "".join(f"{fmt(s[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    for name, w in report.workers.items():
        say(f"  {name}: {w['steps']} steps, busy {w['busy']:.0%}, {w['preemptions']} preemptions, "
              f"{w['prefix_hit_tokens']} prefix-hit tokens")
    say(f"simulated {report.sim_s:.2f} s in {report.wall_s:.3f} s: {report.speed_factor:.0f}x real time")


def validate(args: argparse.Namespace) -> int:
    from tandem.sim.step_time import CpuStepModel, default_fit_path, load_or_measure
    from tandem.sim.traces import bench_token_pool
    from tandem.sim.validate import calibrate, compare_runs, error_summary, table

    with open(args.validate or args.calibrate, encoding="utf-8") as f:
        results = json.load(f)
    shape = model_shape(args)
    token_ids = bench_token_pool(args.model)
    fits: dict[int, CpuStepModel] = {}

    def fit_path(num_threads: int):
        return default_fit_path().with_name(f"step_fit-{num_threads}t.json")  # one kept file per thread count

    def fit_for(num_threads: int) -> CpuStepModel:
        if num_threads not in fits:
            fits[num_threads] = load_or_measure(fit_path(num_threads), args.model, num_threads)
        return fits[num_threads]
    if args.calibrate is not None:
        for mode in results["config"]["modes"].values():
            fit_for(mode["threads_per_worker"])
        found = calibrate(results, shape, fits, token_ids)
        for threads, serving in found.items():
            fits[threads].meta["serving"] = {**serving, "from": os.path.abspath(args.calibrate)}
            fits[threads].to_json(fit_path(threads))
            say(f"{threads} thread(s) per worker: a served step = {serving['scale']:g} x the step alone + "
                  f"{serving['step_overhead_s'] * 1e3:g} ms (median error {serving['median_error']:.1%} on these runs)")
        return 0
    comparisons = compare_runs(results, shape, fit_for, token_ids)
    say(table(comparisons))
    summary = error_summary(comparisons)
    say(f"\n|error|: median {summary['median']:.1%}, max {summary['max']:.1%} over {summary['count']} values")
    return 0


def run(args: argparse.Namespace) -> int:
    from tandem.bench.serving.load import parse_goodput, result_dicts

    if args.validate is not None or args.calibrate is not None:
        return validate(args)
    from tandem.bench.serving.plots import print_run
    from tandem.sim.run import simulate

    slo = parse_goodput(args.goodput)
    shape = model_shape(args)
    step_model, dtype, about = step_model_of(args, shape)
    spec = cluster_spec(args, shape, dtype)
    if spec.colocated is not None:
        pools, some = [f"{spec.colocated.num_workers} colocated"], spec.colocated
    else:
        assert spec.prefill is not None and spec.decode is not None  # disaggregated: both pools
        pools, some = [f"{spec.prefill.num_workers} prefill", f"{spec.decode.num_workers} decode"], spec.decode
    say(f"\n== tandem simulate: {shape.name}, {' + '.join(pools)} worker(s), {some.num_kv_blocks} KV blocks of "
          f"{some.block_size}, budget {some.max_num_batched_tokens} tokens, routing {spec.routing_policy}"
          + (f", disagg {spec.disagg_policy}" if spec.mode == "disaggregated" else "") + " ==")
    say(f"steps: {about}; KV link {spec.link_bytes_per_s / 1e9:g} GB/s + {spec.link_latency_s * 1e6:g} us")
    runs: list[dict[str, Any]] = []
    for rate, requests in workloads(args, shape):
        report = simulate(spec, requests, step_model, shape, slo, dtype)
        print_run({"mode": spec.mode, "budget": None, "rate": rate, "metrics": report.metrics})
        print_sim(report, spec)
        runs.append({"rate": rate, "metrics": report.metrics, "decisions": report.decisions,
                     "breakdown": report.breakdown, "workers": report.workers, "sim_s": report.sim_s,
                     "wall_s": report.wall_s, "speed_factor": report.speed_factor,
                     "requests": result_dicts(report.results)})
    if args.json is not None:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"spec": asdict(spec), "steps": about, "runs": runs}, f, indent=2)
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1
