"""Report and PNG plots of ``tandem bench serve`` results (the dict written to results.json)."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a bench machine
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tandem.bench.plots import _table  # noqa: E402
from tandem.bench.serving import sweep_report  # noqa: E402
from tandem.bench.serving.sweep import best_colocated, compared_runs, run_label  # noqa: E402

logger = logging.getLogger(__name__)

SECTIONS = (("ttft_ms", "Time to First Token", "TTFT"), ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
            ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL"))
STYLES = {"disaggregated": "-", "colocated": "--", "server": "-"}
API_LINES = {"grpc": "the gRPC API (Generation.Generate, one stream per request)",
             "openai": "the OpenAI-compatible HTTP API (one streamed POST /v1/completions per request, the "
                       "token ids as prompt; output tokens from the usage chunk)"}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def print_run(run: dict) -> None:
    """One run in vllm bench serve's layout (plus p90)."""
    m = run["metrics"]
    line = lambda name, value: print(f"{name:<40}{value:<10}")  # noqa: E731
    print(f"\n{' ' + run_label(run) + ' @ ' + format(run['rate'], 'g') + ' req/s ':=^50}")
    line("Successful requests:", m["completed"])
    line("Failed requests:", m["failed"])
    line("Benchmark duration (s):", f"{m['duration_s']:.2f}")
    line("Total input tokens:", m["total_input_tokens"])
    line("Total generated tokens:", m["total_output_tokens"])
    line("Request throughput (req/s):", f"{m['request_throughput']:.2f}")
    line("Request goodput (req/s):", f"{m['goodput']:.2f}")
    line("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}")
    line("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")
    for key, title, short in SECTIONS:
        print(f"{title:-^50}")
        s = m[key]
        line(f"Mean {short} (ms):", _ms(s["mean"]))
        line(f"Median {short} (ms):", _ms(s["median"]))
        for p in (90, 99):
            line(f"P{p} {short} (ms):", _ms(s[f"p{p}"]))
    turns = {kind: k for kind, k in m["by_kind"].items() if kind.startswith("turn-")}
    if turns:  # multiturn: how TTFT grows with the history each turn resends
        print(f"{'Median TTFT by turn (ms)':-^50}")
        for kind, k in turns.items():
            line(f"{kind} ({k['completed']} completed):", _ms(k["ttft_ms"]["median"]))
    print("=" * 50)
    for policy, figures in (run.get("prefix_prediction") or {}).items():
        print(prefix_prediction_line(policy, figures))


def prefix_prediction_line(policy: str, figures: dict) -> str:
    """How well the router's policy predicted the workers' prefix hits in a run (breakdown.prefix_prediction)."""
    error = figures["relative_error"]
    shown = "- (the workers reported no hits)" if error is None else f"{error:.1%}"
    return (f"prefix prediction ({policy}): predicted {figures['predicted_tokens']} tokens, workers reported "
            f"{figures['reported_tokens']}, error {shown} (sum |predicted-reported| / reported)")


def print_report(results: dict) -> None:
    cfg, w = results["config"], results["workload"]
    slo = " ".join(f"{k}<={v:g}ms" for k, v in cfg["slo_ms"].items())
    print(f"\n== tandem bench serve: {cfg['num_prompts']} requests per rate, burstiness {cfg['burstiness']:g}, "
          f"seed {cfg['seed']} ==")
    api = cfg.get("api", "grpc")  # results written before --api existed drove gRPC
    model = f", model {cfg['served_model']!r}" if cfg.get("served_model") else ""
    print(f"api: {api}: {API_LINES.get(api, api)}{model}")
    if "multiturn" in w:
        t = w["multiturn"]
        print(f"workload: multiturn, {t['sessions']} sessions of {t['turns']} turns, a shared {t['system_prompt_len']}-"
              f"token system prompt, user turns {t['user_len']}, answers {w['output_len']} tokens, each turn "
              f"resending the history, {t['think_time_s']:g} s between turns; {w['sampling']}")
    elif "mooncake" in w:
        t = w["mooncake"]
        cap = "" if t["max_output_len"] is None else f" up to {t['max_output_len']}"
        print(f"workload: mooncake trace {t['path']}, its first {t['requests']} requests ({t['trace_rate']:.3g} req/s "
              f"in it, its gaps scaled to each rate), prompts {t['prompt_len']} tokens ({t['block_size']} a trace "
              f"block), outputs the trace's{cap}; {w['sampling']}")
    else:
        print(f"workload: {1 - w['long_fraction']:.0%} chats (prompt {w['short_prompt_len']}) + "
              f"{w['long_fraction']:.0%} long prompts ({w['long_prompt_len']}), output {w['output_len']} tokens; "
              f"{w['sampling']}")
    print("TTFT = send -> first non-empty response; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = gaps "
          "between responses; E2EL = send -> end of stream (client clock)")
    print(f"goodput = completed requests meeting {slo}, per second of the run")
    for mode, m in cfg["modes"].items():
        if "total_threads" in m:
            workers = (f"{m['colocated_workers']} colocated worker(s)" if m["colocated_workers"]
                       else f"{m['prefill_workers']} prefill + {m['decode_workers']} decode worker(s)")
            print(f"{mode}: {workers} x {m['threads_per_worker']} torch thread(s) = {m['total_threads']} threads")
    compared = compared_runs(results["runs"])
    if len(compared) < len(results["runs"]):
        print("each rate's disaggregated run and best colocated run in full (the other budgets: the summary)")
    for run in compared:
        print_run(run)

    print("\nsummary (ms; goodput and throughput per second; budget: tokens per engine step; * the best colocated "
          "run at its rate;\nothers' CPU: the machine's CPU other processes took during the run, interference.py)")
    rows = []
    for r in sorted(results["runs"], key=lambda r: (r["rate"], r["mode"] != "disaggregated", r.get("budget") or 0)):
        m = r["metrics"]
        best = "*" if r["mode"] == "colocated" and best_colocated(results["runs"], r["rate"]) is r else ""
        rows.append([r["mode"] + best, str(r.get("budget") or "-"), f"{r['rate']:g}",
                     f"{m['completed']}/{m['completed'] + m['failed']}",
                     f"{m['output_throughput']:.1f}", _ms(m["ttft_ms"]["p50"]), _ms(m["ttft_ms"]["p99"]),
                     _ms(m["tpot_ms"]["p50"]), _ms(m["tpot_ms"]["p99"]), _ms(m["itl_ms"]["p99"]),
                     _ms(m["e2el_ms"]["p99"]), f"{m['goodput']:.3f}", _share(r.get("others_cpu"))])
    print(_table(["mode", "budget", "req/s", "done", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                  "ITL p99", "E2EL p99", "goodput", "others' CPU"], rows))
    sweep_report.print_sweep_report(results)

    if not results["router_overhead"]:
        print("\nrouter hop: not measured (with --server the backend is not in this process)")
        return
    print("\nrouter hop: added latency per request = (1-token request via the gRPC router) - (the same kind "
          "of request\nsent with backend.generate from this process), paired, alternating which goes first (ms)")
    rows = [[mode, str(o["num_pairs"]), _ms(o["router_ms"]["p50"]), _ms(o["direct_ms"]["p50"]),
             _ms(o["added_ms"]["p50"]), _ms(o["added_ms"]["p99"])] for mode, o in results["router_overhead"].items()]
    print(_table(["mode", "pairs", "router p50", "direct p50", "added p50", "added p99"], rows))
    print("what this measures: gRPC over loopback both ways, protobuf, validation and tokenization, the servicer's "
          "relay,\nand the client's own grpc.aio costs (client and router share this process and event loop); "
          "worker-side\ntime is in both paths and cancels out, up to noise; the p99 of few pairs is mostly noise")


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """latency_cdf.png (TTFT and TPOT CDFs of the compared runs: disaggregated and the best
    colocated at each rate) and goodput.png (goodput and p99 TPOT vs rate, per setup).
    Returns the paths written."""
    runs = compared_runs(results["runs"])
    rates = sorted({r["rate"] for r in runs})
    colors = {rate: f"C{i}" for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (key, label) in zip(axes, (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))):
        for run in runs:
            values = np.sort([q[key] for q in run["requests"] if q[key] is not None])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                        linestyle=STYLES.get(run["mode"], "-"), color=colors[run["rate"]],
                        label=f"{run_label(run)} @ {run['rate']:g} req/s")
        if key[:4] in results["config"]["slo_ms"]:
            ax.axvline(results["config"]["slo_ms"][key[:4]], color="grey", linestyle=":", label="SLO")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{label.split()[0]} CDF")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    cdf_path = out_dir / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(cdf_path, dpi=120)
    plt.close(fig)

    fig, (good, tpot) = plt.subplots(1, 2, figsize=(11, 4))
    runs = results["runs"]
    for i, mode in enumerate(dict.fromkeys(run_label(r) for r in runs)):
        mine = sorted((r for r in runs if run_label(r) == mode), key=lambda r: r["rate"])
        x, style, color = [r["rate"] for r in mine], "o" + STYLES.get(mine[0]["mode"], "-"), f"C{i}"
        good.plot(x, [r["metrics"]["goodput"] for r in mine], style, color=color, label=f"{mode} goodput")
        good.plot(x, [r["metrics"]["request_throughput"] for r in mine], "x:", color=color, alpha=0.5,
                  label=f"{mode} throughput")
        tpot.plot(x, [r["metrics"]["tpot_ms"]["p99"] or np.nan for r in mine], style, color=color, label=mode)
    slo = " ".join(f"{k}<={v:g}ms" for k, v in results["config"]["slo_ms"].items())
    good.set_title(f"Goodput ({slo})")
    good.set_ylabel("requests / s")
    tpot.set_title("p99 TPOT")
    tpot.set_ylabel("ms")
    for ax in (good, tpot):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    goodput_path = out_dir / "goodput.png"
    fig.tight_layout()
    fig.savefig(goodput_path, dpi=120)
    plt.close(fig)
    logger.info("plots written to %s and %s", cdf_path, goodput_path)
    return [cdf_path, goodput_path]
