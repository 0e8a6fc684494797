"""Report and PNG plot of ``tandem bench overload`` results (the dict written to results.json)."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a bench machine
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tandem.bench.overloading.summary import OK, OTHER, REFUSED  # noqa: E402
from tandem.bench.plots import _table  # noqa: E402

logger = logging.getLogger(__name__)

COLORS = {OK: "tab:green", REFUSED: "tab:orange", OTHER: "tab:red"}
LATENCY_NAMES = {"ttft_ms": "TTFT", "e2el_ms": "E2E"}


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _share(n: int, total: int) -> str:
    return f"{n} ({n / total:.1%})" if total else str(n)


def print_report(results: dict) -> None:
    """The figures: rates and outcomes, memory per process, latency before vs after, verdict."""
    cfg, w, s, load = results["config"], results["workload"], results["sustainable"], results["overload"]
    o, drain = load["outcomes"], results["drain"]
    print(f"\n== tandem bench overload: {cfg['workers']} worker x {cfg['threads_per_worker']} torch thread(s), "
          f"router in this process, bound max_concurrent_requests={cfg['max_concurrent_requests']} ==")
    print(f"workload: prompts {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens, {w['output_len'][0]}-"
          f"{w['output_len'][1]} output tokens, {w['sampling']}")
    line = lambda name, value: print(f"{name:<50}{value}")  # noqa: E731
    print()
    line(f"sustainable rate R (closed loop, {s['concurrency']} in flight):",
         f"{s['rate']:.2f} calls/s ({s['num_requests']} calls in {s['duration_s']:.1f} s; counted from the first "
         "round's end to the last send)")
    line(f"offered: {load['factor']:g}x R, Poisson, for {load['duration_s']:g} s:",
         f"{load['rate']:.1f} calls/s; {load['num_requests']} calls sent ({load['sent_rate']:.1f}/s)")
    line("accepted (OK):", _share(o["num_accepted"], o["num_requests"]))
    refusal = o["refusal_ms"]
    line("refused (RESOURCE_EXHAUSTED):", f"{_share(o['num_refused'], o['num_requests'])}, answered in p50 "
         f"{_f(refusal['p50'])} / p99 {_f(refusal['p99'])} ms")
    for message, n in o["refusal_messages"]:
        line("  refusal message" + (f" ({n}x)" if len(o["refusal_messages"]) > 1 else "") + ":", repr(message))
    line("other statuses (must be 0):", o["num_other"])
    for error, n in o["other_errors"]:
        line(f"  {n}x:", error)
    line("accepted calls finished with all their tokens:", f"{o['num_accepted_complete']} of {o['num_accepted']}"
         + ("" if load["last_accepted_end_s"] is None else
            f" (the last {load['last_accepted_end_s']:+.1f} s after the overload's end)"))
    if (accepted_rate := load["accepted_rate"]) is not None:
        line("accepted calls completed per second:", f"{accepted_rate:.2f} ({accepted_rate / s['rate']:.2f}x R; "
             "from the overload's start to the last one's end)")
    line("accepted calls' latency during the overload:", ", ".join(
        f"{label} p50 {_f(o[f'accepted_{key}']['p50'], '.0f')} / p99 {_f(o[f'accepted_{key}']['p99'], '.0f')} ms"
        for key, label in LATENCY_NAMES.items()))
    line(f"peak calls in progress (bound {load['max_concurrent_requests']}):", load["peak_in_progress"])
    line("drain: overload's end -> workers empty:", "not empty after "
         f"{drain['timeout_s']:g} s: {drain['held']}" if drain["held"] else f"{drain['seconds']:.1f} s")

    print("\nresident memory (MiB): start = before the overload, peak = from then on, end = after the recovery;\n"
          "late growth = at the overload's end minus at its middle (about 0 once bounded queues are full)")
    rows = [[name, _f(m["start"], ".0f"), _f(m["peak"], ".0f"), _f(m["end"], ".0f"), _f(m["growth"], "+.0f"),
             _f(m["late_growth"], "+.0f")] for name, m in results["memory"].items()]
    print(_table(["process", "start", "peak", "end", "growth", "late growth"], rows))
    print("(router = this process: the router and the load generator with its records of every call)")

    before, after, ratio = results["before"], results["after"], results["recovery"]
    print(f"\nlatency at {before['rate']:.2f} calls/s (0.5x R), {before['num_requests']} calls before and "
          f"{after['num_requests']} after the overload (ms; {after['num_complete']} of {after['num_requests']} "
          "completed after)")
    rows = [[label, _f(before[key]["p50"], ".0f"), _f(before[key]["p99"], ".0f"), _f(after[key]["p50"], ".0f"),
             _f(after[key]["p99"], ".0f"), _f(ratio[key]["p50"], ".2f"), _f(ratio[key]["p99"], ".2f")]
            for key, label in LATENCY_NAMES.items()]
    print(_table(["", "before p50", "before p99", "after p50", "after p99", "after/before p50", "p99"], rows))
    cpu = results["other_cpu_cores"]
    print(f"other processes on this machine kept {_f(cpu['before'], '.2f')} cores busy before and "
          f"{_f(cpu['after'], '.2f')} after, on average, of {cfg['cores']} (the ratios compare like with like "
          "only when these are alike)")

    if results["failures"]:
        print("\nFAIL:\n" + "\n".join(f"- {f}" for f in results["failures"]))
    else:
        print("\nPASS: every call ended OK or RESOURCE_EXHAUSTED, every accepted call got all its tokens, the "
              "workers emptied,\nand every call after the overload completed")


def _shade(ax, results: dict) -> None:
    """The overload's window on a time axis (seconds from the watch's start)."""
    start = results["phases"]["overload"]
    ax.axvspan(start, start + results["overload"]["duration_s"], color="grey", alpha=0.15, label="overload")


def write_plot(results: dict, out_dir: Path) -> Path:
    """overload.png: outcomes per second of the overload, memory and calls in progress over
    the whole run, and latency before vs after. Returns its path."""
    fig, ((outcomes, memory), (in_progress, latency)) = plt.subplots(2, 2, figsize=(13, 8))
    per_second = results["overload"]["per_second"]
    seconds = np.arange(len(per_second[OK]))
    bottom = np.zeros(len(seconds))
    for kind, counts in per_second.items():
        outcomes.bar(seconds, counts, bottom=bottom, width=1.0, align="edge", color=COLORS[kind], label=kind)
        bottom += counts
    outcomes.set_title(f"Calls per second sent during the overload ({results['overload']['factor']:g}x R)")
    outcomes.set_xlabel("second of the overload")
    outcomes.set_ylabel("calls")
    outcomes.set_ylim(top=1.3 * max(bottom.max(), 1))  # room for the legend above the bars
    outcomes.legend(fontsize=8, loc="upper right", ncols=3)

    samples = results["samples"]
    t = [s["t_s"] for s in samples]
    for name in results["memory"]:
        memory.plot(t, [np.nan if s["rss_mib"][name] is None else s["rss_mib"][name] for s in samples], label=name)
    memory.set_title("Resident memory")
    memory.set_ylabel("MiB")
    memory.set_ylim(bottom=0)

    # A sample's peak covers the interval up to it: drawn over the step before the sample.
    in_progress.step(t, [s["in_progress_peak"] for s in samples], where="pre", label="peak since the last sample")
    in_progress.axhline(results["overload"]["max_concurrent_requests"], color="tab:red", linestyle=":",
                        label="max_concurrent_requests")
    in_progress.set_title("Router: calls in progress; other processes' CPU")
    in_progress.set_ylabel("calls")
    in_progress.set_ylim(0, 1.5 * results["overload"]["max_concurrent_requests"])  # room for the legend
    other = in_progress.twinx()
    other.plot(t, [s["other_cpu_cores"] for s in samples], color="grey", linewidth=0.8)
    other.set_ylabel("cores busy with other processes (grey)")
    other.set_ylim(0, results["config"]["cores"])
    in_progress.set_zorder(other.get_zorder() + 1)  # its legend over the grey line
    in_progress.patch.set_visible(False)
    for ax in (memory, in_progress):
        _shade(ax, results)
        ax.set_xlabel("seconds from the start of the run")
    memory.legend(fontsize=8)
    in_progress.legend(fontsize=8, loc="upper left", ncols=3)

    names = [f"{label} {p}" for label in LATENCY_NAMES.values() for p in ("p50", "p99")]
    x = np.arange(len(names))
    for i, phase in enumerate(("before", "after")):
        values = [results[phase][key][p] or np.nan for key in LATENCY_NAMES for p in ("p50", "p99")]
        latency.bar(x + (i - 0.5) * 0.4, values, width=0.4, label=f"{phase} the overload")
    latency.set_xticks(x, names)
    latency.set_title(f"Latency at 0.5x R ({results['before']['rate']:.2f} calls/s)")
    latency.set_ylabel("ms")
    latency.legend(fontsize=8)
    for ax in (outcomes, memory, in_progress, latency):
        ax.grid(alpha=0.3)
    path = out_dir / "overload.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("plot written to %s", path)
    return path
