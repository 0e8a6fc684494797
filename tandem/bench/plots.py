"""Tables and PNG plots of ``tandem bench engine`` results (the dict written to results.json)."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a bench machine
import matplotlib.pyplot as plt  # noqa: E402

from tandem.bench.bandwidth import DEFINITION  # noqa: E402
from tandem.bench.serving.interference import SUSPECT  # noqa: E402

logger = logging.getLogger(__name__)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def print_report(results: dict) -> None:
    """The final tables: throughput per concurrency, then single-stream TPOT vs the floor."""
    w = results["workload"]
    print(f"\n== tandem bench engine: {results['model']} ({results['dtype']}), "
          f"{results['num_threads']} torch threads, torch {results['torch']} ==")
    print(f"workload: prompts {w['prompts']}, prompt length uniform in {w['prompt_len']}, "
          f"output length uniform in {w['output_len']}, seed {results['seed']}; {w['sampling']}")
    print("throughput = requested output tokens / wall seconds "
          "(transformers: generate on batches of c prompts, left-padded)\n")
    rows = [[str(r["concurrency"]), str(r["num_requests"]), str(r["output_tokens"]),
             f"{r['tandem_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}", f"{r['ratio']:.2f}x",
             f"{r['greedy_agreement']:.0%}"] for r in results["throughput"]]
    print(_table(["concurrency", "requests", "out tokens", "tandem tok/s", "transformers tok/s",
                  "ratio", "same tokens"], rows))

    bw, s = results["bandwidth"], results["single_stream"]
    print(f"\nmemory bandwidth: {bw['bytes_per_s'] / 1e9:.2f} GB/s "
          f"({DEFINITION}; {bw['size_bytes'] / 2**20:.0f} MiB, N={bw['repeats']})")
    print(f"floor = weight bytes / bandwidth = {s['weight_bytes'] / 1e6:.0f} MB / "
          f"{bw['bytes_per_s'] / 1e9:.2f} GB/s = {s['floor_s'] * 1e3:.2f} ms per decode step")
    print(f"single stream: {s['prompt_len']}-token prompt, {s['output_len']} output tokens; "
          "TPOT = mean time between output tokens (prefill step excluded)\n")
    rows = [[name, f"{s[name]['tpot_s'] * 1e3:.2f}", f"{s[name]['median_s'] * 1e3:.2f}",
             f"{s[name]['p90_s'] * 1e3:.2f}", f"{s['floor_s'] * 1e3:.2f}", f"{s[name]['utilisation']:.0%}"]
            for name in ("tandem", "transformers")]
    print(_table(["engine", "TPOT ms", "median ms", "p90 ms", "floor ms", "bandwidth utilisation"], rows))
    ratio = s["transformers"]["tpot_s"] / s["tandem"]["tpot_s"]
    print(f"\ntransformers TPOT / tandem TPOT = {ratio:.2f}x")
    if results.get("decode_steps"):
        print_decode_steps(results["decode_steps"])


def print_decode_steps(steps: dict) -> None:
    """tandem's decode steps per format and batch size against their memory floor."""
    rows, bw = steps["rows"], steps["bandwidth"]
    first = rows[0]
    print(f"\ndecode steps: tandem, batch size B, each sequence a {first['prompt_len']}-token prompt and "
          f"{first['output_len']} output tokens; step = mean of the pure decode steps (every prompt done)")
    print(f"floor = (weight bytes + KV bytes read per step) / {bw['bytes_per_s'] / 1e9:.2f} GB/s "
          "(copy bandwidth measured right before); floor/step = share of the memory floor reached\n")
    base = {r["batch_size"]: r["tok_s"] for r in rows if r["format"] == first["format"]}
    table = [[r["format"], str(r["batch_size"]), f"{r['tok_s']:.1f}", f"{r['tok_s'] / base[r['batch_size']]:.2f}x",
              f"{r['step_s'] * 1e3:.2f}", f"{r['weight_bytes'] / 1e6:.0f}", f"{r['kv_bytes'] / 1e6:.1f}",
              f"{r['floor_s'] * 1e3:.2f}", f"{r['floor_fraction']:.0%}", _others(r.get("others_cpu"))]
             for r in rows]
    print(_table(["format", "batch", "tok/s", f"vs {first['format']}", "step ms", "weights MB", "KV MB",
                  "floor ms", "floor/step", "others' CPU"], table))
    if any((r.get("others_cpu") or 0) >= SUSPECT for r in rows):
        print(f"! other processes took >= {SUSPECT:.0%} of the CPU during that row: its figures are suspect")


def _others(share: float | None) -> str:
    """Others' share of the CPU during a row, flagged when it makes the row suspect."""
    if share is None:
        return "-"
    return f"{share:.0%}" + (" !" if share >= SUSPECT else "")


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """throughput.png (both engines vs concurrency) and tpot.png (TPOT bars against the
    floor, and the per-step distribution). Returns the paths written."""
    rows = results["throughput"]
    conc = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(conc, [r["tandem_tok_s"] for r in rows], "o-", label="tandem")
    ax.plot(conc, [r["transformers_tok_s"] for r in rows], "s--", label="transformers generate")
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput, {results['model']}, {results['num_threads']} threads")
    ax.grid(alpha=0.3)
    ax.legend()
    throughput_path = out_dir / "throughput.png"
    fig.tight_layout()
    fig.savefig(throughput_path, dpi=120)
    plt.close(fig)

    s = results["single_stream"]
    names = ["tandem", "transformers"]
    fig, (bars, dist) = plt.subplots(1, 2, figsize=(11, 4))
    values = [s["floor_s"] * 1e3] + [s[n]["tpot_s"] * 1e3 for n in names]
    bars.bar(["memory floor", *names], values, color=["grey", "C0", "C1"])
    for x, v in enumerate(values):
        bars.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom")
    bars.set_ylabel("ms per decode step")
    bars.set_title(f"Single-stream TPOT ({s['prompt_len']}-token prompt)")
    dist.hist([[t * 1e3 for t in s[n]["step_s"]] for n in names], bins=30, label=names, color=["C0", "C1"])
    dist.axvline(s["floor_s"] * 1e3, color="grey", linestyle="--", label="memory floor")
    dist.set_xlabel("decode step time (ms)")
    dist.set_ylabel("steps")
    dist.set_title("Per-step time distribution")
    dist.legend()
    tpot_path = out_dir / "tpot.png"
    fig.tight_layout()
    fig.savefig(tpot_path, dpi=120)
    plt.close(fig)
    logger.info("plots written to %s and %s", throughput_path, tpot_path)
    if not results.get("decode_steps"):
        return [throughput_path, tpot_path]
    return [throughput_path, tpot_path, write_decode_steps_plot(results["decode_steps"], out_dir / "decode_steps.png")]


def write_decode_steps_plot(steps: dict, path: Path) -> Path:
    """Step time (solid) and its memory floor (dashed) per batch size, a line pair per format;
    beside it the share of the floor reached."""
    fig, (times, shares) = plt.subplots(1, 2, figsize=(11, 4))
    formats = list(dict.fromkeys(r["format"] for r in steps["rows"]))
    for i, name in enumerate(formats):
        rows = [r for r in steps["rows"] if r["format"] == name]
        sizes = [r["batch_size"] for r in rows]
        times.plot(sizes, [r["step_s"] * 1e3 for r in rows], "o-", color=f"C{i}", label=f"{name} step")
        times.plot(sizes, [r["floor_s"] * 1e3 for r in rows], "s--", color=f"C{i}", alpha=0.6,
                   label=f"{name} floor")
        shares.plot(sizes, [100 * r["floor_fraction"] for r in rows], "o-", color=f"C{i}", label=name)
    sizes = sorted({r["batch_size"] for r in steps["rows"]})
    for ax in (times, shares):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (sequences per decode step)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    times.set_ylabel("ms per decode step")
    times.set_title("Decode step vs memory floor (weights + KV / bandwidth)")
    shares.set_ylabel("floor / step time (%)")
    shares.set_title("Share of the memory floor reached")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
