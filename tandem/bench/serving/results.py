"""What one ``tandem bench serve`` invocation writes: results.json's contents (the config,
the workload, every run, the comparison, the SLO search) and, with --save-result, each run
under vLLM's flat keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.bench.serve import Bench


def bench_results(bench: Bench, config: dict) -> dict:
    """results.json: ``config`` (the clusters' or the server's description) and what ``bench`` ran."""
    from tandem.bench.serving.slo_search import max_rate_ratio
    from tandem.bench.serving.sweep import BEST_RULE, compare

    s, args = bench.settings, bench.args
    search = bench.slo_search
    if search is not None and len(search["setups"]) == 2:
        value, qualifier = max_rate_ratio(search["setups"]["disaggregated"], search["setups"]["colocated"])
        search = {**search, "max_rate_ratio": value, "max_rate_ratio_qualifier": qualifier}
    shapes = bench.shapes or []
    return {
        "config": {**config, "api": args.api, "served_model": bench.model, "seed": args.seed,
                   "rates": s.rates, "num_prompts": s.num_prompts, "burstiness": args.burstiness,
                   "max_concurrency": args.max_concurrency, "slo_ms": bench.slo, "quick": args.quick,
                   "kv_cache_memory_gib": s.kv_cache_memory_gib,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "colocated_budgets": s.budgets,
                   "slo_attainment": args.slo_attainment, "slo_probes": s.slo_probes,
                   "best_rule": BEST_RULE, "elapsed_s": bench.elapsed_s, "retries": args.retries},
        "workload": {"prompts": "uniform random token ids (added, special and EOS ids excluded), "
                                "no shared prefixes; the same kinds and lengths at every rate",
                     "short_prompt_len": list(s.short_prompt_len), "long_prompt_len": list(s.long_prompt_len),
                     "output_len": list(s.output_len), "long_fraction": s.long_fraction,
                     "num_long": [sum(r.kind == "long" for r in shapes)] * len(s.rates),
                     "sampling": "temperature=0, ignore_eos=True, max_tokens=output_len",
                     "arrivals": "gamma(shape=burstiness, mean=1/rate) gaps, first request at 0",
                     "dataset": args.dataset_name,
                     **({"multiturn": {"sessions": s.num_prompts, "turns": args.num_turns,
                                       "system_prompt_len": args.system_prompt_len, "think_time_s": args.think_time,
                                       "user_len": list(s.short_prompt_len)}}
                        if args.dataset_name == "multiturn" else {}),
                     **({"mooncake": {"path": args.dataset_path, **bench.trace.summary()}} if bench.trace else {})},
        "runs": bench.runs, "router_overhead": bench.overhead, "comparison": compare(bench.runs),
        "slo_search": search, "discarded_runs": bench.discarded,
    }


def save_flat(bench: Bench, runs: list[dict]) -> list[Path]:
    """--save-result: each kept run under vLLM's flat keys, a file of its own in --out-dir."""
    from tandem.bench.serving.vllm_format import flat_result, result_file_name

    args = bench.args
    paths = []
    for run in runs:
        flat = flat_result(run["metrics"], model=bench.model or args.model, label=run["label"],
                           num_prompts=bench.settings.num_prompts, rate=run["rate"],
                           burstiness=args.burstiness, max_concurrency=args.max_concurrency)
        paths.append(Path(args.out_dir) / result_file_name(run))
        paths[-1].write_text(json.dumps(flat, indent=2))
    return paths
