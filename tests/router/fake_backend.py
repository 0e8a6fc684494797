"""An in-process Backend for the servicer's plumbing tests (errors, cancellation, validation).

Honest in what the servicer relies on: it streams deltas made by really tokenizing a
reply with the model's tokenizer (capped at max_tokens, finish "length" or "stop"),
counts the real prompt tokens, raises the backend's errors before the first delta, and
records every stream that was closed before it finished and every abort. With
SamplingParams.n > 1 it interleaves n completions a token each in turn, as an engine's
steps do: completion i is the reply less its last i tokens (see `completion_ids`), so
they finish at different steps.

Log-probabilities are known values: each chosen token's is CHOSEN_LOGPROB; with
SamplingParams.logprobs = N >= 1 each position's top N are `top_logprobs_at` (the chosen token
first, unless `chosen_in_top` is off: then N other tokens, each likelier than it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tandem.logprobs import TopLogprobs
from tandem.router.backend import WorkerFailed
from tandem.router.metrics import RouterMetrics
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.worker_metrics import WorkerMetricsReport
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta, TokenizerSpec, WorkerLoad

REPLY = "The capital of France is Paris. It is known for the Eiffel Tower."
CHOSEN_LOGPROB = -0.5
ALTERNATIVES = tuple(range(100, 130))
"""The tokens the fake ranks beside each chosen one (ids of ordinary tokens, each its own text)."""


def top_logprobs_at(token_id: int, num_top: int, chosen_in_top: bool = True) -> TopLogprobs:
    """The fake's top `num_top` at a position where `token_id` was chosen: the chosen token
    first at CHOSEN_LOGPROB, then ALTERNATIVES at -1.0, -1.5, ... (chosen_in_top off: only
    ALTERNATIVES, at -0.1, -0.2, ..., all likelier than the chosen token)."""
    others = [t for t in ALTERNATIVES if t != token_id]
    if not chosen_in_top:
        return TopLogprobs(others[:num_top], [-0.1 * (i + 1) for i in range(num_top)])
    ids = [token_id, *others[: num_top - 1]]
    return TopLogprobs(ids, [CHOSEN_LOGPROB - 0.5 * i for i in range(num_top)])


def client_id(request_id: str) -> str:
    """The client's own id in the one a router hands its backend (servicer.owned_id: the
    owner's, then the client's): what the fake records, so that tests speak the client's ids."""
    return request_id.split("/", 1)[-1]


@dataclass
class Seen:
    """One generate() call as the backend received it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    num_resumed_tokens: int = 0


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
    reply_of: Callable[[str], str] | None = None
    """The reply to each prompt, from its text (None: `reply` to every prompt)."""
    fail_prompts: dict[str, Exception] = field(default_factory=dict)
    """Prompts (their text) whose requests raise this before their first delta."""
    chosen_in_top: bool = True
    """Whether each chosen token is among its position's top log-probabilities (see top_logprobs_at)."""

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
        self.aborted.append(client_id(request_id))
        event.set()
        return True

    def completion_ids(self, params: SamplingParams, index: int,
                       prompt_token_ids: list[int] | None = None) -> tuple[list[int], str]:
        """-> (completion `index`'s output token ids, its finish reason) for this prompt."""
        reply = self.reply
        if self.reply_of is not None and prompt_token_ids is not None:
            reply = self.reply_of(self.tokenizer.decode(prompt_token_ids))
        reply_ids = self.tokenizer.encode(reply)
        own = reply_ids[: max(1, len(reply_ids) - index)]
        # As an engine would: reaching max_tokens first is "length", the reply's own end "stop".
        return own[: params.max_tokens], "length" if params.max_tokens <= len(own) else "stop"

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, num_resumed_tokens: int = 0) -> AsyncIterator[StreamDelta]:
        if self.closed_event is None:
            self.closed_event = asyncio.Event()
        self.seen.append(Seen(client_id(request_id), list(prompt_token_ids), params, priority, num_resumed_tokens))
        if isinstance(self.fail_with, Exception):
            raise self.fail_with
        if self.fail_prompts and self.tokenizer.decode(prompt_token_ids) in self.fail_prompts:
            raise self.fail_prompts[self.tokenizer.decode(prompt_token_ids)]
        if isinstance(self.fail_with, str):
            yield StreamDelta(request_id=request_id, token_ids=[], text="", finish_reason="abort",
                              num_prompt_tokens=len(prompt_token_ids), num_output_tokens=0, error=self.fail_with)
            return
        # A resumed request (n=1 here) goes on after the tokens its client has, as a worker does.
        resumed = num_resumed_tokens
        prompt_token_ids = prompt_token_ids[:len(prompt_token_ids) - resumed]
        outputs = [self.completion_ids(params, i, prompt_token_ids) for i in range(params.n)]
        # One token of each unfinished completion per step: (index, position) in stream order.
        steps = [(i, k) for k in range(resumed, max(len(ids) for ids, _ in outputs))
                 for i, (ids, _) in enumerate(outputs) if k < len(ids)]
        fail_at = self.worker_failures.pop(0) if self.worker_failures else None
        abort_event = self.running.setdefault(request_id, asyncio.Event())
        done = False
        try:
            texts_so_far = [self.tokenizer.decode(ids[:resumed]) for ids, _ in outputs]
            unfinished = set(range(params.n))
            for j, (i, k) in enumerate(steps):
                if j == fail_at:
                    raise WorkerFailed(f"the worker serving {request_id} died")
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                if abort_event.is_set():
                    done = True
                    for index in sorted(unfinished):  # each unfinished completion ends "abort"
                        unfinished.discard(index)
                        yield StreamDelta(request_id=request_id, token_ids=[], text="", finish_reason="abort",
                                          num_prompt_tokens=len(prompt_token_ids), num_output_tokens=j,
                                          index=index, num_unfinished=len(unfinished))
                    return
                output, reason = outputs[i]
                text = self.tokenizer.decode(output[: k + 1])
                last = k == len(output) - 1
                if last:
                    unfinished.discard(i)
                delta = StreamDelta(
                    request_id=request_id, token_ids=[output[k]], text=text[len(texts_so_far[i]):],
                    finish_reason=reason if last else None, num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=resumed + j + 1,
                    logprobs=[CHOSEN_LOGPROB] if params.logprobs is not None else None,
                    top_logprobs=([top_logprobs_at(output[k], params.top_logprobs, self.chosen_in_top)]
                                  if params.top_logprobs else None),
                    index=i, num_unfinished=len(unfinished),
                )
                texts_so_far[i] = text
                done = not unfinished
                yield delta
        finally:
            self.running.pop(request_id, None)
            if done:
                self.finished.append(client_id(request_id))
            else:
                self.closed_early.append(client_id(request_id))
                self.closed_event.set()

