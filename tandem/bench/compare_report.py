"""The tables and the plot of ``tandem bench compare`` (from the dict written to results.json)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: no display on a bench machine
import matplotlib.pyplot as plt  # noqa: E402

from tandem.bench.plots import _table  # noqa: E402

PANELS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _describe(results: dict) -> str:
    s, w = results["settings"], results["workload"]
    modes = {"poisson": f"poisson: {s['num_prompts']} requests at {s['rate']:g} req/s",
             "burst": f"burst: {s['burst_size']} requests at once"}
    return (f"{'; '.join(modes[m] for m in s['modes'])}; seeds {' '.join(map(str, s['seeds']))}\n"
            f"prompts {w['short_prompt_len']} tokens ({1 - w['long_fraction']:.0%}) or {w['long_prompt_len']} "
            f"({w['long_fraction']:.0%}), outputs {w['output_len']} tokens; {w['sampling']}")


def print_report(results: dict) -> None:
    """Per mode: every server's pooled figures, their ratios to the first server, and the
    spread of each server's TPOT p50 and output tokens/s over the seeds."""
    servers, summary = results["servers"], results["summary"]
    reference = servers[0]["label"]
    print("\n== tandem bench compare ==")
    for s in servers:
        print(f"{s['label']}: {s['url']} (model {s['model']})")
    print(_describe(results))
    print("TTFT = first chunk with text; TPOT = (latency - TTFT) / (completion tokens - 1); "
          "figures over the requests of every seed, output tok/s over the runs' summed durations\n")
    rows = []
    for mode, by_server in summary.items():
        for label, m in by_server.items():
            rows.append([mode, label, f"{m['completed']}/{m['num_requests']}", str(m["exact_output_len"]),
                         f"{m['output_throughput']:.1f}", _ms(m["ttft_ms"]["p50"]), _ms(m["ttft_ms"]["p99"]),
                         _ms(m["tpot_ms"]["p50"]), _ms(m["tpot_ms"]["p99"])])
    print(_table(["mode", "server", "done", "exact len", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                  "TPOT p99"], rows))
    if len(servers) > 1:
        print(f"\nratios to {reference} (server / {reference}; below 1x is faster for latency, above 1x is "
              "more tokens/s)")
        rows = [[mode, label, *(_x(r) for r in m["ratios"].values())]
                for mode, by_server in summary.items() for label, m in by_server.items() if label != reference]
        print(_table(["mode", "server", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "out tok/s"], rows))
    if len(results["settings"]["seeds"]) > 1:
        print("\nper seed (the spread between runs): TPOT p50 ms / output tok/s")
        seeds = [str(seed) for seed in results["settings"]["seeds"]]
        rows = [[mode, label, *(f"{_ms(m['per_seed'][k]['tpot_ms']['p50'])} / "
                                f"{m['per_seed'][k]['output_throughput']:.1f}" for k in seeds)]
                for mode, by_server in summary.items() for label, m in by_server.items()]
        print(_table(["mode", "server", *(f"seed {k}" for k in seeds)], rows))
    bad = [f"{r['server']} {r['mode']} seed {r['seed']}: {r['metrics']['failed']} failed" for r in results["runs"]
           if r["metrics"]["failed"]]
    short = [f"{label} {mode}" for mode, by_server in summary.items() for label, m in by_server.items()
             if m["exact_output_len"] != m["completed"]]
    for line in bad:
        print(f"warning: {line}")
    if short:
        print(f"warning: outputs of another length than asked (ignore_eos not honoured?): {', '.join(short)}")


def write_plot(results: dict, path: Path) -> Path:
    """compare_latency.png: per mode (rows), the TTFT and TPOT distributions (columns) as
    empirical CDFs, a line per server."""
    summary = results["summary"]
    modes = list(summary)
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.8 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        for ax, (key, label) in zip(row, PANELS):
            for i, server in enumerate(results["servers"]):
                values = np.sort([q[key] for run in results["runs"] if run["mode"] == mode
                                  and run["server"] == server["label"] for q in run["requests"]
                                  if q[key] is not None])
                if len(values):
                    ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=f"C{i}",
                            label=f"{server['label']} (p50 {np.median(values):.0f}, "
                                  f"p99 {np.percentile(values, 99):.0f})")
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("share of requests")
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{mode}: {label.split()[0]}")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
