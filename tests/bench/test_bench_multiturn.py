"""``--dataset-name multiturn``: seeded sessions sharing one system prompt, and the session
driver: each turn's prompt is the history with the server's own answers in it, turns wait
for the answer and the think time, a failed turn ends its session."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tandem.bench.serving.load import Request, RequestResult, conclude
from tandem.bench.serving.multiturn import MultiTurn, make_conversations, run_sessions, turn_prompt

POOL = np.arange(1000, 2000)
SHAPE = MultiTurn(num_turns=3, system_prompt_len=20, user_len=(3, 6), output_len=(2, 4), think_time_s=0.05)


def test_sessions_are_seeded_and_share_the_system_prompt():
    conversations = make_conversations(4, POOL, SHAPE, seed=1)
    assert len({tuple(c.system_token_ids) for c in conversations}) == 1 and len(conversations[0].system_token_ids) == 20
    for c in conversations:
        assert len(c.user_token_ids) == len(c.output_lens) == 3
        assert all(3 <= len(u) <= 6 for u in c.user_token_ids) and all(2 <= n <= 4 for n in c.output_lens)
    assert make_conversations(4, POOL, SHAPE, seed=1) == conversations != make_conversations(4, POOL, SHAPE, seed=2)
    with pytest.raises(ValueError):
        make_conversations(1, POOL, MultiTurn(num_turns=0), seed=0)


class EchoServer:
    """A stand-in for the router's Generate: answers each prompt with output_len tokens made
    from it (so every answer is different), records what it was sent and when, and fails
    the calls whose request id is in ``fail``."""

    def __init__(self, fail: frozenset[str] = frozenset()) -> None:
        self.calls: dict[str, tuple[list[int], float, float]] = {}
        self.fail = fail

    async def send(self, request: Request, index: int, request_id: str) -> RequestResult:
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        result = RequestResult(index, request.kind, len(request.prompt_token_ids), request.output_len)
        if request_id in self.fail:
            result.error = "UNAVAILABLE: gone"
        else:
            result.output_token_ids = [t + 5000 for t in request.prompt_token_ids[-request.output_len:]]
            result.output_tokens, result.finish_reason, result.ttft_ms = request.output_len, "length", 5.0
        self.calls[request_id] = (list(request.prompt_token_ids), start, time.perf_counter())
        return conclude(result, start)


def test_each_turn_resends_the_history_with_the_answers():
    conversations = make_conversations(2, POOL, SHAPE, seed=3)
    server = EchoServer()
    results, duration = asyncio.run(run_sessions(server.send, conversations, [0.0, 0.02], SHAPE.think_time_s,
                                                 tag="t", desc="", progress=False))
    assert [r.kind for r in results] == ["turn-1", "turn-2", "turn-3"] * 2 and [r.index for r in results] == list(
        range(6))
    assert all(r.success for r in results)
    for i, c in enumerate(conversations):
        history = list(c.system_token_ids)
        for k in range(3):
            prompt, start, _ = server.calls[f"t-s{i}-t{k + 1}"]
            history += c.user_token_ids[k]
            assert prompt == history  # the system prompt, every turn and every answer so far
            assert prompt == turn_prompt(c, [results[3 * i + j].output_token_ids for j in range(k)])
            history += [t + 5000 for t in history[-c.output_lens[k]:]]
            if k:  # sent once the answer was in and the user had thought
                assert start - server.calls[f"t-s{i}-t{k}"][2] >= SHAPE.think_time_s * 0.9
    assert duration >= 2 * SHAPE.think_time_s


def test_a_failed_turn_ends_its_session_only():
    conversations = make_conversations(2, POOL, SHAPE, seed=4)
    server = EchoServer(fail=frozenset({"t-s0-t2"}))
    results, _ = asyncio.run(run_sessions(server.send, conversations, [0.0, 0.0], 0.0, tag="t", desc="",
                                          progress=False))
    assert [(r.kind, r.success) for r in results] == [("turn-1", True), ("turn-2", False), ("turn-1", True),
                                                      ("turn-2", True), ("turn-3", True)]
    assert "t-s0-t3" not in server.calls
