"""The text tables of ``tandem bench serve`` that compare disaggregated with the best
colocated setup: the ratios per rate with the issue's goals, where each run's time goes,
and the max SLO rates (the dict written to results.json)."""

from __future__ import annotations

import math

from tandem.bench.plots import _table
from tandem.bench.serving.breakdown import PARTS
from tandem.bench.serving.interference import SUSPECT
from tandem.bench.serving.slo_search import ratio_goal
from tandem.bench.serving.sweep import BEST_RULE, GOALS, PER_RATE_GOALS, compared_runs, run_label


def _x(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}x")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _goal(key: str) -> str:
    what, op, bound = GOALS[key]
    return f"{what} {op} {bound:g}x"


def print_comparison(results: dict) -> None:
    """Disaggregated / best colocated per rate, and which per-rate goals held where."""
    rows = results["comparison"]
    if not rows:
        return
    print(f"\ndisaggregated / best colocated (same workload, same total threads)\n{BEST_RULE}")
    print(_table(["req/s", "best colocated", "TPOT p99", "TPOT p50", "TTFT p99", "ITL p99", "out tok/s", "goodput",
                  "goals held"],
                 [[f"{c['rate']:g}", f"colocated/{c['colocated_budget']}", _x(c["p99_tpot_ratio"]),
                   _x(c["p50_tpot_ratio"]), _x(c["p99_ttft_ratio"]), _x(c["p99_itl_ratio"]),
                   _x(c["output_throughput_ratio"]), _x(c["goodput_ratio"]),
                   f"{sum(c['goals'].values())} of {len(c['goals'])}"] for c in rows]))


def _decisions(decisions: dict[str, int] | None) -> str:
    if not decisions:
        return "-"
    count = lambda where: sum(n for k, n in decisions.items() if k.startswith(where + "/"))  # noqa: E731
    return f"{count('local')} / {count('remote')}"


def print_breakdown(results: dict) -> None:
    """Each compared run's mean request, part by part, from the cluster's histograms."""
    runs = [r for r in compared_runs(results["runs"]) if r.get("breakdown") or r.get("breakdown_note")]
    if not runs:
        return
    print("\nwhere the time goes: mean per request (ms), from the cluster's /metrics scraped before and after each "
          "run\n(histogram sums / counts). Queue, prefill and delivery add up to the router's TTFT; the KV transfer "
          "tail runs\nbeside the delivery (the first token goes out before the KV has landed) and delays the second "
          "token.\nA hop between processes counts in the part whose span holds it; each part is good to some tens "
          "of ms\n(tandem/bench/serving/breakdown.py)")
    for rate in sorted({r["rate"] for r in runs}):
        mine = [r for r in runs if r["rate"] == rate]
        parts = [r.get("breakdown") or {} for r in mine]
        rows = [[label, *(_ms(p.get(key)) for p in parts)] for key, label in PARTS]
        rows.insert(1, ["  of which decode reservation -> prefill admission", *(
            _ms(p.get("prefill_admission_ms")) if p.get("mode") == "disaggregated" else "-" for p in parts)])
        rows.insert(5, ["TTFT at the client (bench clock)", *(_ms(r["metrics"]["ttft_ms"]["mean"]) for r in mine)])
        rows.append(["requests in the histograms", *(str(p.get("requests", "-")) for p in parts)])
        rows.append(["prefills local / remote (the router's decisions)", *(
            _decisions(p.get("prefill_decisions")) for p in parts)])
        print(f"\n@ {rate:g} req/s")
        print(_table(["part", *(run_label(r) for r in mine)], rows))
        for r in mine:
            if r.get("breakdown_note"):
                print(f"{run_label(r)}: no breakdown: {r['breakdown_note']}")


def print_slo_search(results: dict) -> None:
    """Each searched setup's probes and its max SLO rate, and their ratio."""
    search = results.get("slo_search")
    if not search:
        return
    slo = " ".join(f"{k}<={v:g}ms" for k, v in search["slo_ms"].items())
    print(f"\nmax SLO rate: the highest request rate with >= {search['attainment']:.0%} of requests within {slo}\n"
          f"({search['num_prompts']} requests per probe, each on a fresh cluster; the sweep's runs count; then "
          f"doubling, halving and bisection, at most {search['max_probes']} new probes per mode)")
    rows = []
    for s in search["setups"].values():
        probes = ", ".join(f"{p['rate']:g}: {p['attainment']:.0%} {'met' if p['passed'] else 'missed'}"
                           + (f" (others took {p['others_cpu']:.0%} CPU)" if (p.get("others_cpu") or 0) >= SUSPECT
                              else "") for p in s["probes"])
        if s["bound"] == "none":
            answer = f"< {min(p['rate'] for p in s['probes']):g} (none probed met it)"
        elif s["bound"] == "lower":
            answer = f">= {s['max_rate']:g} (nothing above it missed)"
        else:
            answer = f"{s['max_rate']:g} (next probe above, {s['next_failed_rate']:g}, missed)"
        rows.append([s["label"], probes, answer])
    print(_table(["setup", "probes (req/s: attainment)", "max SLO rate (req/s)"], rows))


def goal_rows(results: dict) -> list[list[str]]:
    """The goals side by side: each ratio at each rate (or the max SLO rate's), and whether it held."""
    rows, comparison = [], results["comparison"]
    for key in PER_RATE_GOALS:
        held = [c["rate"] for c in comparison if c["goals"][key]]
        values = " / ".join(f"{_x(c[key])} @ {c['rate']:g}" for c in comparison)
        rows.append([_goal(key), values, f"held at {len(held)} of {len(comparison)} rates"
                     + (f" ({', '.join(f'{r:g}' for r in held)})" if held else "")])
    search = results.get("slo_search")
    if search and "max_rate_ratio" in search:
        value, qualifier = search["max_rate_ratio"], search["max_rate_ratio_qualifier"]
        shown = ("?" if value is None else _x(value) if qualifier == "=" else
                 f"{_x(value)} (of two bounds)" if qualifier == "?" else f"{qualifier} {_x(value)}")
        rows.append([_goal("max_slo_rate_ratio"), shown, ratio_goal(value, qualifier, GOALS["max_slo_rate_ratio"][2])])
    return rows


def print_sweep_report(results: dict) -> None:
    """Everything above, in order: ratios, breakdown, max SLO rates, goals."""
    print_comparison(results)
    print_breakdown(results)
    print_slo_search(results)
    rows = goal_rows(results) if results["comparison"] else []
    if rows:
        print("\ngoals (issue 19): disaggregated / best colocated")
        print(_table(["goal", "measured", "held"], rows))
    suspect = [f"{run_label(r)} @ {r['rate']:g} ({r['others_cpu']:.0%})" for r in results["runs"]
               if (r.get("others_cpu") or 0) >= SUSPECT]
    if suspect:
        print(f"\nsuspect runs, other processes took >= {SUSPECT:.0%} of the CPU: {', '.join(suspect)}")
    for d in results.get("discarded_runs") or []:
        print(f"repeated {d['label']} @ {d['rate']:g} req/s ({d['phase']}): the run during which other processes "
              f"took {d['others_cpu']:.0%} of the CPU was set aside")
    elapsed = results["config"].get("elapsed_s")
    if elapsed is not None:
        search = results.get("slo_search") or {"setups": {}}
        probes = sum(p["source"] == "probe" for s in search["setups"].values() for p in s["probes"])
        print(f"\n{len(results['runs'])} sweep runs and {probes} search probes, each on a fresh cluster, in "
              f"{elapsed / 60:.1f} min")
