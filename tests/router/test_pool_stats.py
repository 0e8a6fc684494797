"""The per-pool stats line (router/pool_stats.py): throughput over the interval from the
workers' cumulative counts, running and waiting summed, KV usage and prefix hit rate; idle
pools and the first snapshot print nothing; a restarted worker's counts start again from 0."""

from __future__ import annotations

from tandem.router.pool_stats import PoolStats
from tandem.worker.api import Role, WorkerLoad


def load(role: Role, instance: str, prompt: int = 0, generated: int = 0, running: int = 0, waiting: int = 0,
         free: int = 100, queries: int = 0, hits: int = 0) -> WorkerLoad:
    return WorkerLoad(role, instance, num_blocks=100, num_free_blocks=free, num_running=running, num_waiting=waiting,
                      num_queued_tokens=0, num_prompt_tokens=prompt, num_generated_tokens=generated,
                      num_prefix_queries=queries, num_prefix_hits=hits)


def test_one_line_per_busy_pool_over_the_interval():
    stats = PoolStats()
    assert stats.lines([load(Role.PREFILL, "p0", prompt=500), load(Role.DECODE, "d0")], now=0.0) == []
    lines = stats.lines([load(Role.PREFILL, "p0", prompt=1500, generated=4, running=1, free=75, queries=2000,
                              hits=1000),
                         load(Role.DECODE, "d0", generated=200, running=3, waiting=1, free=50),
                         load(Role.DECODE, "d1", generated=100, free=50)], now=10.0)
    assert lines == [
        "prefill pool (1 worker): prompt throughput 100.0 tokens/s, generation throughput 0.4 tokens/s, running 1, "
        "waiting 0, KV cache usage 25.0%, prefix cache hit rate 50.0%",
        "decode pool (2 workers): generation throughput 30.0 tokens/s, running 3, waiting 1, KV cache usage 50.0%, "
        "prefix cache hit rate 0.0%",
    ]
    # Idle since: nothing; a restarted worker (counts from 0 again) is not a negative rate.
    assert stats.lines([load(Role.PREFILL, "p0", prompt=1500, generated=4, queries=2000, hits=1000),
                        load(Role.DECODE, "d0"), load(Role.DECODE, "d1", generated=100)], now=20.0) == []
    assert stats.lines([load(Role.DECODE, "d0", generated=50)], now=30.0) == [
        "decode pool (1 worker): generation throughput 5.0 tokens/s, running 0, waiting 0, KV cache usage 0.0%, "
        "prefix cache hit rate 0.0%"]
