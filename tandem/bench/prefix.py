"""Prefix-aware routing on a multi-turn chat: prefix_aware vs least_loaded.

Starts one cluster (1 prefill + 2 decode workers) and, over the same workers, one router
per policy. Several conversations run at once; each turn's prompt is the previous turn's
prompt, its answer and a new user message, so a turn's prefix is the KV the previous
turn left on the workers. Each policy gets conversations of the same shapes with fresh
tokens (no reuse across policies). Prints TTFT p50/p99 and the KV bytes the prefill
worker sent (tandem_kv_transfer_bytes_total), and the ratios prefix_aware / least_loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

POLICIES = ("least_loaded", "prefix_aware")


@dataclass(frozen=True)
class Settings:
    """What one run does; ``--quick`` only changes the defaults."""

    num_conversations: int
    num_turns: int
    first_len: int
    """Tokens of each conversation's first message (a system prompt and a question)."""
    user_len: int
    """Tokens of each later user message."""
    answer_len: int
    kv_cache_memory_gib: float


FULL = Settings(num_conversations=6, num_turns=4, first_len=200, user_len=40, answer_len=16, kv_cache_memory_gib=0.5)
QUICK = Settings(num_conversations=2, num_turns=2, first_len=40, user_len=16, answer_len=4, kv_cache_memory_gib=0.1)


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default=None, help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    a("--quick", action="store_true", help="tiny run: 2 conversations of 2 short turns")
    a("--seed", type=int, default=0)


async def turn(stub, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """One greedy turn -> (its answer's token ids, TTFT in ms)."""
    from tandem.bench.serving.load import greedy_request

    start, ttft_ms, answer = time.perf_counter(), None, []
    async for response in stub.Generate(greedy_request(request_id, prompt, max_tokens), timeout=600):
        if response.token_ids and ttft_ms is None:
            ttft_ms = (time.perf_counter() - start) * 1e3
        answer += response.token_ids
    assert ttft_ms is not None, f"{request_id}: the stream ended without a token"
    return answer, ttft_ms


async def chats(target: str, s: Settings, pool: np.ndarray, rng: np.random.Generator, tag: str) -> list[float]:
    """Every conversation at once, its turns one after the other -> every turn's TTFT (ms)."""
    import grpc

    from tandem.proto import generation_pb2_grpc as pb_grpc

    async def conversation(c: int, stub) -> list[float]:
        prompt, ttfts = rng.choice(pool, s.first_len).tolist(), []
        for t in range(s.num_turns):
            answer, ttft_ms = await turn(stub, f"{tag}-{c}-{t}", prompt, s.answer_len)
            ttfts.append(ttft_ms)
            prompt = prompt + answer + rng.choice(pool, s.user_len).tolist()
        return ttfts

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        per_chat = await asyncio.gather(*(conversation(c, stub) for c in range(s.num_conversations)))
    return [t for ttfts in per_chat for t in ttfts]


async def kv_bytes_sent(backend) -> float:
    """The prefill workers' tandem_kv_transfer_bytes_total{direction="sent"}, summed."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for report in await backend.worker_metrics() if report.text
               for family in text_string_to_metric_families(report.text) for sample in family.samples
               if sample.name == "tandem_kv_transfer_bytes_total" and sample.labels.get("direction") == "sent")


def over_same_workers(backend, policy: str):
    """A fresh router (its own loads, health and prefix index) over `backend`'s worker actors."""
    from tandem.router.policy import WorkerState
    from tandem.router.ray_backend import RayBackend

    prefill, decode = ([WorkerState(w.instance, w.handle) for w in ws] for ws in (backend.prefill, backend.decode))
    return RayBackend(prefill, decode, [], policy, backend.tokenizer_spec, disagg_policy="always")


async def measure(s: Settings, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from tokenizers import Tokenizer

    from tandem.bench.serve import token_pool
    from tandem.config import WorkerConfig
    from tandem.router.cluster import ClusterConfig, start_cluster, stop_cluster
    from tandem.router.server import bound_port, drain, serve

    worker = WorkerConfig.build(model=args.model, num_threads=1, kv_cache_memory_gib=s.kv_cache_memory_gib)
    first = await start_cluster(ClusterConfig(num_prefill=1, num_decode=2, policy=POLICIES[0], disagg_policy="always",
                                              worker=worker, name_prefix="bench-p-"))
    spec = first.tokenizer_spec
    pool = token_pool(Tokenizer.from_str(spec.tokenizer_json), spec.vocab_size, spec.eos_token)
    rng = np.random.default_rng(args.seed)
    results = {}
    try:
        for policy in POLICIES:
            backend = first if policy == POLICIES[0] else over_same_workers(first, policy)
            await backend.loads()
            backend.start_polling()
            server = await serve(backend, "127.0.0.1", 0)
            try:
                sent_before = await kv_bytes_sent(backend)
                ttfts = await chats(f"127.0.0.1:{bound_port(server)}", s, pool, rng, policy)
                sent = await kv_bytes_sent(backend) - sent_before
            finally:
                await drain(server, grace=1.0)
                await backend.stop_polling()
            results[policy] = dict(ttft_p50_ms=float(np.percentile(ttfts, 50)),
                                   ttft_p99_ms=float(np.percentile(ttfts, 99)), kv_bytes_sent=sent)
            logger.info("%s: %s", policy, results[policy])
    finally:
        stop_cluster(first)
    return results


def run(args: argparse.Namespace) -> int:
    s = QUICK if args.quick else FULL
    results = asyncio.run(measure(s, args))
    print(f"multi-turn chat: {s.num_conversations} conversations x {s.num_turns} turns, first message "
          f"{s.first_len} tokens, then +{s.user_len} user +{s.answer_len} answer tokens a turn; "
          "1 prefill + 2 decode workers")
    print(f"{'policy':<14}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'KV bytes sent':>16}")
    for policy, r in results.items():
        print(f"{policy:<14}{r['ttft_p50_ms']:>13.1f}{r['ttft_p99_ms']:>13.1f}{r['kv_bytes_sent']:>16.0f}")
    base, prefix = results["least_loaded"], results["prefix_aware"]
    print("prefix_aware / least_loaded: " + ", ".join(
        f"{key} {prefix[key] / base[key]:.2f}" for key in ("ttft_p50_ms", "ttft_p99_ms", "kv_bytes_sent")))
    return 0
