"""``--dataset-name mooncake``: a Mooncake trace read line by line (malformed lines refused
with their number), its hash ids turned into shared token blocks (at any block size), its
timestamps into arrival offsets rescaled to a mean rate, and the bench sending it through
the real load path to a stand-in gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from grpc_stand_in import grpc_server

from tandem.bench import serve as bench_serve
from tandem.bench.serving.trace import (
    TraceRow,
    block_token_ids,
    read_trace,
    scaled_input_len,
    trace_offsets,
    trace_rate,
    trace_requests,
)
from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc

POOL = np.arange(1000, 5000)
ROWS = [  # ids 7 and 8 shared by the first two; 8 alone at position 0 of the third (another prefix in a real trace)
    {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [7, 8, 9]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 60, "hash_ids": [7, 8, 10]},
    {"timestamp": 2500, "input_length": 512, "output_length": 7, "hash_ids": [8]},
]


def _write(tmp_path: Path, lines: list, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _row(timestamp_ms: float, input_len: int = 10, output_len: int = 4) -> TraceRow:
    return TraceRow(timestamp_ms, input_len, output_len, tuple(range(-(-input_len // 512))))


def test_equal_hash_ids_give_equal_blocks_and_different_ids_different_ones(tmp_path):
    rows = read_trace(_write(tmp_path, ROWS))
    assert rows[1] == TraceRow(1500.0, 1100, 60, (7, 8, 10))
    a, b, c = trace_requests(rows, POOL, seed=[3, 0])
    assert [len(r.prompt_token_ids) for r in (a, b, c)] == [1200, 1100, 512]
    assert a.prompt_token_ids[:1024] == b.prompt_token_ids[:1024]  # blocks 7 and 8 shared
    assert a.prompt_token_ids[1024:1100] != b.prompt_token_ids[1024:1100]  # 9 against 10
    assert a.prompt_token_ids[:512] != a.prompt_token_ids[512:1024]  # 7 against 8
    assert c.prompt_token_ids == a.prompt_token_ids[512:1024]  # an id is the same block wherever it is
    assert a.prompt_token_ids[1024:] == block_token_ids(9, 512, POOL, [3, 0])[:176].tolist()  # the last, partial
    assert set(a.prompt_token_ids) <= set(POOL.tolist()) and len(set(a.prompt_token_ids[:512])) > 300
    assert [(r.output_len, r.kind) for r in (a, b, c)] == [(5, "trace"), (60, "trace"), (7, "trace")]
    assert trace_requests(rows, POOL, seed=[3, 0]) == [a, b, c]  # deterministic
    other = trace_requests(rows, POOL, seed=[3, 1])  # another seed: other tokens, the same sharing
    assert other[0].prompt_token_ids != a.prompt_token_ids
    assert other[0].prompt_token_ids[:1024] == other[1].prompt_token_ids[:1024]
    capped = trace_requests(rows, POOL, seed=[3, 0], max_output_len=6)
    assert [r.output_len for r in capped] == [5, 6, 6]
    assert [r.prompt_token_ids for r in capped] == [r.prompt_token_ids for r in (a, b, c)]


def test_a_smaller_block_size_scales_prompts_and_keeps_the_sharing(tmp_path):
    rows = read_trace(_write(tmp_path, [*ROWS, {"timestamp": 3000, "input_length": 513, "output_length": 1,
                                                "hash_ids": [11, 12]}, {"timestamp": 3000, "input_length": 1,
                                                                        "output_length": 1, "hash_ids": [13]}]))
    a, b, c, d, e = trace_requests(rows, POOL, seed=0, block_size=16)
    # ceil(length * 16 / 512): 37.5 -> 38, 34.4 -> 35, 16, 16.03 -> 17 (the partial block keeps a token), >= 1
    assert [len(r.prompt_token_ids) for r in (a, b, c, d, e)] == [38, 35, 16, 17, 1]
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32] and a.prompt_token_ids[32:35] != b.prompt_token_ids[32:]
    assert c.prompt_token_ids == a.prompt_token_ids[16:32]
    assert d.prompt_token_ids[16:] == block_token_ids(12, 16, POOL, 0)[:1].tolist()
    assert scaled_input_len(1200, 512) == 1200 and scaled_input_len(1200, 1) == 3  # 2.34 -> 3: one per block
    with pytest.raises(ValueError):
        trace_requests(rows, POOL, seed=0, block_size=0)


def test_offsets_from_timestamps_and_rescaled_to_a_mean_rate():
    rows = [_row(t) for t in (1000.0, 1500.0, 3000.0, 4000.0)]  # a slice of a trace: not from 0
    assert trace_offsets(rows) == [0.0, 0.5, 2.0, 3.0]
    assert trace_rate(rows) == pytest.approx(1.0)  # 3 gaps in 3 s
    faster = trace_offsets(rows, 2.0)
    assert faster == pytest.approx([0.0, 0.25, 1.0, 1.5])  # every gap halved: the same shape
    assert np.mean(np.diff(faster)) == pytest.approx(1 / 2.0)
    assert trace_offsets(rows, 0.5) == pytest.approx([0.0, 1.0, 4.0, 6.0])
    assert trace_offsets(rows, trace_rate(rows)) == pytest.approx(trace_offsets(rows))  # its own pace
    assert trace_offsets(rows, math.inf) == [0.0] * 4
    burst = [_row(2000.0)] * 3
    assert trace_rate(burst) == math.inf and trace_offsets(burst, 5.0) == [0.0] * 3
    with pytest.raises(ValueError):
        trace_offsets(rows, 0.0)


@pytest.mark.parametrize("bad, message", [
    ('{"timestamp": 0, "input_length": 10', "not JSON"),
    ('[1, 2]', "expected a JSON object"),
    ({"timestamp": 0, "input_length": 10, "hash_ids": [1]}, "missing 'output_length'"),
    ({"timestamp": -5, "input_length": 10, "output_length": 2, "hash_ids": [1]}, "'timestamp' must be"),
    ({"timestamp": 0, "input_length": -10, "output_length": 2, "hash_ids": [1]}, "'input_length' must be"),
    ({"timestamp": 0, "input_length": 10, "output_length": -2, "hash_ids": [1]}, "'output_length' must be"),
    ({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [-1]}, "'hash_ids' must be"),
    ({"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2]}, "take 3 hash ids, got 2"),
    ({"timestamp": 0, "input_length": 100, "output_length": 2, "hash_ids": [1, 2]}, "take 1 hash ids, got 2"),
])
def test_a_malformed_line_is_refused_with_its_number(tmp_path, bad, message):
    path = _write(tmp_path, [ROWS[0], "", bad, ROWS[1]])  # line 2 is blank: skipped, still counted
    with pytest.raises(ValueError, match=rf"trace\.jsonl:3: .*{message}"):
        read_trace(path)


def test_num_prompts_takes_the_first_rows(tmp_path):
    path = _write(tmp_path, [*ROWS, "not json"])
    rows = read_trace(path, 2)
    assert [r.timestamp_ms for r in rows] == [0.0, 1500.0]  # and the bad last line was never read
    with pytest.raises(ValueError, match="3 requests in the trace, 5 asked for"):
        read_trace(_write(tmp_path, ROWS, "short.jsonl"), 5)
    with pytest.raises(ValueError, match="0 requests"):
        read_trace(_write(tmp_path, ["", ""], "empty.jsonl"))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    return parser.parse_args(list(argv))


def test_the_command_line_wants_a_trace_file_and_reads_it_first(tmp_path):
    with pytest.raises(ValueError, match="--dataset-path"):
        bench_serve.settings_from_args(_args("--dataset-name", "mooncake"))
    bad = str(_write(tmp_path, [ROWS[0], {"timestamp": 0}], "bad.jsonl"))
    args = _args("--dataset-name", "mooncake", "--dataset-path", bad, "--num-prompts", "2")
    with pytest.raises(ValueError, match="bad.jsonl:2: missing"):  # before any cluster or server is involved
        bench_serve.Bench(args, bench_serve.settings_from_args(args))
    good = str(_write(tmp_path, ROWS))
    args = _args("--dataset-name", "mooncake", "--dataset-path", good, "--num-prompts", "3", "--trace-block-size", "0")
    with pytest.raises(ValueError, match="block size"):
        bench_serve.Bench(args, bench_serve.settings_from_args(args))


class RecordingGeneration(pb_grpc.GenerationServicer):
    """A stand-in for the router's Generate: answers max_tokens tokens at once and records
    each request's prompt and when it came."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[list[int], int, float]] = {}
        self.start = time.perf_counter()

    async def Generate(self, request, context):  # noqa: N802 (the rpc's name)
        n = request.sampling.max_tokens
        self.calls[request.request_id] = (list(request.token_ids.ids), n, time.perf_counter() - self.start)
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=list(range(n)),
                                  finish_reason=pb.FINISH_REASON_LENGTH,
                                  usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=n))


def test_the_bench_replays_the_trace_through_the_load_path(tmp_path, capsys):
    from tandem.bench.serving.plots import print_report
    from tandem.bench.serving.results import bench_results

    args = _args("--server", "unused", "--dataset-name", "mooncake", "--dataset-path", str(_write(tmp_path, ROWS)),
                 "--num-prompts", "3", "--trace-block-size", "32", "--trace-max-output-len", "8",
                 "--request-rate", "4", "8")
    bench = bench_serve.Bench(args, bench_serve.settings_from_args(args))
    bench.build_workload(POOL)
    servicer = RecordingGeneration()

    async def two_rates() -> list[dict]:
        async with grpc_server(servicer) as target:
            return [await bench.measure(target, "server", rate) for rate in (4.0, 8.0)]

    runs = asyncio.run(two_rates())
    assert [r["metrics"]["completed"] for r in runs] == [3, 3]
    for run, rate in zip(runs, (4, 8)):
        (a, out_a, _), (b, out_b, _), (c, out_c, _) = (servicer.calls[f"server-r{rate}-{i}"] for i in range(3))
        assert [len(a), len(b), len(c)] == [75, 69, 32] and [out_a, out_b, out_c] == [5, 8, 7]  # 1200*32/512, ...
        assert a[:64] == b[:64] and a[64:69] != b[64:69] and c == a[32:64]  # the trace's sharing, at block 32
        # Sent at the trace's offsets (0, 1.5, 2.5 s: 0.8 requests/s) scaled to `rate` a second.
        sent = [r["send_s"] for r in run["requests"]]
        expected = [t * 0.8 / rate for t in (0.0, 1.5, 2.5)]
        assert all(e - 0.01 <= s < e + 0.5 for s, e in zip(sent, expected)), (sent, expected)
    # Each rate its own tokens (a --server's prefix cache holds the earlier rate's), the same sharing.
    assert servicer.calls["server-r4-0"][0] != servicer.calls["server-r8-0"][0]
    assert runs[0]["metrics"]["by_kind"]["trace"]["completed"] == 3
    # results.json and the report name the trace, not the random mix.
    bench.runs = [{"mode": "server", "budget": None, "rate": rate, "phase": "sweep", "label": "server", **run}
                  for run, rate in zip(runs, (4.0, 8.0))]
    results = json.loads(json.dumps(bench_results(bench, {"server": "x", "modes": {"server": {"note": "-"}}})))
    assert results["workload"]["dataset"] == "mooncake"
    assert {k: v for k, v in results["workload"]["mooncake"].items() if k not in ("path", "arrivals")} == {
        "requests": 3, "trace_rate": pytest.approx(0.8), "block_size": 32, "prompt_len": [32, 75],
        "max_output_len": 8}
    capsys.readouterr()
    print_report(results)
    assert "workload: mooncake trace" in capsys.readouterr().out


def test_each_rate_sends_the_trace_gaps_scaled_to_it(tmp_path, monkeypatch):
    from tandem.bench.serving import load

    sent: list[list[float]] = []

    async def run_load(target, requests, offsets, **kwargs):
        sent.append(list(offsets))
        return [], 1.0

    monkeypatch.setattr(load, "run_load", run_load)
    monkeypatch.setattr(load, "summarize", lambda results, duration, slo: {
        "completed": 0, "tpot_ms": {"p99": None}, "goodput": 0.0})
    args = _args("--dataset-name", "mooncake", "--dataset-path", str(_write(tmp_path, ROWS)), "--num-prompts", "3",
                 "--burstiness", "0.2")  # a trace's gaps are its own: no gamma draws
    bench = bench_serve.Bench(args, bench_serve.settings_from_args(args))
    bench.build_workload(POOL)
    for rate in (0.8, 4.0, math.inf):
        asyncio.run(bench.measure("127.0.0.1:1", "server", rate))
    assert sent[0] == pytest.approx([0.0, 1.5, 2.5])  # 0.8 requests/s: the trace's own pace
    assert sent[1] == pytest.approx([0.0, 0.3, 0.5]) and sent[2] == [0.0, 0.0, 0.0]
