"""``tandem bench overload``: its summaries of outcomes, memory and latency, its verdict, the
watch over memory and calls in progress, and a --quick run end to end (the command starts
its own cluster)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.bench import overload as bench_overload
from tandem.bench.overloading.summary import (
    accepted_rate,
    baseline,
    closed_loop_rate,
    complete,
    failures,
    last_accepted_end_s,
    memory,
    other_cpu_by_phase,
    outcomes,
    per_second,
    recovery,
)
from tandem.bench.overloading.watch import ROUTER, Sample, Watch
from tandem.bench.serving.load import Mix, RequestResult, make_requests, with_fresh_tokens
from tandem.bench.workload import allowed_token_ids

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REFUSAL = "32 requests are in progress, the limit max_concurrent_requests=32: retry later"


def _call(i: int, code: str, send_s: float = 0.0, e2el_ms: float = 100.0, tokens: int = 8,
          wanted: int = 8, ttft_ms: float | None = 10.0) -> RequestResult:
    ok = code == "OK"
    return RequestResult(i, "short", 20, wanted, send_s=send_s, success=ok and tokens == wanted, code=code,
                         error=None if ok else f"{code}: {REFUSAL if code == 'RESOURCE_EXHAUSTED' else 'boom'}",
                         output_tokens=tokens if ok else 0, ttft_ms=ttft_ms if ok else None, e2el_ms=e2el_ms,
                         finish_reason="length" if ok else None)


def test_outcomes_by_status_with_messages_and_completeness():
    calls = [_call(0, "OK", e2el_ms=900), _call(1, "RESOURCE_EXHAUSTED", e2el_ms=2),
             _call(2, "RESOURCE_EXHAUSTED", e2el_ms=4), _call(3, "OK", tokens=5), _call(4, "UNAVAILABLE")]
    o = outcomes(calls)
    assert o["num_requests"] == 5 and o["by_code"] == {"OK": 2, "RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}
    assert (o["num_accepted"], o["num_refused"], o["num_other"]) == (2, 2, 1)
    assert o["num_accepted_complete"] == 1 and o["incomplete"] == [3]  # 5 of 8 tokens
    assert o["refusal_messages"] == [(REFUSAL, 2)]  # the message once, without the code
    assert o["other_errors"] == [("UNAVAILABLE: boom", 1)]
    assert o["refusal_ms"]["p50"] == 3.0 and o["accepted_e2el_ms"]["p50"] == 900.0  # complete calls only
    assert [complete(c) for c in calls] == [True, False, False, False, False]


def test_outcomes_per_second_and_last_accepted_end():
    calls = [_call(0, "OK", 0.2), _call(1, "RESOURCE_EXHAUSTED", 0.9), _call(2, "OK", 1.5, e2el_ms=4000),
             _call(3, "CANCELLED", 2.1), _call(4, "RESOURCE_EXHAUSTED", 3.2)]  # sent just past the window
    counts = per_second(calls, duration_s=3.0)
    assert counts == {"OK": [1, 1, 0], "RESOURCE_EXHAUSTED": [1, 0, 1], "other": [0, 0, 1]}
    assert last_accepted_end_s(calls) == pytest.approx(5.5)
    assert last_accepted_end_s([_call(0, "RESOURCE_EXHAUSTED")]) is None
    assert accepted_rate(calls) == pytest.approx(2 / 5.5)  # 2 complete calls, the last ending at 5.5 s
    assert accepted_rate([_call(0, "RESOURCE_EXHAUSTED")]) is None


def test_closed_loop_rate_counts_from_the_first_rounds_end_to_the_last_send():
    """2 slots and calls of 1 s in steady state, after a first round that ended at 0.5 s and
    3 s (sent at once, prefilled in one batch): the rate counts the ends in (3 s, 4.5 s]."""
    calls = [_call(0, "OK", 0.0, 500), _call(1, "OK", 0.0, 3000), _call(2, "OK", 0.5, 3000),
             _call(3, "OK", 3.0, 1000), _call(4, "OK", 3.5, 1000), _call(5, "OK", 4.0, 1000),
             _call(6, "OK", 4.5, 1000)]
    # ends: 0.5, 3 | 3.5, 4, 4.5 | 5, 5.5; from the first end on it would read 4 / 4 s = 1 call/s.
    assert closed_loop_rate(calls, concurrency=2) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        closed_loop_rate(calls[:4], concurrency=2)  # two rounds: nothing ends between them and the last send


def _sample(t: float, router: float, worker: float | None, peak: int = 0, other_cpu: float = 0.0) -> Sample:
    return Sample(t, {ROUTER: router, "decode-0": worker}, peak, peak, other_cpu)


def test_memory_start_peak_end_and_growth():
    samples = [_sample(0, 100, 1000), _sample(1, 110, 1200), _sample(2, 150, 1300), _sample(3, 160, 1310),
               _sample(4, 160, 1310), _sample(5, 140, None), _sample(6, 130, 1250)]
    m = memory(samples, overload_start_s=1.5, overload_end_s=4.5)
    assert m[ROUTER] == {"start": 110, "peak": 160, "end": 130, "growth": 20, "late_growth": 0}  # middle 3.0 s
    assert m["decode-0"] == {"start": 1200, "peak": 1310, "end": 1250, "growth": 50, "late_growth": 0}
    gone = memory(samples[:6], 1.5, 4.5)["decode-0"]  # a restarted worker: its memory is unknown
    assert gone["end"] is None and gone["growth"] is None and gone["peak"] == 1310


def test_other_cpu_by_phase_counts_each_sample_in_the_phase_it_ends_in():
    samples = [_sample(t, 100, 1000, other_cpu=cpu) for t, cpu in ((0, 9), (1, 0.5), (2, 1.5), (3, 0.2), (4, 0))]
    cpu = other_cpu_by_phase(samples, {"before": 0.0, "overload": 2.0, "after": 2.5, "end": 4.0})
    assert cpu == {"before": pytest.approx(1.0), "overload": None, "after": pytest.approx(0.1)}


def test_baseline_counts_complete_calls_and_recovery_is_after_over_before():
    before = baseline([_call(0, "OK", ttft_ms=10, e2el_ms=100), _call(1, "OK", ttft_ms=30, e2el_ms=300)], 2.0)
    assert before["rate"] == 2.0 and before["num_requests"] == before["num_complete"] == 2
    assert before["ttft_ms"]["p50"] == 20 and before["e2el_ms"]["p50"] == 200
    after = baseline([_call(0, "OK", ttft_ms=20, e2el_ms=200), _call(1, "OK", ttft_ms=60, e2el_ms=600),
                      _call(2, "UNAVAILABLE")], 2.0)
    assert after["num_requests"] == 3 and after["num_complete"] == 2
    ratios = recovery(before, after)
    assert ratios["ttft_ms"]["p50"] == pytest.approx(2.0) and ratios["e2el_ms"]["p99"] == pytest.approx(2.0)


def _passing() -> dict:
    calls = [_call(0, "OK"), _call(1, "RESOURCE_EXHAUSTED")]
    done = baseline([_call(0, "OK")], 1.0)
    return {"overload": {"outcomes": outcomes(calls), "peak_in_progress": 32, "max_concurrent_requests": 32},
            "drain": {"held": {}, "timeout_s": 60.0, "seconds": 2.0}, "after": done}


def test_failures_name_each_broken_promise():
    assert failures(_passing()) == []
    broken = _passing()
    broken["overload"]["outcomes"] = outcomes([_call(0, "OK", tokens=3), _call(1, "INTERNAL")])
    broken["overload"]["peak_in_progress"] = 33
    broken["drain"]["held"] = {"decode-0": ["num_running=1"]}
    broken["after"] = baseline([_call(0, "OK"), _call(1, "UNAVAILABLE")], 1.0)
    found = failures(broken)
    assert len(found) == 5
    assert "1 calls ended with a status other than OK or RESOURCE_EXHAUSTED: 1x INTERNAL: boom" in found[0]
    assert "1 of 1 accepted calls did not get all their tokens" in found[1]
    assert "33 calls were in progress at once, past the bound 32" in found[2]
    assert "not empty" in found[3] and "num_running=1" in found[3]
    assert "1 of 2 calls" in found[4]


def test_quick_defaults_and_overrides():
    parser = argparse.ArgumentParser()
    bench_overload.add_args(parser)
    full = bench_overload.settings_from_args(parser.parse_args([]))
    assert full == replace(bench_overload.FULL, concurrency=32)  # the closed loop: as many calls as the router admits
    quick = bench_overload.settings_from_args(parser.parse_args(["--quick", "--duration", "2"]))
    assert quick.duration_s == 2 and quick.sustain_rounds == bench_overload.QUICK.sustain_rounds
    for bad in (["--factor", "0"], ["--duration", "-1"], ["--concurrency", "0"], ["--max-concurrent-requests", "0"],
                ["--concurrency", "33"], ["--sustain-rounds", "2"]):
        with pytest.raises(ValueError):
            bench_overload.settings_from_args(parser.parse_args(bad))
    assert bench_overload.settings_from_args(parser.parse_args(["--max-concurrent-requests", "8"])).concurrency == 8
    assert bench_overload.settings_from_args(parser.parse_args(["--concurrency", "4"])).concurrency == 4
    assert quick.concurrency == bench_overload.QUICK.concurrency
    config = bench_overload.cluster_config(parser.parse_args([]), cores=2)
    assert (config.num_prefill, config.num_decode, config.worker.num_threads) == (1, 1, 1)


def test_fresh_tokens_keep_the_workload_shape():
    """The baseline after the overload: the same lengths as before, prompts of its own."""
    pool = allowed_token_ids(1000, excluded={0})
    before = make_requests(20, pool, Mix((16, 48), (1, 1), (8, 16), 0.0), seed=1)
    after = with_fresh_tokens(before, pool, seed=2)
    assert [(len(r.prompt_token_ids), r.output_len, r.kind) for r in after] == \
        [(len(r.prompt_token_ids), r.output_len, r.kind) for r in before]
    assert all(a.prompt_token_ids[:4] != b.prompt_token_ids[:4] for a, b in zip(after, before))  # no shared prefix
    assert all(0 not in r.prompt_token_ids for r in after) and with_fresh_tokens(before, pool, seed=2) == after


def test_watch_samples_memory_and_peak_calls_in_progress():
    """No cluster: this process alone, and a counter that spikes between two samples."""
    async def watch() -> Watch:
        in_progress = iter([0, 5, 1] + [1] * 1000)  # 5 lasts one poll, far shorter than a sample
        async with Watch({}, lambda: next(in_progress), interval_s=0.2, poll_s=0.01) as w:
            w.mark("overload")
            await asyncio.sleep(0.5)
        return w

    w = asyncio.run(watch())
    assert 3 <= len(w.samples) <= 5 and list(w.samples[0].rss_mib) == [ROUTER]
    # MiB: a Python process with numpy loaded
    assert all((mib := s.rss_mib[ROUTER]) is not None and mib > 10 for s in w.samples)
    assert max(s.in_progress_peak for s in w.samples) == 5 and w.samples[-1].in_progress == 1
    assert all(s.other_cpu_cores >= 0 for s in w.samples)
    assert w.samples == sorted(w.samples, key=lambda s: s.t_s) and 0 <= w.phases["overload"] < 0.1


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path):
    """1 prefill + 1 decode worker (2 model loads), then about 15 s of calls: shorter prompts and
    outputs than --quick's, so that every phase (the closed loop, the baselines, the drain) is
    shorter; the overload offers 10x whatever rate the closed loop measured all the same."""
    out_dir = tmp_path / "overload"
    cmd = [sys.executable, "-m", "tandem", "bench", "overload", "--quick", "--out-dir", str(out_dir),
           "--prompt-len", "8", "24", "--output-len", "3", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for text in ("sustainable rate R", "refused (RESOURCE_EXHAUSTED)", "drain:", "after/before p50", "PASS"):
        assert text in proc.stdout, text

    results = json.loads((out_dir / "results.json").read_text())
    load, o = results["overload"], results["overload"]["outcomes"]
    assert results["failures"] == [] and results["sustainable"]["rate"] > 0 and load["accepted_rate"] > 0
    assert results["sustainable"]["num_requests"] == 3 * 16  # --quick: 3 rounds of 16 calls in flight
    assert set(o["by_code"]) == {"OK", "RESOURCE_EXHAUSTED"} and o["num_other"] == 0
    assert o["num_accepted"] >= 1 and o["num_refused"] >= 1
    assert "max_concurrent_requests=32" in o["refusal_messages"][0][0]
    assert o["num_accepted_complete"] == o["num_accepted"] == load["outcomes"]["by_code"]["OK"]
    codes = [q["code"] for q in results["requests"]]
    assert len(codes) == load["num_requests"] == o["num_requests"]
    for q in results["requests"]:
        if q["code"] == "OK":
            assert q["output_tokens"] == q["requested_output_len"]
    assert 1 <= load["peak_in_progress"] <= load["max_concurrent_requests"] == 32
    assert results["drain"]["held"] == {} and results["drain"]["seconds"] >= 0
    after = results["after"]
    assert after["num_complete"] == after["num_requests"] == 8
    assert all(v is not None and v > 0 for ratios in results["recovery"].values() for v in ratios.values())
    assert {"router", "overload-prefill-0", "overload-decode-0"} == results["memory"].keys()
    assert all(m["peak"] >= m["start"] > 0 for m in results["memory"].values())
    assert list(results["phases"]) == ["warm-up", "sustain", "before", "overload", "drain", "after", "end"]
    assert results["other_cpu_cores"].keys() == set(results["phases"]) - {"end"}
    assert (out_dir / "overload.png").read_bytes().startswith(PNG_SIGNATURE)
