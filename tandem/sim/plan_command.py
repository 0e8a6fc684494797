"""``tandem plan --slo ttft:MS tpot:MS``: the placement (mode, policy, pools' sizes and TP,
step budget, batch limit) with the highest goodput per GPU for a workload, by simulation
(tandem.sim.plan_search), printed as a table, a ``tandem serve`` command line and Helm values.
``--distserve`` runs DistServe's OPT-13B chatbot case (DISTSERVE below)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from tandem.sim.console import say
from tandem.sim.plan_search import MEMORY_FRACTION, Candidate, Hardware, Outcome, PlanSearch, Settings

logger = logging.getLogger(__name__)

DISTSERVE: dict[str, Any] = {
    "model_config": "llama-2-13b.json", "serve_model": "meta-llama/Llama-2-13b-hf", "dataset": "chatbot",
    "slo": ["ttft:250", "tpot:100"], "gpu": "A100-80GB", "dtype": "float16",
}
"""DistServe's OPT-13B / ShareGPT case (LLMServe/DistServe evaluation/ae-scripts/e2e/_plot.py:
"opt-13b-sharegpt", TTFT 0.25 s, TPOT 0.1 s, 90% attainment), with a Llama-2-13B shape standing
in for OPT-13B (tandem reads Llama-family configs) and our ShareGPT-like lengths."""
DISTSERVE_PUBLISHED = ("DistServe (published): up to 4.48x goodput over vLLM across its workloads (blog, arXiv v1); "
                       "its OPT-13B/ShareGPT artifact runs prefill TP2 + decode TP1 (3 GPUs) against vLLM TP1 "
                       "(1 GPU), compared per GPU")
DISTSERVE_PLACEMENTS = (Candidate("disaggregated", "always", 1, 2, 1, 1, 8192, 256),
                        Candidate.colocated(1, 1, 2048, 256))
"""DistServe's placement (its context budget 8192 tokens) and vLLM's (TP1), searched in full."""


def add_args(parser: argparse.ArgumentParser) -> None:
    """The --slo search's flags, added to ``tandem plan``'s."""
    from tandem.sim.command import add_mix_args
    from tandem.sim.workloads import DATASETS

    a = parser.add_argument
    a("--slo", nargs="+", default=None, metavar="KEY:MS", help="search placements by simulation for the highest "
      "request rate per GPU with --slo-attainment of requests within these bounds (keys ttft tpot e2el)")
    a("--distserve", action="store_true", help="DistServe's OPT-13B chatbot case: Llama-2-13B shape, "
      "ShareGPT-like lengths, ttft:250 tpot:100, A100-80GB, float16; prints its published figure beside ours")
    a("--model-config", default=None, metavar="CONFIG_JSON", help="--slo: a model's config.json instead of --model")
    a("--gpu", default=None, metavar="NAME", help="--slo: price steps by this GPU's roofline (tandem/sim/gpus.py)")
    a("--num-gpus", type=int, default=8, help="--slo: GPUs to place on (default %(default)s)")
    a("--slo-attainment", type=float, default=0.9, help="share of requests within the SLO (default %(default)s)")
    a("--trace", default=None, metavar="JSONL", help="--slo workload: a Mooncake trace (its first --num-prompts)")
    a("--dataset", choices=DATASETS, default=None, help="--slo workload: chatbot = ShareGPT-like lengths "
      "(tandem/sim/workloads.py); default: the bench's mix (its flags below)")
    a("--num-prompts", type=int, default=150, help="requests per probe (default %(default)s)")
    add_mix_args(parser)
    a("--budgets", type=int, nargs="+", default=list(Settings.budgets), help="max_num_batched_tokens values to "
      "search (default %(default)s)")
    a("--batch-limits", type=int, nargs="+", default=list(Settings.max_seqs), help="max_num_seqs values to search "
      "(default %(default)s)")
    a("--modes", nargs="+", choices=Settings.modes, default=list(Settings.modes),
      help="colocated, disaggregated always, disaggregated auto (default: all)")
    a("--max-probes", type=int, default=Settings.max_probes, help="simulated runs per configuration at most "
      "(default %(default)s)")
    a("--top", type=int, default=10, help="rows of the table (default %(default)s)")
    a("--json", nargs="?", const="-", default=None, metavar="FILE", help="also write the search as JSON "
      "(no FILE: to stdout, instead of the text)")


def apply_preset(args: argparse.Namespace) -> None:
    """--distserve: DISTSERVE's settings over the flags."""
    args.model_config = str(resources.files("tandem.sim") / "data" / DISTSERVE["model_config"])
    args.model, args.trace, args.dataset = None, None, DISTSERVE["dataset"]
    args.slo, args.gpu, args.dtype = DISTSERVE["slo"], DISTSERVE["gpu"], DISTSERVE["dtype"]


def build_search(args: argparse.Namespace, on_probe: Callable[[Candidate, dict], None] | None = None,
                 ) -> tuple[PlanSearch, dict[str, float]]:
    """The flags -> the search (not run) and the SLO."""
    from tandem.bench.serving.load import parse_goodput
    from tandem.config.names import AUTO, auto_dtype_name
    from tandem.sim import workloads
    from tandem.sim.command import mix_of, model_shape
    from tandem.sim.gpus import gpu
    from tandem.sim.roofline import RooflineStepModel

    if args.gpu is None:
        raise ValueError("--slo needs --gpu NAME: the search prices steps by a GPU's roofline")
    try:
        slo = parse_goodput(args.slo)
    except ValueError as e:
        raise ValueError(str(e).replace("--goodput", "--slo")) from None
    if not 0 < args.slo_attainment <= 1 or args.num_gpus < 1 or args.num_prompts < 2 or args.max_probes < 1:
        raise ValueError("--slo-attainment must be in (0, 1], --num-gpus and --max-probes >= 1, --num-prompts >= 2")
    shape = model_shape(args)
    if args.model_config is not None and os.path.basename(args.model_config) != "config.json":
        shape = dataclasses.replace(shape, name=os.path.splitext(os.path.basename(args.model_config))[0])
    dtype = auto_dtype_name("cuda") if args.dtype == AUTO else args.dtype
    hw = Hardware(gpu(args.gpu), shape, dtype, args.block_size)
    if args.trace is not None:
        workload = workloads.trace_workload(args.trace, args.num_prompts, shape.vocab_size)
    elif args.dataset == "chatbot":
        workload = workloads.chatbot_workload(args.num_prompts, shape.vocab_size, args.seed, args.burstiness)
    else:
        workload = workloads.bench_mix_workload(args.num_prompts, shape.vocab_size, mix_of(args), args.seed,
                                                args.burstiness)
    settings = Settings(args.num_gpus, tuple(args.budgets), tuple(args.batch_limits), args.slo_attainment,
                        args.max_probes, tuple(args.modes))
    return PlanSearch(workload, RooflineStepModel(hw.gpu, shape, dtype), hw, slo, settings, on_probe), slo


def serve_model(args: argparse.Namespace) -> str | None:
    """The model the serve command names: --model, DistServe's hub id, a --model-config
    config.json's directory (MODEL for another file), or None (the embedded default)."""
    if args.model is not None or args.model_config is None:
        return args.model
    if args.distserve:
        return DISTSERVE["serve_model"]
    if os.path.basename(args.model_config) == "config.json":
        return os.path.dirname(os.path.abspath(args.model_config))
    return "MODEL"


def serve_argv(c: Candidate, model: str | None, dtype: str, block_size: int = 16,
               routing: str = "least_loaded") -> list[str]:
    """``tandem serve``'s command line for cluster ``c`` on GPUs (each rank a whole GPU, the KV
    pool from MEMORY_FRACTION of its memory, as the search sized it); model None: the default."""
    argv = ["tandem", "serve", *(["--model", model] if model else []), "--policy", routing]
    if c.mode == "colocated":
        argv += ["--colocated", str(c.decode), "--decode-tp", str(c.decode_tp)]
    else:
        argv += ["--prefill", str(c.prefill), "--decode", str(c.decode), "--prefill-tp", str(c.prefill_tp),
                 "--decode-tp", str(c.decode_tp), "--disagg-policy", c.policy or "always"]
    argv += ["--max-num-batched-tokens", str(c.budget), "--max-num-seqs", str(c.max_seqs), "--device", "cuda",
             "--dtype", dtype, "--gpu-memory-utilization", str(MEMORY_FRACTION), "--gpus-per-worker", "1"]
    return argv + (["--block-size", str(block_size)] if block_size != 16 else [])


def helm_values(c: Candidate, model: str | None, dtype: str, routing: str = "least_loaded") -> dict:
    """deploy/helm/tandem values for cluster ``c`` (on top of values-gpu.yaml): replicas and tp
    per pool, a GPU per rank, the engine's budget and batch limit, the policy as a serve flag."""
    def pool(replicas: int, tp: int) -> dict:
        cpus = str(max(4, tp))  # the chart wants a CPU per rank; values-gpu.yaml gives 4
        return {"replicas": replicas, "tp": tp, "resources": {"requests": {"cpu": cpus},
                                                              "limits": {"cpu": cpus, "nvidia.com/gpu": tp}}}

    values: dict = {"model": model or "", "mode": c.mode, "policy": routing}
    if c.mode == "colocated":
        values["colocated"] = pool(c.decode, c.decode_tp)
    else:
        values["pools"] = {"prefill": pool(c.prefill, c.prefill_tp), "decode": pool(c.decode, c.decode_tp)}
    values["engine"] = {"dtype": dtype, "maxNumBatchedTokens": c.budget, "maxNumSeqs": c.max_seqs}
    extra = ["--gpu-memory-utilization", str(MEMORY_FRACTION)]
    values["router"] = {"extraArgs": extra + (["--disagg-policy", c.policy] if c.policy else [])}
    return values


def table(outcomes: list[Outcome], top: int) -> list[str]:
    """The table's lines: the best ``top`` by rate per GPU, pruned ones as upper bounds."""
    rows = [f"{'#':>3} {'mode':<14}{'policy':<8}{'prefill / decode (n x tp)':<27}{'budget':>7}{'seqs':>6}"
            f"{'GPUs':>6}{'max rate':>11}{'per GPU':>9}"]
    ranked = sorted(outcomes, key=lambda o: (o.score, -o.pruned), reverse=True)
    for i, o in enumerate(ranked[:top], 1):
        c = o.candidate
        pools = f"{c.decode} x {c.decode_tp}" if c.mode == "colocated" else \
            f"{c.prefill} x {c.prefill_tp} / {c.decode} x {c.decode_tp}"
        if o.max_rate is not None:
            rate, per = f"{'>=' if o.bound == 'lower' else ''}{o.max_rate:.2f}", f"{o.score:.2f}"
        else:
            below = min(p["rate"] for p in o.probes) if o.probes else 0.0
            rate, per = f"<{below:.2f}", f"<{below / c.gpus:.2f}"
        rows.append(f"{i:>3} {c.mode:<14}{c.policy or '-':<8}{pools:<27}{c.budget:>7}{c.max_seqs:>6}"
                    f"{c.gpus:>6}{rate:>11}{per:>9}")
    rows.append(f"({len(outcomes)} configurations, {sum(len(o.probes) for o in outcomes)} simulated runs; "
                f"{sum(o.pruned for o in outcomes)} stopped after failing at their family's best rate per GPU)")
    return rows


def run(args: argparse.Namespace) -> int:
    """``tandem plan --slo``: search, then print (or --json) the outcome."""
    import yaml
    from tqdm.auto import tqdm

    if args.distserve:
        apply_preset(args)
    bar = tqdm(desc="plan --slo", unit="run", file=sys.stderr)

    def on_probe(c: Candidate, result: dict) -> None:
        bar.set_postfix_str(f"{c.label()} @ {result['rate']:.2f}/s: {result['attainment']:.0%}", refresh=False)
        bar.update()

    search, slo = build_search(args, on_probe)
    sim_logger = logging.getLogger("tandem.sim")
    quiet = sim_logger.level
    sim_logger.setLevel(max(logging.WARNING, logging.getLogger().level))  # one INFO line per run otherwise
    started = time.perf_counter()
    try:
        outcomes = search.run(DISTSERVE_PLACEMENTS if args.distserve else ())
        best = outcomes[0]
        if best.max_rate is None:
            raise ValueError("no configuration met the SLO at any probed rate: loosen --slo or lower the load")
        cluster, copies, checks = search.verify(best)
    finally:
        sim_logger.setLevel(quiet)
        bar.close()
    wall_s = time.perf_counter() - started
    colo, disagg = search.best(("colocated",)), search.best(("always", "auto"))
    ratio = disagg.score / colo.score if colo is not None and disagg is not None and colo.score > 0 else None
    model, dtype = serve_model(args), search.hw.dtype
    routing = checks[-1]["routing"] if checks and checks[-1]["passed"] else "least_loaded"
    argv = serve_argv(cluster, model, dtype, search.hw.block_size, routing)
    helm = helm_values(cluster, model, dtype, routing)
    placements = {o.candidate: o for o in outcomes if o.candidate in DISTSERVE_PLACEMENTS}
    report = {"slo": slo, "attainment": search.settings.attainment, "gpu": search.hw.gpu.name, "dtype": dtype,
              "model": search.hw.shape.name, "workload": search.workload.describe(), "wall_s": wall_s,
              "outcomes": [o.to_dict() for o in outcomes], "best": best.to_dict(),
              "best_colocated": colo.to_dict() if colo else None, "best_disaggregated": disagg.to_dict() if disagg
              else None, "disaggregated_over_colocated": ratio, "copies": copies, "deployment_checks": checks,
              "serve_command": shlex.join(argv), "helm_values": helm}
    if args.distserve:
        report["distserve"] = {"published": DISTSERVE_PUBLISHED,
                               "placements": [o.to_dict() for o in placements.values()]}
    if args.json is not None:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            say(text)
            return 0
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text)
    slo_text = ", ".join(f"{k} {v:g} ms" for k, v in slo.items())
    say(f"\n== tandem plan --slo: {search.hw.shape.name} ({dtype}) on up to {search.settings.num_gpus} "
          f"{search.hw.gpu.name}, {slo_text}, {search.settings.attainment:.0%} attainment ==")
    say(f"workload: {search.workload.describe()}")
    say("score: the highest request rate with the attainment met (simulated), per GPU of the configuration\n")
    say("\n".join(table(outcomes, args.top)))
    say(f"\nbest: {best.candidate.label()}: {best.max_rate:.2f} req/s on {best.candidate.gpus} GPU(s), "
          f"{best.score:.2f} req/s per GPU")
    if best.bound == "lower":
        say(f"note: it passed every rate probed (a lower bound): at the last, the {len(search.workload.requests)} "
              "requests of a probe came as one burst, or --max-probes ran out; more --num-prompts may bound it")
    if ratio is not None and disagg is not None and colo is not None:
        say(f"best disaggregated / best colocated, per GPU: {disagg.score:.2f} / {colo.score:.2f} = {ratio:.2f}x")
    say(f"deployment: {copies} cop{'y' if copies == 1 else 'ies'} of it, {cluster.gpus} GPU(s), about "
          f"{best.max_rate * copies:.2f} req/s")
    for check in checks:
        say(f"  simulated so, routing {check['routing']}: {check['attainment']:.0%} within the SLO "
              f"({'held' if check['passed'] else 'missed'})")
    say(f"\n{shlex.join(argv)}\n\n# Helm (helm install ... -f deploy/helm/tandem/values-gpu.yaml -f this.yaml):")
    say(yaml.safe_dump(helm, sort_keys=False).rstrip())
    if args.distserve:
        print_distserve(placements, ratio, colo, disagg)
    say(f"\nsearched in {wall_s:.0f} s")
    return 0


def print_distserve(placements: dict[Candidate, Outcome], ratio: float | None, colo: Outcome | None,
                    disagg: Outcome | None) -> None:
    """The DistServe case beside DistServe's published figure."""
    say("\n== DistServe case: OPT-13B class (Llama-2-13B shape), chatbot (ShareGPT-like, approximated), "
          "TTFT 250 ms / TPOT 100 ms at 90%, A100-80GB ==")
    if ratio is not None and disagg is not None and colo is not None:
        say(f"this planner: best disaggregated {disagg.score:.2f} / best colocated {colo.score:.2f} req/s per GPU "
              f"= {ratio:.2f}x")
    ds, vllm = (placements.get(c) for c in DISTSERVE_PLACEMENTS)
    if ds is not None and vllm is not None and vllm.score > 0:
        say(f"DistServe's placement here (1 prefill TP2 + 1 decode TP1): {ds.score:.2f} req/s per GPU; "
              f"vLLM's (1 colocated TP1): {vllm.score:.2f}; = {ds.score / vllm.score:.2f}x")
    say(DISTSERVE_PUBLISHED)
    say("ours is a simulation of tandem's own scheduler (chunked prefill in the colocated baseline) with steps "
          "priced by a spec-sheet roofline, not DistServe's system nor a measurement")
