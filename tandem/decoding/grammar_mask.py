"""Grammar masks on a step's logits: the constrained rows' packed bitmasks are filled on the
host by their matchers, cross to the logits' device in one transfer, and are unpacked there by
torch ops; disallowed tokens get -inf."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.decoding.grammar import GrammarMatcher, bitmask_words
from tandem.engine import step_inputs


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
    """``logits`` ``[rows, vocab_size]`` (any device, float) with -inf wherever row ``i``'s
    matcher forbids a token; rows whose matcher is None keep their values. Returns a new
    tensor (``logits`` itself, unchanged, when no row is constrained)."""
    rows, vocab_size = logits.shape
    if len(matchers) != rows:
        raise ValueError(f"{len(matchers)} matchers for {rows} rows of logits")
    constrained = [i for i, m in enumerate(matchers) if m is not None]
    if not constrained:
        return logits
    n, words = len(constrained), bitmask_words(vocab_size)
    # One host buffer: the constrained rows' bitmasks [n, words], then their n row indices.
    host = torch.empty(n * words + n, dtype=torch.int32)
    bitmask = host[:n * words].view(n, words)
    for j, i in enumerate(constrained):
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_next_token_bitmask(bitmask, j)
    host[n * words:] = torch.tensor(constrained, dtype=torch.int32)
    packed = step_inputs.to_device(host, logits.device)
    forbidden = unpack_bitmask(packed[:n * words].view(n, words), vocab_size, allowed=False)
    if n == rows:  # every row constrained: no gather and scatter
        return logits.masked_fill(forbidden, float("-inf"))
    index = packed[n * words:].long()
    out = logits.clone()
    out[index] = out[index].masked_fill(forbidden, float("-inf"))
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, allowed: bool = True) -> torch.Tensor:
    """int32 ``[rows, words]`` -> bool ``[rows, vocab_size]``, True where a token is allowed
    (``allowed=False``: where it is not): token ``t`` is bit ``t % 32`` of word ``t // 32``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: no transfer
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    unpacked = bits != 0 if allowed else bits == 0
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_grammar_masks_reference(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
    """The plain version (for tests): one row at a time, each token's bit looked up by index."""
    out = logits.clone()
    vocab_size = logits.shape[1]
    tokens = torch.arange(vocab_size)
    for i, matcher in enumerate(matchers):
        if matcher is None:
            continue
        row = torch.zeros((1, bitmask_words(vocab_size)), dtype=torch.int32)
        matcher.fill_next_token_bitmask(row)
        allowed = (row[0, tokens // 32] >> (tokens % 32)) & 1 == 1
        out[i, ~allowed.to(logits.device)] = float("-inf")
    return out
