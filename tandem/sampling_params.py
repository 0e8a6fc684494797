"""Per-request sampling parameters, validated once when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.structured_outputs import StructuredOutputsParams

MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a logit_bias value (either sign)."""
MAX_LOGPROBS = 20
"""The most top log-probabilities per token (OpenAI's bound, vLLM's default max_logprobs)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops (vLLM's field names).

    Every field crosses process boundaries later (router -> workers), so all are plain
    values. Invalid values raise ``ValueError`` naming the field.
    """

    max_tokens: int = 16
    """Most tokens to generate (>= 1)."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    seed: int | None = None
    """Seed of this request's own generator: the same seed and prompt give the same tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the stop string itself is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (besides EOS); the token is kept in token_ids."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    logprobs: int | None = None
    """Log-probabilities under the model's distribution (vLLM's count): None returns none, 0 each
    chosen token's, N in [1, MAX_LOGPROBS] also the N most likely tokens at each position.
    (True is taken as 0 and False as None, what the flag this was meant.)"""
    n: int = 1
    """Completions to return. Sampled completions share the prompt's KV blocks (copy-on-write);
    completion i draws from the generator seeded ``seed + i``, so it equals a request with that
    seed alone. With beam search: the n best beams, n <= beam_width."""
    use_beam_search: bool = False
    """Beam search (transformers' algorithm, early_stopping=False) instead of sampling:
    deterministic, so temperature must be 0 and the other filters off."""
    beam_width: int = 4
    """Beams kept at each step (beam search only)."""
    length_penalty: float = 1.0
    """A finished beam's score is its summed log-probability divided by its length to this power."""
    cache_salt: str | None = None
    """Isolates the request's prefix cache (vLLM's field): its blocks are shared only with
    requests of the same salt, so one tenant cannot tell from timing or hit counts whether
    another sent a prefix. At most MAX_CACHE_SALT_CHARS characters."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds already, in [-2, 2] (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it, in [-2, 2] (OpenAI's)."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or the output have a positive logit divided by it and a negative one
    multiplied by it (> 0; 1 is off: transformers' and vLLM's)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those tokens' logits, each in [-100, 100] (a dict is
    accepted and frozen, sorted by id)."""
    min_tokens: int = 0
    """No EOS or stop token id before this many output tokens (they are masked until then)."""
    skip_special_tokens: bool = True
    """Special tokens (other than an ending EOS, never shown) are left out of the text."""
    include_stop_str_in_output: bool = False
    """The text ends after the stop string (or ending EOS) found, rather than before it."""
    structured_outputs: StructuredOutputsParams | None = None
    """What the output must match (a grammar's token mask applied where each token is sampled)."""

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        if isinstance(self.logprobs, bool):
            object.__setattr__(self, "logprobs", 0 if self.logprobs else None)
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_real(self.temperature) and self.temperature >= 0,
               "temperature", f"must be a number >= 0, got {self.temperature!r}")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1,
               "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1,
               "top_k", f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1,
               "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or isinstance(self.seed, int),
               "seed", f"must be an integer or None, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
               "n", f"must be an integer >= 1, got {self.n!r}")
        _check(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool) and self.beam_width >= 1,
               "beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        _check(_is_real(self.length_penalty), "length_penalty", f"must be a finite number, got {self.length_penalty!r}")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt)
                                           <= MAX_CACHE_SALT_CHARS),
               "cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", f"must be a number > 0, got {self.repetition_penalty!r}")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _is_real(b)
                   and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias)
               and len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
               "logit_bias",
               f"must map distinct token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
               and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be an integer in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")
        if self.use_beam_search:
            _check(self.n <= self.beam_width, "n", f"must be <= beam_width ({self.beam_width}) with beam search, "
                   f"got {self.n}")
            _check(self.temperature == 0 and self.top_p == 1 and self.top_k in (-1, 0) and self.min_p == 0,
                   "temperature", "must be 0, with top_p, top_k and min_p off, for beam search (it is deterministic)")
            _check(not self.stop, "stop", "is not supported with beam search (use stop_token_ids)")
            _check(not self.processes_logits, "repetition_penalty",
                   "and the other penalties, logit_bias and min_tokens are not supported with beam search")
            _check(not self.top_logprobs, "logprobs", "above 0 is not supported with beam search")
            _check(self.structured_outputs is None, "structured_outputs", "is not supported with beam search")

    @property
    def num_completions(self) -> int:
        """Sequences that sample at once: n, or beam_width with beam search."""
        return self.beam_width if self.use_beam_search else self.n

    def completion_seed(self, index: int) -> int | None:
        """The seed of completion ``index``'s generator (None: unseeded)."""
        return None if self.seed is None else self.seed + index

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_logprobs(self) -> int:
        """How many most likely tokens to report at each position (0: none)."""
        return self.logprobs or 0

    @property
    def processes_logits(self) -> bool:
        """Whether penalties, a logit bias or min_tokens change the logits before the choice."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.min_tokens > 0)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")
