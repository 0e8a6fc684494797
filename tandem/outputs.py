"""What the engine hands back: per-step deltas and whole-request results."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.sequence import FinishReason


@dataclass(frozen=True)
class RequestDelta:
    """What one engine step added to one request (streamed to clients as it comes)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    """Log-probabilities of new_token_ids, when the request asked for them."""
    finish_reason: FinishReason | None
    """None until the request's last delta."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's whole result, built from its deltas."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        self.finish_reason = delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens
