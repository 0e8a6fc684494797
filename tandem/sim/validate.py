"""``tandem simulate --validate RESULTS_JSON``: the simulator against real runs.

Every run a ``tandem bench serve`` results.json kept (its sweep, on fresh clusters) is
simulated again with the same workload (its seed, rate, mix and arrivals: traces.bench_mix_requests),
the same cluster (mode, prefill chunk budget, KV pool, --disagg-policy) and the CPU fit of the
run's thread count per worker, and its TTFT and TPOT p50 and p90 are printed beside the real
ones with the relative error."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import ModelConfig, gib_to_bytes
from tandem.sim.spec import ClusterSpec, PoolSpec, StepTimeModel

METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))
"""What is compared: (summarize()'s metric, percentile)."""


@dataclass(frozen=True)
class Comparison:
    """One real run and its simulation."""

    label: str
    """The bench's run label, e.g. "disaggregated" or "colocated/512"."""
    rate: float
    real: dict[str, float | None]
    """"ttft_ms p50" and so on -> the real run's value."""
    sim: dict[str, float | None]

    def error(self, key: str) -> float | None:
        """(sim - real) / real, or None when either is missing."""
        real, sim = self.real[key], self.sim[key]
        return None if real is None or sim is None or real == 0 else (sim - real) / real


def spec_of_run(run: dict, config: dict, shape: ModelConfig, dtype: str, block_size: int = 16) -> ClusterSpec:
    """The simulated cluster of one of the bench's runs (serve.cluster_configs' shapes)."""
    mode = config["modes"][run["mode"]]
    num_blocks = gib_to_bytes(config["kv_cache_memory_gib"]) // (block_size * shape.kv_bytes_per_token(dtype, 1))

    def pool(num_workers: int) -> PoolSpec:
        return PoolSpec(num_workers, 1, max_num_batched_tokens=run["budget"], num_kv_blocks=num_blocks,
                        block_size=block_size)
    if run["mode"] == "colocated":
        return ClusterSpec("colocated", colocated=pool(mode["colocated_workers"]))
    return ClusterSpec("disaggregated", prefill=pool(mode["prefill_workers"]), decode=pool(mode["decode_workers"]),
                       disagg_policy=mode.get("disagg_policy", "always"))


def compare_runs(results: dict, shape: ModelConfig, step_model_for: Callable[[int], StepTimeModel],
                 token_ids=None) -> list[Comparison]:
    """Simulate each kept run of a bench results.json. step_model_for(threads per worker) ->
    the CPU fit for that thread count; token_ids: the bench's prompt token pool (None: any
    ids below the vocabulary; the same shapes and times)."""
    from tandem.bench.serving.load import Mix, parse_goodput
    from tandem.sim.run import simulate
    from tandem.sim.traces import bench_mix_requests

    config, workload = results["config"], results["workload"]
    mix = Mix(tuple(workload["short_prompt_len"]), tuple(workload["long_prompt_len"]), tuple(workload["output_len"]),
              workload["long_fraction"])
    slo = parse_goodput([f"{k}:{v:g}" for k, v in config["slo_ms"].items()])
    out = []
    for run in results["runs"]:
        step_model = step_model_for(config["modes"][run["mode"]]["threads_per_worker"])
        dtype = getattr(step_model, "meta", {}).get("dtype", "float32")
        requests = bench_mix_requests(config["num_prompts"], run["rate"], config["burstiness"], config["seed"], mix,
                                      vocab_size=shape.vocab_size, token_ids=token_ids,
                                      rate_index=config["rates"].index(run["rate"]))
        report = simulate(spec_of_run(run, config, shape, dtype), requests, step_model, shape, slo, dtype)
        pick = lambda m: {f"{k} {p}": m[k][p] for k, p in METRICS}  # noqa: E731
        out.append(Comparison(run["label"], run["rate"], pick(run["metrics"]), pick(report.metrics)))
    return out


SCALES = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6)
STEP_OVERHEADS_S = (0.0, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03)


def calibrate(results: dict, shape: ModelConfig, fits: dict, token_ids=None) -> dict[int, dict[str, float]]:
    """For each thread count of ``fits`` (threads per worker -> CpuStepModel) the served
    step's scale and overhead (over SCALES x STEP_OVERHEADS_S) that give the smallest median
    error on the runs of ``results`` with that many threads per worker -> {threads:
    {"scale", "step_overhead_s", "median_error"}}. Check it on other runs (other seeds)."""
    import dataclasses

    config = results["config"]
    out: dict[int, dict[str, float]] = {}
    for threads, fit in fits.items():
        runs = [r for r in results["runs"] if config["modes"][r["mode"]]["threads_per_worker"] == threads]
        if not runs:
            continue
        best: dict[str, float] | None = None
        for scale in SCALES:
            for overhead in STEP_OVERHEADS_S:
                trial = dataclasses.replace(fit, meta={**fit.meta, "serving": {"scale": scale,
                                                                                "step_overhead_s": overhead}})
                errors = error_summary(compare_runs({**results, "runs": runs}, shape, lambda _: trial, token_ids))
                if best is None or errors["median"] < best["median_error"]:
                    best = {"scale": scale, "step_overhead_s": overhead, "median_error": errors["median"]}
        assert best is not None  # SCALES x STEP_OVERHEADS_S is not empty
        out[threads] = best
    return out


def error_summary(comparisons: list[Comparison]) -> dict[str, float]:
    """The median and the largest |relative error| over every compared value."""
    errors = [abs(e) for c in comparisons for k in c.real if (e := c.error(k)) is not None]
    return {"median": statistics.median(errors), "max": max(errors), "count": len(errors)} if errors else {}


def table(comparisons: list[Comparison]) -> str:
    """A Markdown table: each run's real and simulated values and the error."""
    head = ("| run | rate | " + " | ".join(f"{k.replace('_ms', '')} real / sim (err)" for k in comparisons[0].real)
            + " |")
    lines = [head, "| --- | --- |" + " --- |" * len(comparisons[0].real)]
    for c in comparisons:
        cells = []
        for k in c.real:
            real, sim, err = c.real[k], c.sim[k], c.error(k)
            cells.append("-" if real is None or sim is None else f"{real:.0f} / {sim:.0f} ({err:+.0%})")
        lines.append(f"| {c.label} | {c.rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
