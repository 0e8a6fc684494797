"""``tandem bench serve``'s comparison with the best colocated setup, the max-SLO-rate
search, the time breakdown from /metrics, and their report and plots, on made-up runs (no
Ray, no model)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem.bench.serving import breakdown as bd
from tandem.bench.serving import local, sweep_plots, sweep_report
from tandem.bench.serving.load import RequestResult, summarize
from tandem.bench.serving.slo_search import RateSearch, attainment, max_rate_ratio, ratio_goal
from tandem.bench.serving.sweep import GOALS, best_colocated, compare, compared_runs, search_budget

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SLO = {"ttft": 2000.0, "tpot": 200.0}


def _run(mode: str, rate: float, tpots: Sequence[float], budget: int | None = None, ttft: float = 100.0) -> dict:
    """A run of len(tpots) 11-token requests with these TPOTs (ms) and one TTFT, over 10 s."""
    results = []
    for i, tpot in enumerate(tpots):
        r = RequestResult(i, "short", 10, 11, success=True, output_tokens=11, ttft_ms=ttft, tpot_ms=tpot,
                          e2el_ms=ttft + 10 * tpot, finish_reason="length")
        r.itl_ms = [tpot] * 10
        results.append(r)
    return {"mode": mode, "budget": budget, "rate": rate, "phase": "sweep",
            "label": f"colocated/{budget}" if mode == "colocated" else mode,
            "metrics": summarize(results, 10.0, SLO), "requests": []}


def test_best_colocated_by_goodput_then_p99_tpot():
    runs = [_run("colocated", 1.0, [100] * 9 + [300], budget=128),  # 9 good, p99 ~282
            _run("colocated", 1.0, [150] * 10, budget=256),  # 10 good, p99 150
            _run("colocated", 1.0, [120] * 10, budget=512),  # 10 good, p99 120: the best
            _run("colocated", 1.0, [50] * 8 + [900, 900], budget=1024),  # 8 good, lowest p50
            _run("colocated", 2.0, [250] * 10, budget=128), _run("colocated", 2.0, [90] * 10, budget=1024),
            _run("disaggregated", 1.0, [60] * 10, budget=1024), _run("disaggregated", 2.0, [70] * 10, budget=1024)]
    best_at_1, best_at_2 = best_colocated(runs, 1.0), best_colocated(runs, 2.0)
    assert best_at_1 is not None and best_at_1["budget"] == 512
    assert best_at_2 is not None and best_at_2["budget"] == 1024
    assert best_colocated(runs, 3.0) is None
    assert search_budget(runs) == 1024  # the best at the highest rate
    rows = compare(runs)
    assert [(c["rate"], c["colocated_budget"]) for c in rows] == [(1.0, 512), (2.0, 1024)]
    assert rows[0]["p99_tpot_ratio"] == pytest.approx(60 / 120)
    assert rows[0]["goals"] == {"p99_tpot_ratio": True, "p99_ttft_ratio": True, "goodput_ratio": False}
    assert rows[0]["goal_met"] is False
    assert [r["label"] for r in compared_runs(runs)] == ["colocated/512", "disaggregated", "colocated/1024",
                                                         "disaggregated"]


def test_rate_search_doubles_then_bisects_to_a_bracket():
    capacity = 1.7  # every rate up to it passes
    search = RateSearch(start=0.5, resolution=0.1)
    probed = []
    for _ in range(8):
        rate = search.next_rate()
        if rate is None:
            break
        probed.append(rate)
        search.record(rate, rate <= capacity)
    assert probed[:3] == [0.5, 1.0, 2.0] and probed[3] == 1.5  # doubling, then bisection
    best, failed = search.max_rate(), search.lowest_fail()
    assert best is not None and failed is not None
    assert search.bound() == "bracketed" and best <= capacity < failed
    assert (failed - best) / best <= 0.1
    # The answer is a probed pass, and the next probe above it failed.
    above = min(r for r in probed if r > best)
    assert best in probed and not above <= capacity


def test_rate_search_halves_distrusts_noise_and_stops_at_the_floor():
    search = RateSearch(start=1.0, min_rate=0.2)
    search.record(1.0, False)
    assert search.next_rate() == 0.5 and search.bound() == "none" and search.max_rate() is None
    search.record(0.5, False)
    search.record(0.25, False)
    assert search.next_rate() is None  # 0.125 is below the floor
    noisy = RateSearch(start=1.0)
    for rate, ok in ((1.0, True), (2.0, False), (3.0, True)):
        noisy.record(rate, ok)
    assert noisy.max_rate() == 1.0 and noisy.lowest_fail() == 2.0 and noisy.next_rate() == 1.5
    lower = RateSearch(start=1.0)
    lower.record(1.0, True)
    assert lower.bound() == "lower" and lower.next_rate() == 2.0


def test_max_rate_ratio_qualifiers_and_goal():
    def setup(max_rate, bound, probes=(0.5,)):
        return {"max_rate": max_rate, "bound": bound, "probes": [{"rate": r} for r in probes]}

    assert max_rate_ratio(setup(2.0, "bracketed"), setup(1.0, "bracketed")) == (2.0, "=")
    assert max_rate_ratio(setup(2.0, "lower"), setup(1.0, "bracketed")) == (2.0, ">=")
    assert max_rate_ratio(setup(2.0, "bracketed"), setup(1.0, "lower")) == (2.0, "<=")
    assert max_rate_ratio(setup(1.0, "bracketed"), setup(None, "none", (0.25, 0.5))) == (4.0, ">=")
    assert max_rate_ratio(setup(None, "none", (0.5,)), setup(1.0, "bracketed")) == (0.5, "<=")
    assert max_rate_ratio(setup(None, "none"), setup(None, "none")) == (None, "?")
    assert [ratio_goal(2.0, "=", 1.5), ratio_goal(1.2, "=", 1.5), ratio_goal(2.0, "<=", 1.5),
            ratio_goal(1.2, ">=", 1.5), ratio_goal(None, "?", 1.5)] == ["held", "missed", "unknown", "unknown",
                                                                       "unknown"]


def test_search_driver_alternates_reuses_the_sweep_and_keeps_the_budget(monkeypatch):
    """search_max_rates with runs faked: capacity 1.2 req/s disaggregated, 0.6 colocated."""
    capacity = {"disaggregated": 1.2, "colocated": 0.6}
    order = []

    async def fake_run(bench, setup, rate, phase, progress):
        order.append((setup.label, rate))
        run = _run(setup.mode, rate, [100] * 10 if rate <= capacity[setup.mode] else [400] * 10, setup.budget)
        return {**run, "others_cpu": 0.0}

    monkeypatch.setattr(local, "fresh_run", fake_run)

    class FakeBench:
        settings = type("S", (), {"rates": [0.5, 1.0], "slo_probes": 3, "num_prompts": 10})()
        args = type("A", (), {"slo_attainment": 0.9})()
        slo, retries_left = SLO, 2
        runs = [_run("disaggregated", 0.5, [100] * 10, 1024), _run("colocated", 0.5, [100] * 10, 256),
                _run("disaggregated", 1.0, [100] * 10, 1024), _run("colocated", 1.0, [400] * 10, 256)]

    # No cluster (fresh_run is faked), and a bench of what search_max_rates reads.
    setups = [local.Setup("disaggregated", 1024, None), local.Setup("colocated", 256, None)]  # type: ignore[arg-type]
    result = asyncio.run(local.search_max_rates(FakeBench(), setups, local.Progress(6)))  # type: ignore[arg-type]
    assert [label for label, _ in order] == ["disaggregated", "colocated/256"] * 3
    d, c = result["setups"]["disaggregated"], result["setups"]["colocated"]
    assert [p["source"] for p in d["probes"]].count("sweep") == 2 and len(d["probes"]) == 5
    assert d["bound"] == "bracketed" and d["max_rate"] <= 1.2 < d["next_failed_rate"]
    assert c["bound"] == "bracketed" and c["max_rate"] <= 0.6 < c["next_failed_rate"]
    for s in (d, c):
        passed = {p["rate"]: p["passed"] for p in s["probes"]}
        assert passed[s["max_rate"]] and not passed[s["next_failed_rate"]]
        assert all(p["attainment"] == attainment(p["metrics"]) for p in s["probes"])


def test_a_run_others_disturbed_is_repeated_once_while_retries_last(monkeypatch):
    shares = iter([0.4, 0.02, 0.3, 0.5, 0.6])

    async def fake_run(bench, setup, rate, phase, progress):
        return {**_run(setup.mode, rate, [100] * 4, setup.budget), "phase": phase, "others_cpu": next(shares)}

    monkeypatch.setattr(local, "fresh_run", fake_run)
    bench = type("B", (), {"retries_left": 2, "discarded": []})()
    setup, progress = local.Setup("colocated", 256, None), local.Progress(3)  # type: ignore[arg-type]  # (faked)
    measure = lambda: asyncio.run(local.measured_run(bench, setup, 1.0, "sweep", progress))  # noqa: E731
    assert measure()["others_cpu"] == 0.02 and bench.discarded[-1]["others_cpu"] == 0.4  # the repeat kept
    assert measure()["others_cpu"] == 0.3 and bench.discarded[-1]["others_cpu"] == 0.5  # the first kept
    assert measure()["others_cpu"] == 0.6 and len(bench.discarded) == 2  # no retries left
    assert bench.retries_left == 0 and progress.total == 5


def _exposition(hist: dict[tuple[str, str], tuple[float, int]], up: int = 1,
                decisions: dict[tuple[str, str], int] | None = None) -> str:
    """Prometheus text with these histograms' (sum, count) by (name, role), one bucket each,
    and the router's prefill decisions by (where, reason)."""
    lines = ["# TYPE tandem_worker_up gauge", f'tandem_worker_up{{model_name="m",role="decode",instance="d"}} {up}']
    lines += [f"# TYPE {bd.DECISIONS}_total counter"] + [
        f'{bd.DECISIONS}_total{{model_name="m",where="{where}",reason="{reason}"}} {n}'
        for (where, reason), n in (decisions or {}).items()]
    for (name, role), (s, c) in hist.items():
        labels = 'model_name="m"' + ("" if role == bd.ROUTER else f',role="{role}",instance="{role}-0"')
        lines += [f"# TYPE {name} histogram", f'{name}_bucket{{{labels},le="+Inf"}} {c}',
                  f"{name}_sum{{{labels}}} {s}", f"{name}_count{{{labels}}} {c}"]
    return "\n".join(lines) + "\n"


def test_breakdown_of_a_disaggregated_run_adds_up_to_the_ttft():
    before = {(bd.TTFT, bd.ROUTER): (1.0, 2), (bd.E2E, bd.ROUTER): (5.0, 2), (bd.TPOT, bd.ROUTER): (0.2, 2),
              (bd.ROUTER_QUEUE, bd.ROUTER): (0.02, 2), (bd.QUEUE, "prefill"): (0.1, 2),
              (bd.PREFILL, "prefill"): (0.4, 2), (bd.TRANSFER, "prefill"): (0.5, 2),
              (bd.TRANSFER, "decode"): (0.6, 2), (bd.QUEUE, "decode"): (0.7, 2), (bd.DECODE, "decode"): (4.0, 2)}
    # Four requests, per request: router queue 10 ms; the prefill worker admits it 40 ms after
    # the decode reservation, queues it 50 ms, prefills 300; its ack 10 ms after the first token
    # (so the prefill transfer span is 360 ms and the decode one 400); TTFT 500, decode 2 s.
    run = {(bd.TTFT, bd.ROUTER): 2.0, (bd.E2E, bd.ROUTER): 10.0, (bd.TPOT, bd.ROUTER): 0.4,
           (bd.ROUTER_QUEUE, bd.ROUTER): 0.04, (bd.QUEUE, "prefill"): 0.2, (bd.PREFILL, "prefill"): 1.2,
           (bd.TRANSFER, "prefill"): 1.44, (bd.TRANSFER, "decode"): 1.6, (bd.QUEUE, "decode"): 1.76,
           (bd.DECODE, "decode"): 8.0}
    after = {k: (before[k][0] + run[k], before[k][1] + 4) for k in before}
    snap_before, up_before = bd.parse_histograms(_exposition(before, decisions={("remote", "cheaper_remote"): 3}))
    snap_after, _ = bd.parse_histograms(_exposition(after, decisions={("remote", "cheaper_remote"): 7,
                                                                      ("local", "decode_idle"): 0}))
    assert up_before and snap_before[(bd.QUEUE, "prefill")] == (0.1, 2)
    parts = bd.breakdown(bd.difference(snap_before, snap_after))
    assert parts is not None
    assert parts["mode"] == "disaggregated" and parts["requests"] == 4
    expected = {"queue_ms": 100, "prefill_ms": 300, "transfer_tail_ms": 10, "delivery_ms": 100, "ttft_ms": 500,
                "decode_ms": 2000, "tpot_ms": 100, "e2e_ms": 2500, "prefill_admission_ms": 40}
    assert parts.pop("prefill_decisions") == {"remote/cheaper_remote": 4}
    assert parts == pytest.approx({"mode": "disaggregated", "requests": 4, **expected})
    ttft_parts = ("queue_ms", "prefill_ms", "delivery_ms")  # the tail runs beside the delivery
    assert sum(parts[k] for k in ttft_parts) == pytest.approx(parts["ttft_ms"])
    assert not bd.parse_histograms(_exposition(before, up=0))[1]


def test_run_scrapes_difference_two_scrapes_of_a_metrics_endpoint():
    """RunScrapes against an HTTP /metrics that answers one text, then the next."""
    from aiohttp import web

    spans = {(bd.TTFT, bd.ROUTER): 0.5, (bd.E2E, bd.ROUTER): 2.0, (bd.TPOT, bd.ROUTER): 0.1,
             (bd.QUEUE, "colocated"): 0.1, (bd.PREFILL, "colocated"): 0.3, (bd.DECODE, "colocated"): 1.5}
    texts = [_exposition({k: (v, 1) for k, v in spans.items()}), _exposition({k: (3 * v, 3) for k, v in spans.items()})]

    async def main() -> tuple[dict, dict]:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=texts.pop(0))

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        port = server.sockets[0].getsockname()[1]
        try:
            scrapes = bd.RunScrapes(f"http://127.0.0.1:{port}/metrics")
            await scrapes.start()
            return await scrapes.finish(), await bd.RunScrapes(None).finish()
        finally:
            await runner.cleanup()

    measured, unasked = asyncio.run(main())
    parts = measured["breakdown"]
    assert measured["breakdown_note"] is None and parts["requests"] == 2 and parts["mode"] == "colocated"
    assert measured["histograms"][f"{bd.PREFILL}{{role=colocated}}"] == pytest.approx([0.6, 2])
    assert (parts["queue_ms"], parts["prefill_ms"], parts["delivery_ms"]) == pytest.approx((100, 300, 100))
    assert unasked == {"breakdown": None, "breakdown_note": None}


def _prefix_counters(*requests: tuple[int, int], policy: str = "precise_prefix") -> str:
    """A router's /metrics text (its own registry) once ``policy`` placed these requests on
    prefill workers: (predicted, reported) prompt tokens each."""
    from prometheus_client import generate_latest

    from tandem.router.metrics import RouterMetrics

    metrics = RouterMetrics("m", 2048)
    for predicted, reported in requests:
        metrics.prefix_prediction(policy, "prefill", predicted, reported)
    return generate_latest(metrics.registry).decode()


def test_prefix_prediction_of_a_run_and_its_report_line(capsys):
    from tandem.bench.serving.plots import print_run

    earlier = [(400, 500)]
    before, _ = bd.parse_histograms(_prefix_counters(*earlier))
    after, _ = bd.parse_histograms(_prefix_counters(*earlier, (6100, 6050), (5500, 5750), (0, 0)))
    prediction = bd.prefix_prediction(bd.difference(before, after))
    assert prediction == {"precise_prefix": {"predicted_tokens": 11600, "reported_tokens": 11800,
                                             "error_tokens": 300, "relative_error": pytest.approx(300 / 11800)}}
    assert bd.prefix_prediction(bd.difference(after, after)) == {}  # nothing moved: nothing to print
    run = {**_run("server", 1.0, [100] * 2), "prefix_prediction": prediction}
    print_run(run)
    no_hits = bd.parse_histograms(_prefix_counters((64, 0), policy="prefix_aware"))[0]
    print_run({**run, "prefix_prediction": bd.prefix_prediction(bd.difference({}, no_hits))})
    out = capsys.readouterr().out.splitlines()
    assert ("prefix prediction (precise_prefix): predicted 11600 tokens, workers reported 11800, error 2.5% "
            "(sum |predicted-reported| / reported)") in out
    assert ("prefix prediction (prefix_aware): predicted 64 tokens, workers reported 0, error - (the workers "
            "reported no hits) (sum |predicted-reported| / reported)") in out


def test_breakdown_of_a_colocated_run():
    delta: bd.Snapshot = {
        (bd.TTFT, bd.ROUTER): (1.0, 2), (bd.E2E, bd.ROUTER): (4.0, 2), (bd.TPOT, bd.ROUTER): (0.2, 2),
        (bd.QUEUE, "colocated"): (0.2, 2), (bd.PREFILL, "colocated"): (0.6, 2), (bd.DECODE, "colocated"): (3.0, 2)}
    parts = bd.breakdown(delta)
    assert parts is not None
    assert parts["mode"] == "colocated" and parts["transfer_tail_ms"] is None
    assert (parts["queue_ms"], parts["prefill_ms"], parts["delivery_ms"]) == pytest.approx((100, 300, 100))
    assert bd.breakdown({}) is None  # nothing finished
    assert bd.breakdown({(bd.TTFT, bd.ROUTER): (1.0, 2)}) is None  # no worker spans


def _results(tmp_path: Path) -> dict:
    runs = [_run("disaggregated", 0.5, [60] * 10, 1024), _run("colocated", 0.5, [120] * 10, 128),
            _run("colocated", 0.5, [100] * 10, 512), _run("disaggregated", 1.0, [70] * 10, 1024),
            _run("colocated", 1.0, [300] * 10, 128), _run("colocated", 1.0, [250] * 9 + [150], 512)]
    runs[0]["breakdown"] = {"mode": "disaggregated", "requests": 10, "queue_ms": 1.0, "prefill_ms": 2.0,
                            "transfer_tail_ms": 3.0, "delivery_ms": 4.0, "ttft_ms": 10.0, "decode_ms": 50.0,
                            "tpot_ms": 5.0, "e2e_ms": 60.0, "prefill_admission_ms": 0.5}
    runs[2]["breakdown_note"] = "a worker did not answer a scrape"
    search = {"attainment": 0.9, "slo_ms": SLO, "num_prompts": 10, "max_probes": 2, "max_rate_ratio": 2.0,
              "max_rate_ratio_qualifier": "=", "setups": {
                  "disaggregated": {"label": "disaggregated", "budget": 1024, "max_rate": 1.0, "bound": "bracketed",
                                    "next_failed_rate": 2.0, "probes": [
                                        {"rate": 0.5, "attainment": 1.0, "passed": True},
                                        {"rate": 1.0, "attainment": 1.0, "passed": True},
                                        {"rate": 2.0, "attainment": 0.5, "passed": False}]},
                  "colocated": {"label": "colocated/512", "budget": 512, "max_rate": 0.5, "bound": "bracketed",
                                "next_failed_rate": 1.0, "probes": [
                                    {"rate": 0.5, "attainment": 1.0, "passed": True},
                                    {"rate": 1.0, "attainment": 0.1, "passed": False}]}}}
    return {"config": {"slo_ms": SLO}, "runs": runs, "comparison": compare(runs), "slo_search": search}


def test_report_and_plots_of_the_sweep(tmp_path: Path, capsys):
    results = _results(tmp_path)
    paths = sweep_plots.write_sweep_plots(results, tmp_path)
    assert [p.name for p in paths] == ["sweep.png", "slo_attainment.png"]
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in paths)
    sweep_report.print_sweep_report(results)
    out = capsys.readouterr().out
    assert "best colocated at a rate = the highest goodput" in out and "colocated/512" in out
    assert "KV transfer tail" in out and "no breakdown: a worker did not answer a scrape" in out
    assert "1 (next probe above, 2, missed)" in out and "0.5 (next probe above, 1, missed)" in out
    for key in GOALS:
        what, op, bound = GOALS[key]
        assert f"{what} {op} {bound:g}x" in out
    assert "held at 2 of 2 rates (0.5, 1)" in out  # p99 TPOT 0.5x and 0.28x
    max_row = next(line for line in out.splitlines() if line.lstrip().startswith("max SLO rate >="))
    assert "2.00x" in max_row and max_row.rstrip().endswith("held")
    # colocated/512: 1 request within the SLO beats 128's none
    best_at_1 = results["runs"][5]["metrics"]["tpot_ms"]["p99"]
    assert math.isclose(results["comparison"][1]["p99_tpot_ratio"], 70 / best_at_1)


def test_cpu_watch_counts_a_process_outside_the_cluster_as_others():
    """A child spinning one of the cores for a second, not among the watched pids: others
    took at least about a core's share (neighbours only add to it)."""
    import subprocess
    import sys

    import psutil

    from tandem.bench.serving.interference import CpuWatch

    watch = CpuWatch([])
    watch.start()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
    subprocess.run([sys.executable, "-c", spin], check=True, timeout=60)
    share = watch.stop()
    assert 0.8 / (psutil.cpu_count() or 1) <= share <= 1.0
