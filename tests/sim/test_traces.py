"""Workloads: Mooncake traces (shared hash ids -> shared prompt blocks, malformed lines
refused) and the bench's mix, request for request what ``tandem bench serve`` sends."""

from __future__ import annotations

import argparse
import asyncio
import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.sim.spec import SimRequest
from tandem.sim.traces import (
    bench_mix_requests,
    bench_token_pool,
    example_trace_path,
    hash_block_tokens,
    read_mooncake_trace,
)

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, lines: list) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_equal_hash_ids_become_equal_token_blocks(tmp_path):
    path = _write(tmp_path, [
        {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 6, "hash_ids": [7, 8, 10]},
        {"timestamp": 2500, "input_length": 512, "output_length": 7, "hash_ids": [8]},
    ])
    a, b, c = read_mooncake_trace(path, vocab_size=1000)
    assert (len(a.prompt_token_ids), len(b.prompt_token_ids), len(c.prompt_token_ids)) == (1200, 1100, 512)
    assert a.prompt_token_ids[:1024] == b.prompt_token_ids[:1024]  # blocks 7 and 8 shared
    assert a.prompt_token_ids[1024:1100] != b.prompt_token_ids[1024:1100]  # 9 vs 10
    assert c.prompt_token_ids == a.prompt_token_ids[512:1024]  # id 8 is the same block anywhere
    assert a.prompt_token_ids[1024:] == hash_block_tokens(9, 512, 1000)[:176]  # the last block truncated
    assert all(0 <= t < 1000 for t in a.prompt_token_ids)
    assert len(set(a.prompt_token_ids[:512])) > 300  # pseudo-random, not a constant fill
    assert [r.output_len for r in (a, b, c)] == [5, 6, 7] and {r.kind for r in (a, b, c)} == {"trace"}
    assert read_mooncake_trace(path, vocab_size=1000) == [a, b, c]  # deterministic


def test_arrivals_scale_sort_and_limit(tmp_path):
    path = _write(tmp_path, [
        {"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [1]},
        "",
        {"timestamp": 500, "input_length": 10, "output_length": 2, "hash_ids": [2]},
        {"timestamp": 9000, "input_length": 10, "output_length": 3, "hash_ids": [3]},
    ])
    assert [r.arrival_s for r in read_mooncake_trace(path, vocab_size=50)] == [0.5, 2.0, 9.0]
    assert [r.arrival_s for r in read_mooncake_trace(path, vocab_size=50, time_scale=0.5)] == [0.25, 1.0, 4.5]
    assert [r.output_len for r in read_mooncake_trace(path, vocab_size=50, limit=2)] == [2, 1]
    small = read_mooncake_trace(path, vocab_size=50, block_size=16)
    assert small[0].prompt_token_ids == hash_block_tokens(2, 16, 50)[:10]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1}, "missing 'hash_ids'"),
    ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "'timestamp'"),
    ({"timestamp": "0", "input_length": 10, "output_length": 1, "hash_ids": [1]}, "'timestamp'"),
    ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "'input_length'"),
    ({"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [1]}, "'input_length'"),
    ({"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}, "'output_length'"),
    ({"timestamp": 0, "input_length": 10, "output_length": True, "hash_ids": [1]}, "'output_length'"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}, "'hash_ids'"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "1"}, "'hash_ids'"),
    ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}, "take 2 hash ids, got 1"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}, "take 1 hash ids, got 2"),
])
def test_malformed_lines_are_refused_with_their_line_number(tmp_path, line, message):
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    path = _write(tmp_path, [good, good, line])
    with pytest.raises(ValueError, match=f"trace.jsonl:3: .*{message}"):
        read_mooncake_trace(path, vocab_size=100)


def test_the_example_trace_ships_and_shares_prefixes():
    path = example_trace_path()
    assert path.is_file() and path.parent.parent == ROOT / "tandem" / "sim"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    requests = read_mooncake_trace(path, vocab_size=49152)
    assert len(requests) == len(lines) == 30
    first_blocks = [r.prompt_token_ids[:512] for r in requests]
    assert len(set(first_blocks)) < len(first_blocks)  # hash id 0 opens many prompts
    second = [tuple(line["hash_ids"][:2]) for line in lines if len(line["hash_ids"]) > 1]
    assert len(set(second)) < len(second)  # and conversations repeat their history
    # pyproject installs it: tandem.sim is a package whose data holds data/*.jsonl
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "tandem.sim" in config["packages"]
    patterns = config["package-data"]["tandem.sim"]
    assert any(path.relative_to(ROOT / "tandem" / "sim").match(p) for p in patterns)


def _bench(argv: list[str]):
    from tandem.bench import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    args = parser.parse_args(argv)
    return bench_serve.Bench(args, bench_serve.settings_from_args(args))


class _Sent(Exception):
    """Raised by the stand-in for run_load once it has what the bench would send."""


def _sent(bench, rate: float, monkeypatch) -> tuple[list, list[float]]:
    """The requests and send offsets Bench.measure hands the load generator at ``rate``."""
    from tandem.bench.serving import load

    captured: dict[str, Any] = {}

    async def run_load(target, requests, offsets, **kwargs):
        captured.update(requests=requests, offsets=offsets)
        raise _Sent

    monkeypatch.setattr(load, "run_load", run_load)
    with pytest.raises(_Sent):
        asyncio.run(bench.measure("127.0.0.1:1", "disaggregated", rate))
    return captured["requests"], captured["offsets"]


def test_bench_mix_requests_are_what_the_bench_sends(monkeypatch):
    bench = _bench(["--seed", "5", "--num-prompts", "12", "--request-rate", "0.5", "3", "--burstiness", "0.7"])
    pool = np.arange(3, 4000)
    bench.build_workload(pool)
    for index, rate in enumerate(bench.settings.rates):
        requests, offsets = _sent(bench, rate, monkeypatch)
        sim = bench_mix_requests(12, rate, 0.7, 5, bench.mix, token_ids=pool, rate_index=index)
        assert sim == [SimRequest(t, tuple(r.prompt_token_ids), r.output_len, r.kind)
                       for r, t in zip(requests, offsets)]
    assert sum(r.kind == "long" for r in sim) == round(12 * 0.2)
    assert sim != bench_mix_requests(12, 3.0, 0.7, 6, bench.mix, token_ids=pool, rate_index=1)
    # with only a vocabulary size: the same shapes and times, prompts from all of it
    shaped = bench_mix_requests(12, 3.0, 0.7, 5, bench.mix, vocab_size=4000, rate_index=1)
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in shaped] == \
           [(r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in sim]


@pytest.mark.slow
def test_bench_token_pool_is_the_workers_tokenizer_pool(tokenizer):
    """As serving/local.py builds it: from the tokenizer spec a worker sends the router."""
    from tokenizers import Tokenizer

    from tandem.bench.serve import token_pool
    from tandem.worker.tokenizer_spec import tokenizer_spec_from

    spec = tokenizer_spec_from(tokenizer, "SmolLM2-135M-Instruct", 49152, 8192)
    expected = token_pool(Tokenizer.from_str(spec.tokenizer_json), spec.vocab_size, spec.eos_token)
    pool = bench_token_pool()
    assert np.array_equal(pool, expected)
    assert tokenizer.convert_tokens_to_ids(tokenizer.eos_token) not in set(pool.tolist())
