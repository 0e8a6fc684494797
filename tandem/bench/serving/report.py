"""The side-by-side view of ``tandem bench serve``: TTFT and TPOT distributions of every
run compared (distributions.png) and a one-page HTML report around it (report.html)."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tandem.bench.serving.sweep import compared_runs, run_label  # noqa: E402

PANELS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))


def tick_label(run: dict) -> str:
    return f"{run_label(run)}\n{run['rate']:g} req/s"


def write_distributions(results: dict, out_dir: Path) -> Path:
    """One violin (with its box) per compared run (disaggregated and the best colocated at
    each rate), TTFT on the left and TPOT on the right; runs at the same rate stand next to
    each other, so the modes compare at a glance."""
    runs = sorted(compared_runs(results["runs"]), key=lambda r: (r["rate"], r["mode"]))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.4 * len(runs)), 4.8))
    for ax, (key, label) in zip(axes, PANELS):
        data = [[q[key] for q in run["requests"] if q[key] is not None] or [float("nan")] for run in runs]
        positions = range(1, len(runs) + 1)
        shown = [(p, d) for p, d in zip(positions, data) if len(d) > 1]  # a violin needs two points
        if shown:
            parts = ax.violinplot([d for _, d in shown], [p for p, _ in shown], showextrema=False)
            for body, (p, _) in zip(parts["bodies"], shown):
                body.set_facecolor(f"C{0 if runs[p - 1]['mode'] != 'colocated' else 1}")
                body.set_alpha(0.35)
        ax.boxplot(data, positions=list(positions), widths=0.15, showfliers=True)
        ax.set_xticks(list(positions), [tick_label(r) for r in runs], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.set_title(f"{label.split()[0]} per request (box: quartiles, whiskers 1.5 IQR)")
        ax.grid(alpha=0.3, axis="y")
        slo = results["config"]["slo_ms"].get(key[:4])
        if slo is not None:
            ax.axhline(slo, color="grey", linestyle=":", label=f"SLO {slo:g} ms")
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "distributions.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_html(results: dict, out_dir: Path, images: list[Path]) -> Path:
    """report.html: every run's TTFT/TPOT percentiles in one table and the plots beside it."""
    stats = ("p50", "p90", "p99", "mean")
    head = "".join(f"<th>{html.escape(label.split()[0])} {s}</th>" for _, label in PANELS for s in stats)
    rows = []
    for run in sorted(results["runs"], key=lambda r: (r["rate"], r["mode"], r.get("budget") or 0)):
        m = run["metrics"]
        cells = "".join(f"<td>{_ms(m[key][s])}</td>" for key, _ in PANELS for s in stats)
        rows.append(f"<tr><td>{html.escape(run_label(run))}</td><td>{run['rate']:g}</td>"
                    f"<td>{m['completed']}</td><td>{m['goodput']:.3f}</td>{cells}</tr>")
    slo = ", ".join(f"{k} &le; {v:g} ms" for k, v in results["config"]["slo_ms"].items())
    api = {"grpc": "gRPC", "openai": "OpenAI-compatible HTTP"}.get(results["config"].get("api", "grpc"), "?")
    imgs = "".join(f'<img src="{html.escape(p.name)}" alt="{html.escape(p.stem)}">' for p in images)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tandem bench serve</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%;display:block;margin:1em 0}}</style>
</head><body><h1>tandem bench serve</h1>
<p>Driven through the {html.escape(api)} API. Latencies in ms; goodput in requests/s under {slo}.</p>
<table><tr><th>setup</th><th>req/s</th><th>done</th><th>goodput</th>{head}</tr>
{''.join(rows)}</table>{imgs}</body></html>
"""
    path = out_dir / "report.html"
    path.write_text(page)
    return path


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"
