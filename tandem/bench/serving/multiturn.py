"""``--dataset-name multiturn``: chat sessions whose every turn resends the history.

Each session opens with a system prompt all sessions share, then sends its turns one after
another: turn k's prompt is the system prompt, every earlier user turn and the server's own
answer to it (the tokens it streamed back), then the new user turn; between an answer and the
next turn the user thinks for ``think_time_s``. Sessions start at the run's arrival times
(open loop, --request-rate new sessions a second); their turns are closed loop. A server that
keeps each session's history (its prefix cache, its KV tiers) computes only the new turn; one
that forgot it computes the whole history again, so TTFT grows with the turn.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from tandem.bench.serving.load import Request, RequestResult, Send

if TYPE_CHECKING:
    from tandem.bench.serve import Bench


@dataclass(frozen=True)
class MultiTurn:
    """The sessions' shape; lengths uniform in the closed ranges."""

    num_turns: int = 5
    system_prompt_len: int = 400
    user_len: tuple[int, int] = (40, 120)
    output_len: tuple[int, int] = (16, 64)
    think_time_s: float = 2.0


@dataclass(frozen=True)
class Conversation:
    system_token_ids: list[int]
    """The system prompt, the same in every session."""
    user_token_ids: list[list[int]]
    """Each turn's new user message."""
    output_lens: list[int]
    """Tokens asked for at each turn (greedy, EOS ignored: exactly that many)."""


def make_conversations(num_sessions: int, token_ids: np.ndarray, shape: MultiTurn,
                       seed: int | list[int]) -> list[Conversation]:
    for lo, hi in (shape.user_len, shape.output_len):
        if not 1 <= lo <= hi:
            raise ValueError(f"length ranges must be 1 <= min <= max, got {(lo, hi)}")
    if num_sessions < 1 or shape.num_turns < 1 or shape.system_prompt_len < 0 or shape.think_time_s < 0:
        raise ValueError("sessions and turns must be >= 1, the system prompt and think time >= 0")
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.choice(token_ids, size=n)]

    system = draw(shape.system_prompt_len)
    conversations = []
    for _ in range(num_sessions):
        users = [draw(int(rng.integers(shape.user_len[0], shape.user_len[1] + 1))) for _ in range(shape.num_turns)]
        outs = [int(rng.integers(shape.output_len[0], shape.output_len[1] + 1)) for _ in range(shape.num_turns)]
        conversations.append(Conversation(system, users, outs))
    return conversations


def turn_prompt(conversation: Conversation, answers: list[list[int]]) -> list[int]:
    """Turn ``len(answers)``'s prompt (0-based): the system prompt, each earlier user turn
    followed by its answer, then this turn's user message."""
    k = len(answers)
    prompt = list(conversation.system_token_ids)
    for user, answer in zip(conversation.user_token_ids[:k], answers):
        prompt += user + answer
    return prompt + conversation.user_token_ids[k]


async def run_sessions(send: Send, conversations: list[Conversation], offsets: list[float], think_time_s: float,
                       *, tag: str, desc: str, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Start session i at ``offsets[i]`` s and play its turns -> (every turn's result, session
    by session and in turn order, kind "turn-K"; seconds from the first send to the last end).
    A failed turn ends its session (its history is gone)."""
    num_calls = sum(len(c.user_token_ids) for c in conversations)
    bar = tqdm(total=num_calls, desc=desc, unit="turn", leave=False, disable=not progress)
    start = time.perf_counter()

    async def session(i: int) -> list[RequestResult]:
        conversation = conversations[i]
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        answers: list[list[int]] = []
        results: list[RequestResult] = []
        for k, output_len in enumerate(conversation.output_lens):
            if k:
                await asyncio.sleep(think_time_s)
            sent = time.perf_counter() - start
            result = await send(Request(turn_prompt(conversation, answers), output_len, f"turn-{k + 1}"),
                                len(results), f"{tag}-s{i}-t{k + 1}")
            result.send_s = sent
            results.append(result)
            bar.update(1)
            if not result.success:
                break
            answers.append(result.output_token_ids)
        return results

    per_session = await asyncio.gather(*(session(i) for i in range(len(conversations))))
    duration = time.perf_counter() - start
    bar.close()
    results = [r for rs in per_session for r in rs]
    for index, r in enumerate(results):
        r.index = index
    return results, duration


async def run_multiturn(bench: Bench, target: str, rate: float, *, tag: str, desc: str
                        ) -> tuple[list[RequestResult], float]:
    """One ``tandem bench serve`` run of --dataset-name multiturn at ``rate`` sessions a second:
    sessions of their own at each rate (within one, all share the system prompt), arrival gaps
    as every other dataset's."""
    from tandem.bench.serve import SEED_ARRIVALS, SEED_WORKLOAD
    from tandem.bench.serving.load import arrival_offsets, grpc_client

    args, s = bench.args, bench.settings
    shape = MultiTurn(args.num_turns, args.system_prompt_len, s.short_prompt_len, s.output_len, args.think_time)
    key = bench.rate_keys.setdefault(rate, len(bench.rate_keys))
    assert bench.pool is not None, "build_workload() comes first"
    conversations = make_conversations(s.num_prompts, bench.pool, shape, [args.seed, SEED_WORKLOAD, key])
    offsets = arrival_offsets(len(conversations), rate, args.burstiness, [args.seed, SEED_ARRIVALS])
    async with grpc_client(target, args.request_timeout) as send:
        return await run_sessions(send, conversations, offsets, shape.think_time_s, tag=tag, desc=desc)
