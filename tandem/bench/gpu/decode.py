"""Decode steps on the device, single stream and batched, against the memory floor: a decode
step reads every weight once and each sequence's KV cache, so it cannot take less than
(weight bytes + KV bytes) / the device's copy bandwidth."""

from __future__ import annotations

import gc
import itertools
import logging
import statistics
import time

import torch

from tandem.bench.gpu.setup import GpuSetup
from tandem.bench.workload import BenchRequest, allowed_token_ids, excluded_token_ids, make_workload
from tandem.engine.engine import LLMEngine
from tandem.llm import LLM
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
WARMUP_OUTPUT_LEN = 4
_ids = itertools.count()


def bench(setup: GpuSetup, batch_sizes: list[int], prompt_len: int, output_len: int, seed: int,
          bandwidth: float) -> list[dict]:
    """One engine (its pool sized for the largest batch, so nothing is preempted) in the timed
    dtype; for each batch size, that many equal requests run together after a warm-up, and
    the steps after every request has its first token (pure decode steps) are timed."""
    cfg = setup.config
    max_len = prompt_len + output_len
    largest = max(batch_sizes)
    blocks = largest * -(-(max_len + 1) // BLOCK_SIZE)
    llm = LLM.from_loaded(setup.loaded, device=str(setup.device), dtype=setup.dtype_name, block_size=BLOCK_SIZE,
                          num_kv_blocks=blocks, max_model_len=max_len, max_num_seqs=largest,
                          max_num_batched_tokens=max(1024, prompt_len))
    token_ids = allowed_token_ids(cfg.vocab_size, excluded_token_ids(setup.tokenizer, cfg.eos_token_ids))
    weight_bytes = setup.loaded.weights.num_bytes
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * setup.dtype.itemsize
    rows = []
    try:
        for batch in batch_sizes:
            warm = make_workload(batch, token_ids, (prompt_len, prompt_len), (WARMUP_OUTPUT_LEN,) * 2,
                                 seed + 1000 + batch)
            decode_steps(llm.engine, warm)  # first-call costs (kernel compiles for this batch), untimed
            requests = make_workload(batch, token_ids, (prompt_len, prompt_len), (output_len, output_len), seed + batch)
            steps = decode_steps(llm.engine, requests)
            step = statistics.median(steps)
            # The KV read per step grows from prompt_len to max_len tokens: its mean.
            kv_bytes = batch * (prompt_len + output_len / 2) * kv_bytes_per_token
            floor = (weight_bytes + kv_bytes) / bandwidth
            rows.append({"batch": batch, "prompt_len": prompt_len, "output_len": output_len,
                         "num_steps": len(steps), "step_s": step, "p90_s": _percentile(steps, 0.9),
                         "tokens_per_s": batch / step, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                         "floor_s": floor, "floor_fraction": floor / step})
            logger.info("decode batch %d: %.2f ms per step, %.0f%% of the memory floor", batch, step * 1e3,
                        100 * floor / step)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def decode_steps(engine: LLMEngine, requests: list[BenchRequest]) -> list[float]:
    """Run ``requests`` together to the end (greedy, every output token made); -> the wall
    seconds of each step after all of them have their first token. Each step returns its
    tokens on the host, so a step's wall time includes its device work."""
    ids = [f"gpu-{next(_ids)}" for _ in requests]
    for request_id, r in zip(ids, requests):
        engine.add_request(request_id, r.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    started: set[str] = set()
    steps: list[float] = []
    last: float | None = None
    while engine.has_unfinished:
        deltas = engine.step()
        now = time.perf_counter()
        if last is not None:
            steps.append(now - last)
        started.update(d.request_id for d in deltas if d.new_token_ids)
        if len(started) == len(ids):
            last = now
    if not steps:
        raise RuntimeError("no pure decode step was timed: raise --output-len")
    return steps


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
