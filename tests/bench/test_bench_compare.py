"""``tandem bench compare``: the figures against two scripted OpenAI-compatible servers whose
timings are known (one twice as slow as the other), then the real command end to end against
a real ``tandem serve --colocated`` started here."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from tandem.bench import compare, compare_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class ScriptedServer:
    """POST /v1/completions streaming ``max_tokens`` chunks of one token each, the first after
    ``ttft_s`` and each next one ``itl_s`` later, then the usage chunk and [DONE]."""

    def __init__(self, name: str, ttft_s: float, itl_s: float) -> None:
        self.name, self.ttft_s, self.itl_s = name, ttft_s, itl_s
        self.bodies: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(self.ttft_s if i == 0 else self.itl_s)
            choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


@asynccontextmanager
async def serving(server: ScriptedServer) -> AsyncIterator[str]:
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def _args(urls: list[str], *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_args(parser)
    return parser.parse_args([a for url in urls for a in ("--url", url)] + list(extra))


def test_figures_and_ratios_against_scripted_servers(capsys):
    fast, slow = ScriptedServer("m", 0.05, 0.02), ScriptedServer("m", 0.10, 0.04)
    extra = ["--label", "fast", "--label", "slow", "--quick", "--seeds", "0", "1", "--output-len", "3", "5"]

    async def body():
        async with serving(fast) as u1, serving(slow) as u2:
            args = _args([u1, u2], *extra)
            settings = compare.settings_from_args(args)
            return settings, *await compare.drive(args, settings, np.arange(100, 1000))

    settings, servers, runs = asyncio.run(body())
    assert [s["label"] for s in servers] == ["fast", "slow"]
    assert not servers[0]["url"].endswith("/v1") and servers[0]["model"] == "m"
    # Both servers got exactly the same requests: the same prompts and lengths, greedy, EOS ignored.
    strip = lambda b: (b["prompt"], b["max_tokens"], b["temperature"], b["ignore_eos"], b["stream"])  # noqa: E731
    assert sorted(map(strip, fast.bodies)) == sorted(map(strip, slow.bodies))
    assert all(b["ignore_eos"] is True and b["temperature"] == 0 for b in fast.bodies)
    n = settings.num_prompts + settings.burst_size
    assert len(fast.bodies) == 2 + 2 * n  # the warm-up, then every request of both seeds
    assert len({tuple(b["prompt"]) for b in fast.bodies}) == len(fast.bodies)  # no prompt twice: no cache hits
    assert len(runs) == 2 * 2 * 2  # seeds x modes x servers
    # Who goes first alternates with the seed.
    assert [r["server"] for r in runs if r["mode"] == "burst"] == ["fast", "slow", "slow", "fast"]

    summary = compare.summarize_runs(servers, runs, settings.modes)
    for mode in settings.modes:
        f, s = summary[mode]["fast"], summary[mode]["slow"]
        for server, m in (("fast", f), ("slow", s)):
            assert m["completed"] == m["num_requests"] == m["exact_output_len"] == len(settings.seeds) * (
                settings.num_prompts if mode == "poisson" else settings.burst_size)
        # Scripted timings: TTFT >= the first delay, TPOT >= the gap (scheduling only adds).
        assert 50 <= f["ttft_ms"]["p50"] < 50 + 300 and 100 <= s["ttft_ms"]["p50"] < 100 + 300
        assert 20 <= f["tpot_ms"]["p50"] < 20 + 100 and 40 <= s["tpot_ms"]["p50"] < 40 + 100
        assert f["ratios"] == {k: 1.0 for k in f["ratios"]}
        assert 1.3 < s["ratios"]["ttft_ms_p50"] < 2.5 and 1.3 < s["ratios"]["tpot_ms_p50"] < 2.5
        assert s["ratios"]["output_throughput"] == pytest.approx(s["output_throughput"] / f["output_throughput"])
        tokens = sum(r["metrics"]["total_output_tokens"] for r in runs if r["mode"] == mode and r["server"] == "fast")
        seconds = sum(r["metrics"]["duration_s"] for r in runs if r["mode"] == mode and r["server"] == "fast")
        assert f["output_throughput"] == pytest.approx(tokens / seconds)
        assert set(f["per_seed"]) == {"0", "1"}

    results = {"servers": servers, "settings": {"modes": settings.modes, "rate": settings.rate,
                                                "num_prompts": settings.num_prompts,
                                                "burst_size": settings.burst_size, "seeds": settings.seeds},
               "workload": {"short_prompt_len": [8, 24], "long_prompt_len": [40, 60], "output_len": [3, 5],
                            "long_fraction": 0.25, "sampling": "greedy"},
               "summary": summary, "runs": runs}
    compare_report.print_report(results)
    out = capsys.readouterr().out
    assert "ratios to fast" in out and "per seed" in out and "warning" not in out
    assert re.search(r"poisson\s+slow\s+\d\.\d\dx", out)


def test_labels_and_urls():
    with pytest.raises(ValueError, match="one per server"):
        compare.settings_from_args(_args(["http://a:1", "http://b:2"], "--label", "x"))
    with pytest.raises(ValueError, match="label of its own"):
        compare.settings_from_args(_args(["http://a:1", "http://a:1"]))
    assert compare.settings_from_args(_args(["http://a:1"])) == compare.FULL
    assert compare.server_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert compare.server_url("http://h:8080/v1/") == "http://h:8080"
    # The same (mode, seed) gives the same workload; another seed or mode another.
    settings, pool = compare.QUICK, np.arange(100, 1000)
    same = compare.workload(settings, pool, "poisson", 0)
    assert same == compare.workload(settings, pool, "poisson", 0)
    assert same[0] != compare.workload(settings, pool, "poisson", 1)[0]
    assert compare.workload(settings, pool, "burst", 0)[1] == [0.0] * settings.burst_size


@pytest.fixture(scope="module")
def tandem_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``tandem serve --colocated`` (one worker, one thread, a small pool) on free
    ports -> its OpenAI base URL; stopped with Ctrl-C after. Its log goes to a file, not a
    pipe: a pipe nobody reads fills up and stalls the server."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "tandem", "serve", "--colocated", "--port", "0", "--http-port", "0",
           "--metrics-port", "0", "--num-threads", "1", "--kv-cache-memory-gib", "0.1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = None, time.monotonic() + 300
    try:
        while url is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # the server prints where it listens once it is up
            if match := re.search(r"OpenAI API: (http://\S+/v1)", log_path.read_text(errors="replace")):
                url = match.group(1)
        assert url, "tandem serve did not start:\n" + log_path.read_text(errors="replace")[-5000:]
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_quick_run_against_a_real_server(tandem_server: str, tmp_path: Path, capsys):
    """The command itself against a real tandem twice (two labels): every request completes
    with exactly the tokens asked for, and the outputs land where they should."""
    out_dir = tmp_path / "compare"
    args = _args([tandem_server, tandem_server], "--label", "a", "--label", "b", "--quick", "--out-dir",
                 str(out_dir))
    assert compare.run(args) == 0
    out = capsys.readouterr().out
    assert "TTFT p99" in out and "ratios to a" in out and "warning" not in out
    results = json.loads((out_dir / "results.json").read_text())
    assert (out_dir / "compare_latency.png").read_bytes().startswith(PNG_SIGNATURE)
    assert [s["model"] for s in results["servers"]] == ["SmolLM2-135M-Instruct"] * 2
    for run in results["runs"]:
        assert run["metrics"]["failed"] == 0
        for r in run["requests"]:
            assert r["output_tokens"] == r["usage_completion_tokens"] == r["requested_output_len"]
            assert r["finish_reason"] == "length" and 0 < r["ttft_ms"] <= r["e2el_ms"]
            assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1))
    for mode in ("poisson", "burst"):
        a, b = results["summary"][mode]["a"], results["summary"][mode]["b"]
        assert a["completed"] == a["exact_output_len"] == b["completed"] > 0
        assert all(v == 1.0 for v in a["ratios"].values()) and all(v > 0 for v in b["ratios"].values())
        shapes = [[(r["prompt_len"], r["requested_output_len"]) for r in run["requests"]]
                  for run in results["runs"] if run["mode"] == mode]
        assert shapes[0] == shapes[1]  # the same workload for both
