"""PNG plots of the colocated budget sweep and the max-SLO-rate search of ``tandem bench
serve`` (the dict written to results.json): sweep.png and slo_attainment.png."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a bench machine
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tandem.bench.serving.interference import SUSPECT  # noqa: E402
from tandem.bench.serving.sweep import best_colocated, run_label  # noqa: E402

logger = logging.getLogger(__name__)

PANELS = ((lambda m: m["tpot_ms"]["p99"], "p99 TPOT (ms)", "tpot"),
          (lambda m: m["ttft_ms"]["p99"], "p99 TTFT (ms)", "ttft"),
          (lambda m: m["goodput"], "goodput (req/s)", None))
"""(value of a run's metrics, axis label, the SLO key drawn as a line)."""


def _value(get, run: dict) -> float:
    value = get(run["metrics"])
    return np.nan if value is None else value


def write_sweep(results: dict, out_dir: Path) -> Path:
    """sweep.png: p99 TPOT, p99 TTFT and goodput vs rate of the disaggregated runs, the best
    colocated run at each rate (its budget written by each point) and every colocated budget."""
    runs = results["runs"]
    rates = sorted({r["rate"] for r in runs})
    budgets = sorted({r["budget"] for r in runs if r["mode"] == "colocated"})
    shades = plt.cm.viridis(np.linspace(0.15, 0.85, max(1, len(budgets))))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (get, label, slo_key) in zip(axes, PANELS):
        for budget, shade in zip(budgets, shades):
            mine = sorted((r for r in runs if r["mode"] == "colocated" and r["budget"] == budget),
                          key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in mine], [_value(get, r) for r in mine], ".:", color=shade, alpha=0.8,
                    label=f"colocated/{budget}")
        best = [b for b in (best_colocated(runs, rate) for rate in rates) if b is not None]
        if best:
            ax.plot([r["rate"] for r in best], [_value(get, r) for r in best], "s--", color="C1", linewidth=2,
                    markerfacecolor="none", markersize=9, label="best colocated")
            for r in best:
                ax.annotate(str(r["budget"]), (r["rate"], _value(get, r)), textcoords="offset points",
                            xytext=(5, 5), fontsize=7, color="C1")
        for mode in ("disaggregated", "server"):
            mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["rate"])
            if mine:
                ax.plot([r["rate"] for r in mine], [_value(get, r) for r in mine], "o-", color="C0", linewidth=2,
                        label=mode)
        bound = results["config"]["slo_ms"].get(slo_key) if slo_key else None
        if bound is not None:
            ax.axhline(bound, color="grey", linestyle=":", label=f"SLO {bound:g} ms")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(label.split(" (")[0] + " vs rate")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("disaggregated vs every colocated prefill chunk budget (tokens per step)", fontsize=10)
    fig.tight_layout()
    path = out_dir / "sweep.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_attainment(results: dict, out_dir: Path) -> Path:
    """slo_attainment.png: share of requests within the SLO vs rate of each searched setup,
    every probe a point (filled: met the target), the found max rates marked."""
    search = results["slo_search"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, s in enumerate(search["setups"].values()):
        color, probes = f"C{i}", s["probes"]
        x, y = [p["rate"] for p in probes], [100 * p["attainment"] for p in probes]
        ax.plot(x, y, "-" if i == 0 else "--", color=color, alpha=0.6, label=s["label"])
        ax.scatter(x, y, edgecolors=color, zorder=3, facecolors=[color if p["passed"] else "none" for p in probes])
        for p, px, py in zip(probes, x, y):
            if (p.get("others_cpu") or 0) >= SUSPECT:  # a neighbour took the CPU: say so by the point
                ax.annotate(f"others took {p['others_cpu']:.0%} CPU", (px, py), color=color, fontsize=7,
                            xytext=(0, 8), textcoords="offset points", ha="center")
        if s["max_rate"] is not None:
            prefix = ">= " if s["bound"] == "lower" else ""
            ax.axvline(s["max_rate"], color=color, linestyle=":", alpha=0.8)
            # Along its line, so that the labels of close maxima do not overlap.
            ax.annotate(f"max {prefix}{s['max_rate']:g} req/s", (s["max_rate"], 2), color=color, fontsize=8,
                        rotation=90, va="bottom", xytext=(-3 if i == 0 else 3, 0), textcoords="offset points",
                        ha="right" if i == 0 else "left")
        else:
            ax.annotate(f"none met: max < {min(x):g} req/s", (min(x), 2 + 8 * i), color=color, fontsize=8,
                        xytext=(4, 0), textcoords="offset points")
    ax.axhline(100 * search["attainment"], color="grey", linestyle=":", label=f"{search['attainment']:.0%} target")
    slo = " ".join(f"{k}<={v:g}ms" for k, v in search["slo_ms"].items())
    ax.set_title(f"SLO attainment ({slo}), {search['num_prompts']} requests per probe; filled: met the target",
                 fontsize=9)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests within the SLO (%)")
    ax.set_ylim(0, 105)
    lowest = min(p["rate"] for s in search["setups"].values() for p in s["probes"])
    ax.set_xlim(left=0.9 * lowest)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path = out_dir / "slo_attainment.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_sweep_plots(results: dict, out_dir: Path) -> list[Path]:
    """sweep.png (with more than one setup) and slo_attainment.png (after a search)."""
    paths = []
    if len({run_label(r) for r in results["runs"]}) > 1:
        paths.append(write_sweep(results, out_dir))
    if results.get("slo_search"):
        paths.append(write_attainment(results, out_dir))
    logger.info("plots written to %s", ", ".join(map(str, paths)) or "nowhere (one setup, no search)")
    return paths
