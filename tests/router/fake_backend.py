"""An in-process Backend for the servicer's plumbing tests (errors, cancellation, validation).

Honest in what the servicer relies on: it streams deltas made by really tokenizing a
reply with the model's tokenizer (capped at max_tokens, finish "length" or "stop"),
counts the real prompt tokens, raises the backend's errors before the first delta, and
records every stream that was closed before it finished and every abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.router.backend import WorkerFailed
from tandem.router.metrics import RouterMetrics
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.worker_metrics import WorkerMetricsReport
from tandem.sampling_params import SamplingParams
from tandem.worker_api import StreamDelta, TokenizerSpec, WorkerLoad

REPLY = "The capital of France is Paris. It is known for the Eiffel Tower."


@dataclass
class Seen:
    """One generate() call as the backend received it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class FakeBackend:
    tokenizer: RouterTokenizer
    step_delay_s: float = 0.0
    """Pause before each delta (lets tests cancel mid-stream)."""
    ready: bool = True
    fail_with: Exception | str | None = None
    """An exception: raised before the first delta, as a real backend raises Overloaded or
    NoHealthyWorker. A string: the first delta carries it as StreamDelta.error."""
    reply: str = REPLY
    worker_failures: list[int] = field(default_factory=list)
    """Each entry fails one run (in order): WorkerFailed after that many deltas."""
    seen: list[Seen] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)
    """Ids whose stream was closed (or cancelled) before its last delta: what aborts on the workers."""
    finished: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    closed_event: asyncio.Event | None = None
    """Set when a stream closes early (created lazily in the server's event loop)."""
    metrics: RouterMetrics | None = None
    num_admitting: int = 0
    worker_reports: list[WorkerMetricsReport] = field(default_factory=list)
    """What worker_metrics() answers."""

    @property
    def tokenizer_spec(self) -> TokenizerSpec:
        return self.tokenizer.spec

    def is_ready(self) -> bool:
        return self.ready

    async def loads(self) -> list[WorkerLoad]:
        return []

    async def worker_metrics(self) -> list[WorkerMetricsReport]:
        return list(self.worker_reports)

    async def abort(self, request_id: str) -> bool:
        event = self.running.get(request_id)
        if event is None:
            return False
        self.aborted.append(request_id)
        event.set()
        return True

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StreamDelta]:
        if self.closed_event is None:
            self.closed_event = asyncio.Event()
        self.seen.append(Seen(request_id, list(prompt_token_ids), params))
        if isinstance(self.fail_with, Exception):
            raise self.fail_with
        if isinstance(self.fail_with, str):
            yield StreamDelta(request_id=request_id, token_ids=[], text="", finish_reason="abort",
                              num_prompt_tokens=len(prompt_token_ids), num_output_tokens=0, error=self.fail_with)
            return
        reply_ids = self.tokenizer.encode(self.reply)
        output = reply_ids[: params.max_tokens]
        # As an engine would: reaching max_tokens first is "length", the reply's own end "stop".
        reason = "length" if params.max_tokens <= len(reply_ids) else "stop"
        fail_at = self.worker_failures.pop(0) if self.worker_failures else None
        abort_event = self.running.setdefault(request_id, asyncio.Event())
        done = False
        try:
            text_so_far = ""
            for i, token_id in enumerate(output):
                if i == fail_at:
                    raise WorkerFailed(f"the worker serving {request_id} died")
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                if abort_event.is_set():
                    done = True
                    yield StreamDelta(request_id=request_id, token_ids=[], text="", finish_reason="abort",
                                      num_prompt_tokens=len(prompt_token_ids), num_output_tokens=i)
                    return
                text = self.tokenizer.decode(output[: i + 1])
                last = i == len(output) - 1
                delta = StreamDelta(
                    request_id=request_id, token_ids=[token_id], text=text[len(text_so_far):],
                    finish_reason=reason if last else None, num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=i + 1, logprobs=[-0.5] if params.logprobs else None,
                )
                text_so_far = text
                done = last
                yield delta
        finally:
            self.running.pop(request_id, None)
            if done:
                self.finished.append(request_id)
            else:
                self.closed_early.append(request_id)
                self.closed_event.set()

