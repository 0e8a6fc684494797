"""``--dataset-name mooncake``: replay of a trace in Mooncake's open format.

A Mooncake trace (github.com/kvcache-ai/Mooncake, FAST25-release/traces) is JSON lines of
``timestamp`` (ms from the trace's start), ``input_length``, ``output_length`` and
``hash_ids``: one id per 512-token block of the prompt, the last block possibly partial. An
id stands for its block and everything before it, so equal ids at a position mean an equal
prefix. Each id becomes a block of token ids drawn from the token pool, seeded by (seed, id):
equal ids give equal tokens wherever they appear, and the trace's shared prefixes become real
prefix-cache hits. A ``block_size`` below 512 replays the trace at a smaller scale (prompts
``block_size / 512`` as long, the same blocks shared), for a small model. Arrivals keep the
trace's gaps, all scaled by one factor to a run's mean request rate.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.bench.serving.load import Request
from tandem.sim.traces import MOONCAKE_BLOCK_SIZE, parse_trace_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace, as the file has it."""

    timestamp_ms: float
    """Arrival, ms from the trace's start."""
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    """One id per MOONCAKE_BLOCK_SIZE prompt tokens: ceil(input_len / 512) of them."""


def read_trace(path: str | os.PathLike, num_rows: int | None = None) -> list[TraceRow]:
    """The first ``num_rows`` requests of a Mooncake trace (None: all of them), in file order.

    Blank lines are skipped. A malformed line (not a JSON object, a field missing, a length
    below 1, a negative timestamp or hash id, hash ids that do not cover the prompt: exactly
    ceil(input_length / 512) of them, as in every line of Mooncake's published traces) is a
    ValueError naming the file and line; so is a trace with fewer than ``num_rows`` requests."""
    if num_rows is not None and num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    rows: list[TraceRow] = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if len(rows) == num_rows:
                break
            if not text.strip():
                continue
            # The simulator's parser (tandem simulate --trace): one definition of a valid line.
            timestamp_ms, input_len, output_len, hash_ids = parse_trace_line(text, path, lineno, MOONCAKE_BLOCK_SIZE)
            rows.append(TraceRow(timestamp_ms, input_len, output_len, tuple(hash_ids)))
    if not rows or (num_rows is not None and len(rows) < num_rows):
        raise ValueError(f"{path}: {len(rows)} requests in the trace, {num_rows or 'at least 1'} asked for")
    return rows


def scaled_input_len(input_len: int, block_size: int) -> int:
    """A prompt of ``input_len`` trace tokens with ``block_size`` tokens per trace block:
    ``input_len * block_size / 512`` rounded up, at least 1 (so its last block keeps a token)."""
    return max(1, -(-input_len * block_size // MOONCAKE_BLOCK_SIZE))


def block_token_ids(hash_id: int, block_size: int, token_ids: np.ndarray, seed: int | list[int]) -> np.ndarray:
    """The ``block_size`` tokens trace block ``hash_id`` stands for: uniform draws from
    ``token_ids``, seeded by (seed, hash_id) alone, so the same id gives the same block in
    every request and different ids (all but surely) different blocks."""
    seeds = [seed] if isinstance(seed, int) else list(seed)
    # block: [block_size]
    return np.random.default_rng([*seeds, hash_id]).choice(token_ids, size=block_size)


def trace_requests(rows: Sequence[TraceRow], token_ids: np.ndarray, seed: int | list[int], *,
                   block_size: int = MOONCAKE_BLOCK_SIZE, max_output_len: int | None = None) -> list[Request]:
    """``rows`` as requests (kind "trace"), in their order: each prompt its hash ids' blocks
    (block_token_ids) concatenated and cut to scaled_input_len; the output length the
    trace's, capped at ``max_output_len`` when given."""
    if block_size < 1 or (max_output_len is not None and max_output_len < 1):
        raise ValueError(f"block_size and max_output_len must be >= 1, got {block_size} and {max_output_len}")
    blocks: dict[int, np.ndarray] = {}  # a trace repeats its ids a lot: each is drawn once
    requests = []
    for row in rows:
        for h in row.hash_ids:
            if h not in blocks:
                blocks[h] = block_token_ids(h, block_size, token_ids, seed)
        num_tokens = scaled_input_len(row.input_len, block_size)
        # prompt_token_ids: [num_tokens], the last block cut short
        prompt_token_ids = np.concatenate([blocks[h] for h in row.hash_ids])[:num_tokens]
        output_len = row.output_len if max_output_len is None else min(row.output_len, max_output_len)
        requests.append(Request(prompt_token_ids.tolist(), output_len, "trace"))
    return requests


def trace_rate(rows: Sequence[TraceRow]) -> float:
    """The trace's own mean arrival rate, requests/s: the inverse of its mean gap from the
    first arrival to the last; inf when all arrive at once."""
    span_s = (max(r.timestamp_ms for r in rows) - min(r.timestamp_ms for r in rows)) / 1e3
    return (len(rows) - 1) / span_s if span_s > 0 else math.inf


def trace_offsets(rows: Sequence[TraceRow], rate: float | None = None) -> list[float]:
    """Send times (s from the earliest row, the first in a time-ordered trace such as
    Mooncake's), in the rows' order: the trace's own, or, with ``rate``, every gap scaled by
    one factor so that the mean rate is ``rate`` requests/s (inf: all at once)."""
    start_ms = min(r.timestamp_ms for r in rows)
    offsets = [(r.timestamp_ms - start_ms) / 1e3 for r in rows]
    if rate is None:
        return offsets
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    own_rate = trace_rate(rows)
    if math.isinf(rate) or math.isinf(own_rate):  # all at once; a trace that is so has no gap to stretch
        return [0.0] * len(rows)
    return [t * own_rate / rate for t in offsets]


@dataclass(frozen=True)
class TraceReplay:
    """A trace's rows and how ``tandem bench serve --dataset-name mooncake`` replays them."""

    rows: tuple[TraceRow, ...]
    block_size: int = MOONCAKE_BLOCK_SIZE
    """Tokens per trace block: 512 replays the trace as it is, fewer a smaller copy of it."""
    max_output_len: int | None = None
    """Cap on each request's output (None: the trace's lengths)."""

    def __post_init__(self) -> None:
        if not self.rows or self.block_size < 1 or (self.max_output_len is not None and self.max_output_len < 1):
            raise ValueError(f"a trace replay needs rows, and a block size and max output length >= 1, got "
                             f"{len(self.rows)} rows, {self.block_size} and {self.max_output_len}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, num_rows: int) -> TraceReplay:
        """``tandem bench serve``'s: the first ``num_rows`` of --dataset-path, --trace-block-size,
        --trace-max-output-len."""
        replay = cls(tuple(read_trace(args.dataset_path, num_rows)), args.trace_block_size, args.trace_max_output_len)
        summary = replay.summary()
        # Its own rate: the --request-rate that replays it at its own pace (every rate rescales its gaps).
        logger.info("%s: %d requests at %.4g requests/s, prompts of %d-%d tokens at %d tokens per block",
                    args.dataset_path, summary["requests"], summary["trace_rate"], *summary["prompt_len"],
                    replay.block_size)
        return replay

    def summary(self) -> dict:
        """What results.json says of the replay."""
        input_lens = [scaled_input_len(r.input_len, self.block_size) for r in self.rows]
        return {"requests": len(self.rows), "trace_rate": trace_rate(self.rows), "block_size": self.block_size,
                "prompt_len": [min(input_lens), max(input_lens)], "max_output_len": self.max_output_len,
                "arrivals": "the trace's timestamps, every gap scaled by one factor to the run's mean rate"}

    def requests(self, token_ids: np.ndarray, seed: int | list[int]) -> list[Request]:
        """The rows as requests, their blocks drawn from ``token_ids`` with ``seed`` (trace_requests)."""
        return trace_requests(self.rows, token_ids, seed, block_size=self.block_size,
                              max_output_len=self.max_output_len)

    def offsets(self, rate: float | None = None) -> list[float]:
        """Their send times, the gaps scaled to a mean of ``rate`` requests/s (trace_offsets)."""
        return trace_offsets(self.rows, rate)
