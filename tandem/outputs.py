"""What the engine hands back: per-step deltas and whole-request results."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.sequence import FinishReason
from tandem.logprobs import TopLogprobs


@dataclass(frozen=True)
class RequestDelta:
    """What one engine step added to one request (streamed to clients as it comes)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    """Log-probabilities of new_token_ids, when the request asked for them."""
    new_top_logprobs: list[TopLogprobs] | None
    """The most likely tokens at each of new_token_ids' positions (SamplingParams.logprobs >= 1)."""
    finish_reason: FinishReason | None
    """None until the request's last delta."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""
    index: int = 0
    """Which completion the tokens belong to (0 .. n-1)."""
    num_unfinished: int = 0
    """Completions still going after this delta: 0 on the request's last delta."""

    @property
    def finished(self) -> bool:
        """Completion ``index`` has ended."""
        return self.finish_reason is not None

    @property
    def request_finished(self) -> bool:
        """The request's last delta: every completion has ended."""
        return self.finished and self.num_unfinished == 0


@dataclass(frozen=True)
class FirstSample:
    """What a prompt's first sample drew, handed from the worker that ran the prompt to the
    one that decodes it."""

    token_ids: list[int]
    """One token per completion (n of them), or with beam search the top candidates."""
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per completion, when the request asks for top log-probabilities (else empty)."""


@dataclass
class CompletionOutput:
    """One completion of a request, built from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    """Per token, the most likely tokens at its position (SamplingParams.logprobs >= 1)."""
    finish_reason: FinishReason | None = None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.new_top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + delta.new_top_logprobs
        self.finish_reason = delta.finish_reason


@dataclass
class RequestOutput:
    """One request's whole result, built from its deltas: its completions (one unless
    SamplingParams.n > 1), and completion 0's fields at the top for convenience."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput(0)])
    num_cached_tokens: int = 0
    finished: bool = False
    """Every completion has ended."""

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.outputs)

    def add(self, delta: RequestDelta) -> None:
        while len(self.outputs) <= delta.index:
            self.outputs.append(CompletionOutput(len(self.outputs)))
        self.outputs[delta.index].add(delta)
        self.num_cached_tokens = delta.num_cached_tokens
        self.finished = delta.request_finished
