"""Preemption's two ways, side by side: swapping N KV blocks out and back in, against
recomputing their N * block_size tokens (a prefill), on the engine's own model runner.

Recompute is timed two ways: alone (a prefill step of its own) and as the extra time it
adds to a step of decodes (how a recomputed sequence actually comes back: beside the
running batch). The smallest N where swapping is cheaper than the added time is the
policy's threshold (tandem/engine/preemption.py). Writes results.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kvcache.swap_copier import KVSwapper
from tandem.model.llama import LlamaModel
from tandem.model.loader import load_model
from tandem.model.source import resolve_model_source
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--num-blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                        help="blocks swapped (or tokens / block size recomputed)")
    parser.add_argument("--num-decodes", type=int, default=8, help="running decodes beside a recompute")
    parser.add_argument("--decode-context", type=int, default=256, help="context length of each decode")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median kept)")
    parser.add_argument("--out-dir", default="bench-results/swap", help="where results.json goes")


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sequence(request_id: str, num_tokens: int, num_computed: int, first_block: int) -> Sequence:
    """A sequence over consecutive blocks; its KV contents do not matter for timing."""
    seq = Sequence(request_id, list(range(100, 100 + num_tokens)), SamplingParams(temperature=0, max_tokens=1), 0)
    seq.num_computed_tokens = num_computed
    seq.block_ids = list(range(first_block, first_block + -(-num_tokens // BLOCK_SIZE)))
    return seq


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))
    loaded = load_model(resolve_model_source(args.model), torch.float32)
    max_blocks = max(args.num_blocks)
    decode_blocks = -(-(args.decode_context + 1) // BLOCK_SIZE)
    config = EngineConfig.build(loaded.config, block_size=BLOCK_SIZE, num_swap_blocks=max_blocks,
                                num_kv_blocks=max_blocks + args.num_decodes * decode_blocks)
    runner = ModelRunner(config, LlamaModel(loaded.config, loaded.weights, config.max_model_len))
    swapper = KVSwapper(runner.kv_cache, config.num_swap_blocks)
    decodes = [_sequence(f"d{i}", args.decode_context + 1, args.decode_context, max_blocks + i * decode_blocks)
               for i in range(args.num_decodes)]
    decode_batch = ScheduledBatch(decodes, [1] * len(decodes))
    decode_s = median_s(lambda: runner.run(decode_batch), args.repeats)

    rows = []
    for n in args.num_blocks:
        pairs = [(b, b) for b in range(n)]

        def swap_out_in() -> None:
            swapper.swap_out(pairs)
            swapper.swap_in(pairs)

        swap_s = median_s(swap_out_in, args.repeats)
        prefill = _sequence("p", n * BLOCK_SIZE, 0, 0)
        alone_s = median_s(lambda: runner.run(ScheduledBatch([prefill], [n * BLOCK_SIZE])), args.repeats)
        mixed = ScheduledBatch([*decodes, prefill], [1] * len(decodes) + [n * BLOCK_SIZE])
        added_s = median_s(lambda: runner.run(mixed), args.repeats) - decode_s
        rows.append({"num_blocks": n, "num_tokens": n * BLOCK_SIZE, "swap_out_in_s": swap_s,
                     "recompute_alone_s": alone_s, "recompute_added_s": added_s,
                     "added_over_swap": added_s / swap_s})
        logger.info("%d blocks: swap %.2f ms, recompute %.1f ms alone, %.1f ms added", n, swap_s * 1e3,
                    alone_s * 1e3, added_s * 1e3)

    cheaper = [r["num_blocks"] for r in rows if r["swap_out_in_s"] < r["recompute_added_s"]]
    results = {"model": loaded.config.name, "block_size": BLOCK_SIZE, "num_threads": torch.get_num_threads(),
               "num_decodes": args.num_decodes, "decode_context": args.decode_context, "decode_step_s": decode_s,
               "rows": rows, "swap_cheaper_from_num_blocks": min(cheaper, default=None)}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\n{loaded.config.name}, block size {BLOCK_SIZE}, {results['num_threads']} threads; "
          f"a step of {args.num_decodes} decodes (context {args.decode_context}) takes {decode_s * 1e3:.1f} ms")
    print(f"{'blocks':>6} {'swap out+in ms':>15} {'recompute alone ms':>19} {'recompute added ms':>19} "
          f"{'added/swap':>11}")
    for r in rows:
        print(f"{r['num_blocks']:>6} {r['swap_out_in_s'] * 1e3:>15.2f} {r['recompute_alone_s'] * 1e3:>19.1f} "
              f"{r['recompute_added_s'] * 1e3:>19.1f} {r['added_over_swap']:>11.1f}")
    print(f"swapping is cheaper than recomputing from {results['swap_cheaper_from_num_blocks']} blocks on")
    print(f"\nwrote {out_dir / 'results.json'}")
    return 0
