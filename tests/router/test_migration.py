"""router/migration.py: a streaming request whose worker fails goes on elsewhere from the
tokens its client has, and its client's stream equals the uninterrupted one: no token twice,
none missing, each completion's index and the request's counts right; n > 1 completions each
resume alone with seed + index; beam search and the (max_migrations + 1)-th failure reach the
client; every backend stream is closed on every exit.

The backend here is a worker as the engine behaves (tests/engine/test_resume.py proves the
engine does): completion output is a function of the prompt and its seed, and a resumed
request (num_resumed_tokens) yields what follows the tokens it was given."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import pytest

from tandem.router.backend import Backend, WorkerFailed
from tandem.router.migration import generate_migrating
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta

PROMPT = [5, 6, 7, 8]


def output_of(prompt: list[int], seed: int) -> list[int]:
    """What a worker makes for this prompt and seed: 6 + seed % 5 tokens."""
    return [(sum(prompt) * 13 + seed * 31 + position * 7) % 1000 + 10 for position in range(6 + seed % 5)]


@dataclass
class Call:
    prompt_token_ids: list[int]
    params: SamplingParams
    num_resumed_tokens: int
    closed: bool = False


@dataclass
class WorkerLikeBackend:
    failures: list[int | None] = field(default_factory=list)
    """Per call in order: WorkerFailed after that many deltas (None: no failure)."""
    ready: bool = True
    calls: list[Call] = field(default_factory=list)

    def is_ready(self) -> bool:
        return self.ready

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, num_resumed_tokens: int = 0) -> AsyncIterator[StreamDelta]:
        call = Call(list(prompt_token_ids), params, num_resumed_tokens)
        self.calls.append(call)
        fail_after = self.failures.pop(0) if self.failures else None
        prompt = prompt_token_ids[:len(prompt_token_ids) - num_resumed_tokens]
        base = 0 if params.seed is None else params.seed
        outputs = [output_of(prompt, base + i)[num_resumed_tokens:] for i in range(params.n)]
        steps = [(i, k) for k in range(max(map(len, outputs))) for i in range(params.n) if k < len(outputs[i])]
        unfinished = set(range(params.n))
        try:
            for j, (i, k) in enumerate(steps):
                if j == fail_after:
                    raise WorkerFailed(f"a worker serving {request_id} is gone")
                await asyncio.sleep(0)
                last = k == len(outputs[i]) - 1
                unfinished -= {i} if last else set()
                yield StreamDelta(request_id, [outputs[i][k]], f"<{outputs[i][k]}>", "stop" if last else None,
                                  len(prompt), num_resumed_tokens + j + 1, index=i, num_unfinished=len(unfinished))
        finally:
            call.closed = True


def collect(backend: WorkerLikeBackend, params: SamplingParams, max_migrations: int = 2,
            take: int | None = None) -> tuple[list[StreamDelta], list[float]]:
    added: list[float] = []

    async def body() -> list[StreamDelta]:
        stream = generate_migrating(cast(Backend, backend), "r", PROMPT, params, 0, max_migrations, added.append)
        deltas = []
        async for delta in stream:
            deltas.append(delta)
            if take is not None and len(deltas) == take:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        return deltas

    return asyncio.run(body()), added


def by_index(deltas: list[StreamDelta]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in deltas:
        out.setdefault(d.index, []).extend(d.token_ids)
    return out


def assert_whole(deltas: list[StreamDelta], params: SamplingParams) -> None:
    """The client's stream equals the uninterrupted request's, with the request's counts."""
    assert params.seed is not None
    expected = {i: output_of(PROMPT, params.seed + i) for i in range(params.n)}
    assert by_index(deltas) == expected
    assert [d.request_finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    last = deltas[-1]
    assert (last.num_output_tokens, last.num_prompt_tokens) == (sum(map(len, expected.values())), len(PROMPT))
    assert all(d.request_id == "r" for d in deltas)


def test_a_stream_moves_twice_and_equals_the_uninterrupted_one():
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=50)
    backend = WorkerLikeBackend(failures=[3, 2])
    deltas, added = collect(backend, params)
    assert_whole(deltas, params)
    whole = output_of(PROMPT, 3)
    assert [(c.prompt_token_ids, c.num_resumed_tokens, c.params.seed) for c in backend.calls] == [
        (PROMPT, 0, 3), (PROMPT + whole[:3], 3, 3), (PROMPT + whole[:5], 5, 3)]
    assert len(added) == 2 and all(c.closed for c in backend.calls)


def test_n2_completions_resume_each_alone_with_its_own_seed():
    params = SamplingParams(temperature=0.8, seed=10, n=2, max_tokens=50)  # 6 and 7 tokens
    backend = WorkerLikeBackend(failures=[5])
    deltas, added = collect(backend, params)
    assert_whole(deltas, params)
    resumed = sorted((c.params.seed, c.params.n, c.num_resumed_tokens) for c in backend.calls[1:])
    assert resumed == [(10, 1, 3), (11, 1, 2)]  # 5 deltas went out: 3 of completion 0, 2 of 1
    assert len(added) == 2 and all(c.closed for c in backend.calls)


def test_a_finished_completion_does_not_move():
    params = SamplingParams(temperature=0.8, seed=10, n=2, max_tokens=50)  # 6 and 7 tokens
    backend = WorkerLikeBackend(failures=[12])  # completion 0 finished at the 11th delta
    deltas, _ = collect(backend, params)
    assert_whole(deltas, params)
    assert [(c.params.seed, c.num_resumed_tokens) for c in backend.calls[1:]] == [(11, 6)]


def test_a_failure_before_any_token_runs_the_whole_request_again():
    params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=50)
    backend = WorkerLikeBackend(failures=[0])
    deltas, _ = collect(backend, params)
    assert_whole(deltas, params)
    assert [(c.params.n, c.num_resumed_tokens) for c in backend.calls] == [(2, 0), (2, 0)]


def test_past_max_migrations_the_failure_reaches_the_client():
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=50)
    backend = WorkerLikeBackend(failures=[2, 1, 1])
    with pytest.raises(WorkerFailed, match="moved 2 times already"):
        collect(backend, params)
    assert len(backend.calls) == 3 and all(c.closed for c in backend.calls)
    backend = WorkerLikeBackend(failures=[2])
    with pytest.raises(WorkerFailed, match="max-migrations=0"):
        collect(backend, params, max_migrations=0)


def test_beam_search_does_not_migrate():
    params = SamplingParams(temperature=0, use_beam_search=True, beam_width=2, max_tokens=50)
    backend = WorkerLikeBackend(failures=[2])
    with pytest.raises(WorkerFailed, match="beam search does not migrate"):
        collect(backend, params)
    assert len(backend.calls) == 1


def test_with_no_healthy_worker_left_the_failure_reaches_the_client():
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=50)
    backend = WorkerLikeBackend(failures=[2], ready=False)
    with pytest.raises(WorkerFailed, match="no healthy worker to go on"):
        collect(backend, params)
    assert len(backend.calls) == 1 and backend.calls[0].closed


def test_a_client_leaving_mid_migration_closes_every_stream():
    params = SamplingParams(temperature=0.8, seed=10, n=2, max_tokens=50)
    backend = WorkerLikeBackend(failures=[5])
    deltas, _ = collect(backend, params, take=7)
    assert len(deltas) == 7 and len(backend.calls) == 3
    assert all(c.closed for c in backend.calls)
