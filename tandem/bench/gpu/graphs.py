"""Decode steps eager against replayed CUDA graphs (tandem/engine/cuda_graphs.py): two engines
on the same weights, one with ``enforce_eager``, the same greedy requests through both at each
batch size; their step times, the graphs' capture time and memory, and whether the outputs
agree token for token (the graphs' attention splits its context by max_model_len, not by the
step's longest context, so float rounding may differ: reported, not failed)."""

from __future__ import annotations

import gc
import itertools
import logging
import statistics
import time

import torch

from tandem.bench.gpu.decode import BLOCK_SIZE, WARMUP_OUTPUT_LEN, decode_steps
from tandem.bench.gpu.setup import GpuSetup
from tandem.bench.workload import BenchRequest, allowed_token_ids, excluded_token_ids, make_workload
from tandem.llm import LLM
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_ids = itertools.count()


def bench(setup: GpuSetup, batch_sizes: list[int], prompt_len: int, output_len: int, seed: int) -> dict:
    """-> {"start_s", "capture_s", "capture_bytes", "planned_bytes", "sizes", "rows": one per
    batch size with eager_step_s, graph_step_s, speedup, tokens_agree and replays (the graphed
    run's replays: 0 means its steps ran eagerly)}."""
    cfg = setup.config
    token_ids = allowed_token_ids(cfg.vocab_size, excluded_token_ids(setup.tokenizer, cfg.eos_token_ids))
    workloads = {b: (make_workload(b, token_ids, (prompt_len, prompt_len), (WARMUP_OUTPUT_LEN,) * 2, seed + 1000 + b),
                     make_workload(b, token_ids, (prompt_len, prompt_len), (output_len, output_len), seed + b))
                 for b in batch_sizes}
    result: dict = {}
    steps: dict[bool, dict[int, tuple[float, list[list[int]], int]]] = {}
    for eager in (True, False):
        llm, start_s = _engine(setup, max(batch_sizes), prompt_len + output_len, eager)
        try:
            graphs = llm.engine.runner.graphs
            if not eager:
                if graphs is None:
                    raise RuntimeError("the graphed engine captured no graphs")
                result.update(start_s=start_s, capture_s=graphs.capture_seconds, capture_bytes=graphs.capture_bytes,
                              planned_bytes=graphs.planned_bytes, sizes=graphs.sizes)
            steps[eager] = {b: _timed(llm, warm, requests) for b, (warm, requests) in workloads.items()}
            logger.info("decode steps timed %s", "eagerly" if eager else "with CUDA graphs")
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    result["rows"] = [{"batch": b, "eager_step_s": steps[True][b][0], "graph_step_s": steps[False][b][0],
                       "speedup": steps[True][b][0] / steps[False][b][0],
                       "tokens_agree": steps[True][b][1] == steps[False][b][1], "replays": steps[False][b][2]}
                      for b in batch_sizes]
    return result


def _engine(setup: GpuSetup, largest: int, max_len: int, eager: bool) -> tuple[LLM, float]:
    """An engine sized as decode.bench's (nothing preempted) -> (it, seconds to start, capture included)."""
    blocks = largest * -(-(max_len + 1) // BLOCK_SIZE)
    start = time.perf_counter()
    llm = LLM.from_loaded(setup.loaded, device=str(setup.device), dtype=setup.dtype_name, block_size=BLOCK_SIZE,
                          num_kv_blocks=blocks, max_model_len=max_len, max_num_seqs=largest,
                          max_num_batched_tokens=max(1024, max_len), enforce_eager=eager)
    return llm, time.perf_counter() - start


def _timed(llm: LLM, warm: list[BenchRequest], requests: list[BenchRequest]) -> tuple[float, list[list[int]], int]:
    """-> (the median pure decode step's seconds (as decode.decode_steps times them), each
    request's greedy tokens, the graph replays the timed run made)."""
    engine = llm.engine
    decode_steps(engine, warm)  # first-call costs, untimed
    graphs = engine.runner.graphs
    replays = 0 if graphs is None else graphs.num_replays
    ids = [f"graphs-{next(_ids)}" for _ in requests]
    for request_id, r in zip(ids, requests):
        engine.add_request(request_id, r.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps: list[float] = []
    last: float | None = None
    while engine.has_unfinished:
        deltas = engine.step()
        now = time.perf_counter()
        if last is not None:
            steps.append(now - last)
        for d in deltas:
            tokens[d.request_id] += d.new_token_ids
        if all(tokens.values()):
            last = now
    if not steps:
        raise RuntimeError("no pure decode step was timed: raise --output-len")
    return statistics.median(steps), [tokens[i] for i in ids], (0 if graphs is None else graphs.num_replays - replays)
