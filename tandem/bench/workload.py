"""Seeded synthetic workloads: random-token prompts of mixed lengths, mixed output lengths."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the prompt's token ids and how many tokens it asks for."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def allowed_token_ids(vocab_size: int, excluded: Iterable[int]) -> np.ndarray:
    """Every id in [0, vocab_size) except ``excluded`` (special, added and EOS ids)."""
    mask = np.ones(vocab_size, dtype=bool)
    for t in excluded:
        if 0 <= t < vocab_size:
            mask[t] = False
    if not mask.any():
        raise ValueError("no token id is left to build prompts from")
    return np.flatnonzero(mask)


def excluded_token_ids(tokenizer, eos_token_ids: Iterable[int]) -> set[int]:
    """Ids a random prompt must not contain: the tokenizer's special and added tokens, and EOS.

    Added tokens (chat markers and the like) are left out too: the prompts stand for
    ordinary text, and some tokenizers add them outside ``all_special_ids``.
    """
    ids = set(eos_token_ids) | set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return {int(t) for t in ids}


def make_workload(
    num_requests: int,
    token_ids: np.ndarray,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[BenchRequest]:
    """``num_requests`` requests with lengths uniform in the closed ranges given.

    Prompts are uniform random draws from ``token_ids``: no real text, but no request
    shares a prefix with another either, so the prefix cache gives neither engine a head
    start. The same seed gives the same workload, and a longer workload begins with the
    shorter one (lengths and prompts are drawn request by request).
    """
    (p_lo, p_hi), (o_lo, o_hi) = prompt_len, output_len
    if not (1 <= p_lo <= p_hi and 1 <= o_lo <= o_hi):
        raise ValueError(f"length ranges must be 1 <= min <= max, got prompt {prompt_len}, output {output_len}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        n = int(rng.integers(p_lo, p_hi + 1))
        out = int(rng.integers(o_lo, o_hi + 1))
        prompt = rng.choice(token_ids, size=n).tolist()
        requests.append(BenchRequest([int(t) for t in prompt], out))
    return requests
