"""Workloads of a simulation, as lists of SimRequest: a Mooncake trace, or the bench's mix.

Mooncake's open traces (github.com/kvcache-ai/Mooncake, FAST25-release/traces) are JSON
lines of ``timestamp`` (ms from the first request), ``input_length``, ``output_length`` and
``hash_ids``: one id per 512-token block of the prompt, equal ids for equal blocks (chained:
an id stands for its block and everything before it). Each id is turned into the same
pseudo-random tokens wherever it appears, so that the trace's shared prefixes become real
prefix-cache hits in the simulated block manager (whose blocks are far smaller: 16 tokens
by default, 32 to a trace block).
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tandem.sim.spec import SimRequest

if TYPE_CHECKING:
    from tandem.bench.serving.load import Mix

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in Mooncake's traces."""
_TRACE_SEED = 0x7A4D
"""First entry of every hash block's seed: trace tokens have a stream of their own."""
EXAMPLE_TRACE = "example_trace.jsonl"


def hash_block_tokens(hash_id: int, block_size: int, vocab_size: int) -> tuple[int, ...]:
    """The ``block_size`` token ids that trace block ``hash_id`` stands for: uniform in
    [0, vocab_size), seeded by the id alone (the same id -> the same tokens, in any trace)."""
    rng = np.random.default_rng([_TRACE_SEED, hash_id])
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=block_size))


def _line_error(path: str | os.PathLike, lineno: int, message: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: {message}")


def _int_field(record: dict, key: str, minimum: int, path: str | os.PathLike, lineno: int) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _line_error(path, lineno, f"{key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_trace_line(text: str, path: str | os.PathLike, lineno: int, block_size: int) -> tuple[float, int, int,
                                                                                                 list[int]]:
    """One trace line -> (timestamp ms, input_length, output_length, hash_ids); ValueError
    naming the file and line for anything else."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise _line_error(path, lineno, f"not JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise _line_error(path, lineno, f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in record]
    if missing:
        raise _line_error(path, lineno, f"missing {', '.join(map(repr, missing))}")
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not 0 <= timestamp < math.inf:
        raise _line_error(path, lineno, f"'timestamp' must be a number of milliseconds >= 0, got {timestamp!r}")
    input_length = _int_field(record, "input_length", 1, path, lineno)
    output_length = _int_field(record, "output_length", 1, path, lineno)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                                             for h in hash_ids):
        raise _line_error(path, lineno, "'hash_ids' must be a list of integers >= 0")
    needed = -(-input_length // block_size)
    if len(hash_ids) != needed:
        raise _line_error(path, lineno, f"{input_length} input tokens in blocks of {block_size} take {needed} "
                                        f"hash ids, got {len(hash_ids)} (is the trace's block size {block_size}?)")
    return float(timestamp), input_length, output_length, hash_ids


def read_mooncake_trace(path: str | os.PathLike, *, vocab_size: int, block_size: int = MOONCAKE_BLOCK_SIZE,
                        time_scale: float = 1.0, limit: int | None = None) -> list[SimRequest]:
    """The requests of a Mooncake-format trace, by arrival time (ties in file order).

    vocab_size: the simulated model's (prompt ids are drawn below it). time_scale: arrival
    times are timestamp / 1000 × time_scale (0.5 replays the trace twice as fast).
    limit: the first ``limit`` requests of the file only. Blank lines are skipped; a malformed
    line is a ValueError naming its line number."""
    if block_size < 1 or vocab_size < 1 or not 0 < time_scale < math.inf:
        raise ValueError("block_size and vocab_size must be >= 1 and time_scale > 0")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    blocks: dict[int, tuple[int, ...]] = {}  # a trace repeats its ids a lot: each is drawn once
    requests: list[SimRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not text.strip():
                continue
            timestamp, input_length, output_length, hash_ids = parse_trace_line(text, path, lineno, block_size)
            tokens: list[int] = []
            for h in hash_ids:
                block = blocks.get(h)
                if block is None:
                    block = blocks[h] = hash_block_tokens(h, block_size, vocab_size)
                tokens.extend(block)
            requests.append(SimRequest(timestamp / 1000.0 * time_scale, tuple(tokens[:input_length]), output_length))
    return sorted(requests, key=lambda r: r.arrival_s)


def example_trace_path() -> Path:
    """The small Mooncake-format trace shipped with tandem (synthetic: 30 requests, shared prefixes)."""
    return Path(str(resources.files("tandem.sim") / "data" / EXAMPLE_TRACE))


def bench_token_pool(model: str | None = None) -> np.ndarray:
    """The ids ``tandem bench serve`` draws its prompts from for ``model`` (None: the default):
    its tokenizer's ids below the model's vocabulary, less the added, special and EOS ones
    (serve.token_pool on the worker's tokenizer, as serving/local.py builds it)."""
    from tandem.bench.serve import token_pool
    from tandem.model.gguf_cache import cached_source
    from tandem.model.source import load_tokenizer, resolve_model_source
    from tandem.plan import read_model_shape

    tokenizer = load_tokenizer(cached_source(resolve_model_source(model)))
    return token_pool(tokenizer.backend_tokenizer, read_model_shape(model).vocab_size, tokenizer.eos_token)


def bench_mix_requests(num: int = 20, rate: float = 1.0, burstiness: float = 1.0, seed: int = 0, mix: Mix | None = None,
                       vocab_size: int | None = None, *, token_ids: np.ndarray | None = None,
                       model: str | None = None, rate_index: int = 0) -> list[SimRequest]:
    """The requests ``tandem bench serve --seed SEED --num-prompts NUM --burstiness B`` sends
    at ``rate`` (its run at the ``rate_index``-th rate of --request-rate: each rate draws
    prompt tokens of its own), at the times it sends them: the bench's own code draws both
    (load.make_requests, with_fresh_tokens, arrival_offsets, with serve.py's seeds).

    mix: a load.Mix (default: the bench's, 20% long prompts). Prompt ids come from
    ``token_ids``, else, with ``vocab_size``, from all of [0, vocab_size) (the same shapes
    and times, other tokens: for a model whose tokenizer is not here), else from
    bench_token_pool(model): then the prompts are exactly the bench's."""
    from tandem.bench.serve import SEED_ARRIVALS, SEED_WORKLOAD
    from tandem.bench.serving.load import Mix, arrival_offsets, make_requests, with_fresh_tokens

    if token_ids is None:
        token_ids = np.arange(vocab_size) if vocab_size is not None else bench_token_pool(model)
    shapes = make_requests(num, token_ids, mix if mix is not None else Mix(), [seed, SEED_WORKLOAD])
    requests = with_fresh_tokens(shapes, token_ids, [seed, SEED_WORKLOAD, rate_index])
    offsets = arrival_offsets(num, rate, burstiness, [seed, SEED_ARRIVALS])
    return [SimRequest(t, tuple(r.prompt_token_ids), r.output_len, r.kind) for r, t in zip(requests, offsets)]
