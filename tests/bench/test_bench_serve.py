"""``tandem bench serve``: the workload and arrivals, the metric definitions, the report, and
a --quick run end to end (both clusters started by the command itself)."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.bench import serve as bench_serve
from tandem.bench.serving.load import (
    Mix,
    RequestResult,
    arrival_offsets,
    make_requests,
    meets_slo,
    parse_goodput,
    summarize,
)
from tandem.bench.serving.sweep import best_key, compare
from tandem.bench.serving.vllm_format import result_file_name
from tandem.bench.workload import allowed_token_ids
from tandem.config import WorkerConfig

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_mix_is_seeded_with_exact_long_share():
    pool = allowed_token_ids(1000, excluded={0, 999})
    mix = Mix((20, 80), (600, 1200), (16, 64), 0.2)
    requests = make_requests(50, pool, mix, seed=3)
    assert sum(r.kind == "long" for r in requests) == 10
    for r in requests:
        lo, hi = mix.long_prompt_len if r.kind == "long" else mix.short_prompt_len
        assert lo <= len(r.prompt_token_ids) <= hi and 16 <= r.output_len <= 64
        assert all(t not in (0, 999) for t in r.prompt_token_ids)
    assert make_requests(50, pool, mix, seed=3) == requests
    assert make_requests(50, pool, mix, seed=4) != requests
    with pytest.raises(ValueError):
        make_requests(5, pool, Mix((10, 5), (1, 2), (1, 2), 0.2), seed=0)


def test_arrivals_gamma_with_the_rate_as_mean():
    offsets = arrival_offsets(4001, rate=2.0, burstiness=1.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.5) < 0.03 and abs(gaps.std() - 0.5) < 0.05  # exponential: std = mean
    bursty = np.diff(arrival_offsets(4001, rate=2.0, burstiness=0.25, seed=0))
    assert abs(bursty.mean() - 0.5) < 0.06 and bursty.std() > 1.5 * gaps.std()  # gamma: cv = 1/sqrt(shape)
    assert arrival_offsets(4001, 2.0, 1.0, seed=0) == offsets and arrival_offsets(4001, 2.0, 1.0, seed=1) != offsets
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]


def test_goodput_parsing():
    assert parse_goodput(["ttft:2000", "tpot:200", "e2el:9000.5"]) == {"ttft": 2000, "tpot": 200, "e2el": 9000.5}
    for bad in ("ttft", "itl:5", "tpot:x", "tpot:-1"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def _result(i: int, ttft: float, e2el: float, n: int, success: bool = True) -> RequestResult:
    r = RequestResult(i, "short", 10, n, success=success, output_tokens=n, ttft_ms=ttft, e2el_ms=e2el,
                      tpot_ms=(e2el - ttft) / (n - 1) if success else None)
    r.itl_ms = [(e2el - ttft) / (n - 1)] * (n - 1)
    return r


def test_summary_slo_and_ratios():
    results = [_result(0, 100, 1000, 10), _result(1, 3000, 4000, 11), _result(2, 50, 5050, 11),
               _result(3, 0, 0, 5, success=False)]
    slo = {"ttft": 2000.0, "tpot": 200.0}
    assert [meets_slo(r, slo) for r in results] == [True, False, False, False]  # ttft too slow, tpot 500 ms
    m = summarize(results, duration=2.0, slo=slo)
    assert m["completed"] == 3 and m["failed"] == 1 and m["good_requests"] == 1 and m["goodput"] == 0.5
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 16.0
    assert np.isclose(m["tpot_ms"]["p99"], np.percentile([100, 100, 500], 99))
    assert m["ttft_ms"]["median"] == 100 and m["e2el_ms"]["mean"] == pytest.approx(10050 / 3)
    runs = [{"mode": mode, "rate": 1.0, "metrics": summarize(rs, 2.0, slo), "requests": []}
            for mode, rs in (("disaggregated", results[:1]), ("colocated", results[:3]))]
    (row,) = compare(runs)
    assert row["p99_tpot_ratio"] == pytest.approx(100 / np.percentile([100, 100, 500], 99))
    assert row["goodput_ratio"] == 1.0 and row["goal_met"] is False  # goodput not higher


def test_quick_defaults_and_overrides():
    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    assert bench_serve.settings_from_args(parser.parse_args([])) == bench_serve.FULL
    quick = bench_serve.settings_from_args(parser.parse_args(["--quick", "--request-rate", "1", "inf"]))
    assert quick.rates == [1.0, math.inf] and quick.num_prompts == bench_serve.QUICK.num_prompts
    with pytest.raises(ValueError):
        bench_serve.settings_from_args(parser.parse_args(["--request-rate", "0"]))
    configs = bench_serve.cluster_configs(2, 1, WorkerConfig())
    assert configs["disaggregated"].worker.num_threads == 1
    assert configs["colocated"].worker.num_threads == 2


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path):
    """Four fresh clusters (6 model loads): disaggregated and colocated at budget 128 (the
    --quick sweep's other budget, 512, is a cluster more of the same plumbing; comparing against the
    best of several is test_summary_slo_and_ratios'), 6 requests each at 4 req/s (--quick's 2 req/s
    would spend twice as long sending), then one max-SLO-rate probe per mode: about 1 min quiet."""
    out_dir = tmp_path / "serve"
    # Every prompt through the prefill pool: the breakdown's transfer parts are all there.
    # No repeats of runs others disturbed (a fresh cluster each): the plumbing is the same, and
    # test_bench_serve_sweep.py checks the repeat itself.
    cmd = [sys.executable, "-m", "tandem", "bench", "serve", "--quick", "--out-dir", str(out_dir), "--save-result",
           "--disagg-policy", "always", "--request-rate", "4", "--retries", "0",
           "--colocated-budgets", "128"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for text in ("Successful requests:", "P99 TPOT (ms):", "disaggregated / best colocated",
                 "best colocated at a rate = the highest goodput", "where the time goes", "KV transfer tail",
                 "max SLO rate: the highest request rate", "goals (issue 19)", "max SLO rate >= 1.5x",
                 "others' CPU", "router hop: added latency", "added p99"):
        assert text in proc.stdout, text
    assert re.search(r"run \d+ of at most \d+ \(slo search\): colocated/\d+ @ [\d.]+ req/s", proc.stderr)  # progress

    results = json.loads((out_dir / "results.json").read_text())
    assert {"config", "workload", "runs", "router_overhead", "comparison", "slo_search"} <= results.keys()
    assert results["discarded_runs"] == [] and results["config"]["retries"] == 0
    cfg = results["config"]
    assert cfg["modes"]["disaggregated"]["total_threads"] == cfg["modes"]["colocated"]["total_threads"]
    assert cfg["slo_ms"] == {"ttft": 4000.0, "tpot": 200.0} and cfg["colocated_budgets"] == [128]
    runs = results["runs"]
    assert [(r["mode"], r["budget"], r["rate"]) for r in runs] == [
        ("disaggregated", 1024, 4.0), ("colocated", 128, 4.0)]
    assert results["workload"]["num_long"] == [1]
    prompts = None
    for run in runs:
        m, requests = run["metrics"], run["requests"]
        assert len(requests) == 6 and m["completed"] == 6 and m["failed"] == 0 and m["exact_output_len"] == 6
        shape = [(q["kind"], q["prompt_len"], q["requested_output_len"]) for q in requests]
        assert prompts in (None, shape)  # the same workload in every setup
        prompts = shape
        for q in requests:
            assert q["success"] and q["error"] is None and q["finish_reason"] == "length"
            assert q["output_tokens"] == q["requested_output_len"] == q["usage_completion_tokens"]
            assert 0 < q["ttft_ms"] <= q["e2el_ms"]
            assert q["tpot_ms"] == pytest.approx((q["e2el_ms"] - q["ttft_ms"]) / (q["output_tokens"] - 1))
            assert len(q["itl_ms"]) == q["num_chunks"] - 1 and all(x >= 0 for x in q["itl_ms"])
            assert sum(q["itl_ms"]) <= q["e2el_ms"] - q["ttft_ms"] + 1e-6
        tpots = [q["tpot_ms"] for q in requests]
        assert m["tpot_ms"]["p99"] == pytest.approx(np.percentile(tpots, 99))
        assert m["ttft_ms"]["mean"] == pytest.approx(np.mean([q["ttft_ms"] for q in requests]))
        assert m["itl_ms"]["p50"] == pytest.approx(np.median([x for q in requests for x in q["itl_ms"]]))
        good = sum(q["ttft_ms"] <= 4000 and q["tpot_ms"] <= 200 for q in requests)
        assert m["good_requests"] == good and m["goodput"] == pytest.approx(good / m["duration_s"])
        assert m["output_throughput"] == pytest.approx(sum(q["output_tokens"] for q in requests) / m["duration_s"])
        assert max(q["send_s"] for q in requests) < m["duration_s"]
        # The breakdown: this run's 6 requests, queue + prefill + delivery adding up to the
        # router's TTFT, which starts after the client's clock and ends before it.
        b = run["breakdown"]
        assert b is not None and b["mode"] == run["mode"] and b["requests"] == 6, run.get("breakdown_note")
        assert b["queue_ms"] + b["prefill_ms"] + b["delivery_ms"] == pytest.approx(b["ttft_ms"])
        assert 0 < b["ttft_ms"] < m["ttft_ms"]["mean"] and 0 < b["e2e_ms"] < m["e2el_ms"]["mean"]
        assert b["prefill_ms"] > 0 and b["decode_ms"] > 0 and b["delivery_ms"] > 0
        assert (b["transfer_tail_ms"] is None) == (run["mode"] == "colocated")
        assert b["prefill_decisions"] == ({"remote/policy_always": 6} if run["mode"] == "disaggregated" else {})
        assert 0 <= run["others_cpu"] <= 1
    # --save-result: each sweep run under vLLM's flat keys too.
    for run in runs:
        flat = json.loads((out_dir / result_file_name(run)).read_text())
        assert flat["mean_ttft_ms"] == pytest.approx(run["metrics"]["ttft_ms"]["mean"])
        assert flat["p99_tpot_ms"] == pytest.approx(run["metrics"]["tpot_ms"]["p99"])
        assert flat["request_goodput"] == pytest.approx(run["metrics"]["goodput"]) and flat["completed"] == 6
    for mode in ("disaggregated", "colocated"):
        o = results["router_overhead"][mode]
        assert o["num_pairs"] == 4 and len(o["added_ms_values"]) == 4
        assert o["router_ms"]["p50"] > 0 and o["direct_ms"]["p50"] > 0

    (row,) = results["comparison"]
    best = min(runs[1:], key=best_key)  # the rule, by hand: most good requests, then p99 TPOT
    assert row["colocated_budget"] == best["budget"]
    assert not any(r["metrics"]["good_requests"] > best["metrics"]["good_requests"] for r in runs[1:])
    d, c = runs[0]["metrics"], best["metrics"]
    assert row["p99_tpot_ratio"] == pytest.approx(d["tpot_ms"]["p99"] / c["tpot_ms"]["p99"])
    assert row["p99_ttft_ratio"] == pytest.approx(d["ttft_ms"]["p99"] / c["ttft_ms"]["p99"])
    assert row["goals"]["p99_tpot_ratio"] == (row["p99_tpot_ratio"] <= 0.5)
    assert isinstance(row["goal_met"], bool)

    search = results["slo_search"]
    assert search["setups"]["colocated"]["budget"] == best["budget"]  # searched: the best at the top rate
    for s in search["setups"].values():
        probes = s["probes"]
        assert [p["rate"] for p in probes] == sorted({p["rate"] for p in probes})
        assert [p["rate"] for p in probes if p["source"] == "sweep"] == [4.0]
        assert sum(p["source"] == "probe" for p in probes) <= 1
        for p in probes:
            total = p["metrics"]["completed"] + p["metrics"]["failed"]
            assert p["attainment"] == p["metrics"]["good_requests"] / total and p["passed"] == (p["attainment"] >= 0.9)
        passed = {p["rate"]: p["passed"] for p in probes}
        if s["bound"] == "bracketed":  # a probed pass, and the next probe above it failed
            above = min(r for r in passed if r > s["max_rate"])
            assert passed[s["max_rate"]] and above == s["next_failed_rate"] and not passed[above]
        elif s["bound"] == "lower":
            assert all(passed.values()) and s["max_rate"] == max(passed)
        else:
            assert s["max_rate"] is None and not any(passed.values())
    for name in ("distributions.png", "latency_cdf.png", "goodput.png", "sweep.png", "slo_attainment.png"):
        assert (out_dir / name).read_bytes().startswith(PNG_SIGNATURE)
    report = (out_dir / "report.html").read_text()
    assert report.count("<tr><td>") == len(runs) and '<img src="distributions.png"' in report
    assert f"<td>{d['ttft_ms']['p99']:.1f}</td>" in report and f"<td>{c['tpot_ms']['p50']:.1f}</td>" in report
