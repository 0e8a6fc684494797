"""Disaggregated against the best colocated setup: the colocated worker's prefill chunk
budget (max_num_batched_tokens) is swept on the same cores and workload, and at each rate
the disaggregated run is compared with the best colocated run there, by BEST_RULE.

The issue's goals (GOALS) are ratios disaggregated / best colocated; each is checked per
rate, and the max SLO rate once (slo_search.py)."""

from __future__ import annotations

import math

BEST_RULE = ("best colocated at a rate = the highest goodput; runs with as many requests within the SLO tie "
             "(their goodputs differ only by when the run's last request ended), and the lower p99 TPOT wins a tie")
GOALS = {"p99_tpot_ratio": ("p99 TPOT", "<=", 0.5), "p99_ttft_ratio": ("p99 TTFT", "<=", 1.2),
         "goodput_ratio": ("goodput", ">=", 1.5), "max_slo_rate_ratio": ("max SLO rate", ">=", 1.5)}
"""ratio key -> (what, comparison, bound): disaggregated / best colocated, issue 19's goals."""
PER_RATE_GOALS = ("p99_tpot_ratio", "p99_ttft_ratio", "goodput_ratio")


def run_label(run: dict) -> str:
    """"disaggregated", "colocated/512" (its prefill chunk budget), or "server"."""
    if run["mode"] == "colocated" and run.get("budget") is not None:
        return f"colocated/{run['budget']}"
    return run["mode"]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; inf when only b is 0; None when either is missing or both are 0."""
    if a is None or b is None or b == 0:
        return None if a is None or b is None or a == 0 else math.inf
    return a / b


def goal_held(key: str, value: float | None) -> bool:
    """Whether ``value`` (a ratio named by GOALS' key) meets its goal; a missing one does not."""
    _, op, bound = GOALS[key]
    if value is None:
        return False
    return value <= bound if op == "<=" else value >= bound


def best_key(run: dict) -> tuple:
    """Sort key of BEST_RULE: smaller is better (an empty TPOT sorts last)."""
    m = run["metrics"]
    p99 = m["tpot_ms"]["p99"]
    return (-m["good_requests"], math.inf if p99 is None else p99, run.get("budget") or 0)


def best_colocated(runs: list[dict], rate: float) -> dict | None:
    """The best colocated run at ``rate`` by BEST_RULE (None without one)."""
    candidates = [r for r in runs if r["mode"] == "colocated" and r["rate"] == rate]
    return min(candidates, key=best_key) if candidates else None


def compare(runs: list[dict]) -> list[dict]:
    """Per rate with a disaggregated and a colocated run: disaggregated / best colocated
    ratios, which goals held there, and whether all of them did (goal_met)."""
    rows = []
    for rate in sorted({r["rate"] for r in runs}):
        d_run = next((r for r in runs if r["mode"] == "disaggregated" and r["rate"] == rate), None)
        c_run = best_colocated(runs, rate)
        if d_run is None or c_run is None:
            continue
        d, c = d_run["metrics"], c_run["metrics"]
        row = {"rate": rate, "colocated_budget": c_run.get("budget"),
               "p99_tpot_ratio": ratio(d["tpot_ms"]["p99"], c["tpot_ms"]["p99"]),
               "p50_tpot_ratio": ratio(d["tpot_ms"]["p50"], c["tpot_ms"]["p50"]),
               "p99_ttft_ratio": ratio(d["ttft_ms"]["p99"], c["ttft_ms"]["p99"]),
               "p99_itl_ratio": ratio(d["itl_ms"]["p99"], c["itl_ms"]["p99"]),
               "output_throughput_ratio": ratio(d["output_throughput"], c["output_throughput"]),
               "goodput_ratio": ratio(d["goodput"], c["goodput"]),
               "goodput": {"disaggregated": d["goodput"], "colocated": c["goodput"]}}
        row["goals"] = {key: goal_held(key, row[key]) for key in PER_RATE_GOALS}
        row["goal_met"] = all(row["goals"].values())
        rows.append(row)
    return rows


def search_budget(runs: list[dict]) -> int | None:
    """The colocated budget the max-SLO-rate search probes: the best colocated run's at the
    highest rate swept (the most loaded, nearest where the SLO breaks)."""
    colocated = [r for r in runs if r["mode"] == "colocated"]
    if not colocated:
        return None
    best = best_colocated(colocated, max(r["rate"] for r in colocated))
    return None if best is None else best.get("budget")


def compared_runs(runs: list[dict]) -> list[dict]:
    """The runs the report sets side by side: at each rate the disaggregated run and the
    best colocated one (and any --server run), in rate order."""
    shown = []
    for rate in sorted({r["rate"] for r in runs}):
        best = best_colocated(runs, rate)
        shown += [r for r in runs if r["rate"] == rate and (r["mode"] != "colocated" or r is best)]
    return shown
