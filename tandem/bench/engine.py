"""Benchmark tandem's engine against transformers' generate on one model, side by side.

Prints throughput at each concurrency (tandem / transformers tok/s and their ratio),
then single-stream TPOT against the memory floor (weight bytes / copy bandwidth), then
tandem's decode-step table: per weight format (--formats: float32 and the model's own
int4) and batch size (1 8 32), tokens/s and the pure-decode step time against that step's
memory floor (weight + KV bytes read / copy bandwidth, decode_steps.py); writes
results.json and PNG plots to --out-dir. --quick is a tiny run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from tandem.bench import decode_steps, plots
from tandem.bench.bandwidth import measure_copy_bandwidth
from tandem.bench.workload import BenchRequest, allowed_token_ids, excluded_token_ids, make_workload
from tandem.engine.engine import LLMEngine
from tandem.llm import LLM
from tandem.model.loader import LoadedModel, load_hf_model, loaded_from_hf_model
from tandem.model.source import resolve_model_source
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """What one benchmark run does; ``--quick`` only changes the defaults."""

    concurrency: list[int]
    min_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    tpot_prompt_len: int
    tpot_output_len: int
    copy_mib: int
    copy_repeats: int


FULL = Settings([1, 8, 32], 8, (32, 1024), (16, 256), 128, 128, 1024, 5)
QUICK = Settings([1, 2], 2, (16, 64), (4, 16), 32, 16, 512, 3)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench engine``; unset ones take FULL's (or QUICK's) value."""
    parser.add_argument("--model", default=None,
                        help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads for both engines (default: all cores)")
    parser.add_argument("--quick", action="store_true", help="tiny run: concurrency 1 2, short prompts and outputs")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="requests in flight (default: 1 8 32)")
    parser.add_argument("--min-requests", type=int, default=None,
                        help="requests per concurrency: max(c, this) (default: 8)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="default: 32 1024")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="default: 16 256")
    parser.add_argument("--tpot-prompt-len", type=int, default=None, help="single-stream prompt tokens (default: 128)")
    parser.add_argument("--tpot-output-len", type=int, default=None, help="single-stream output tokens (default: 128)")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="bandwidth probe tensor size, >= 512 (default: 1024)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tandem's token budget per step")
    decode_steps.add_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-results", help="where results.json and the PNGs go")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else FULL
    pick = lambda value, default: default if value is None else value  # noqa: E731
    s = Settings(
        concurrency=list(pick(args.concurrency, base.concurrency)),
        min_requests=pick(args.min_requests, base.min_requests),
        prompt_len=tuple(pick(args.prompt_len, base.prompt_len)),
        output_len=tuple(pick(args.output_len, base.output_len)),
        tpot_prompt_len=pick(args.tpot_prompt_len, base.tpot_prompt_len),
        tpot_output_len=pick(args.tpot_output_len, base.tpot_output_len),
        copy_mib=pick(args.copy_mib, base.copy_mib),
        copy_repeats=base.copy_repeats,
    )
    if min(s.concurrency) < 1 or s.min_requests < 1 or s.tpot_output_len < 2 or s.tpot_prompt_len < 1:
        raise ValueError("concurrency and min-requests must be >= 1, tpot-output-len >= 2")
    if s.copy_mib < 512:
        raise ValueError(f"--copy-mib must be >= 512 so the copy streams from DRAM, got {s.copy_mib}")
    return s


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def build_engine(loaded: LoadedModel, max_num_seqs: int, max_len: int, max_num_batched_tokens: int) -> LLMEngine:
    """A fresh engine (empty prefix cache) on the shared weights, its pool sized to hold
    ``max_num_seqs`` whole sequences so that preemption never muddles the figures.

    It is built as a user's ``LLM`` is, so it detokenizes as it would for a user."""
    block_size = 16
    blocks = max_num_seqs * -(-(max_len + 1) // block_size)
    llm = LLM.from_loaded(loaded, dtype="float32", block_size=block_size, num_kv_blocks=blocks,
                          max_model_len=max_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    return llm.engine


def run_tandem(engine: LLMEngine, requests: list[BenchRequest], concurrency: int, desc: str) -> dict:
    """Keep at most ``concurrency`` requests in flight; time the whole run.

    Returns tokens, wall seconds, per-request latencies and token arrival times.
    """
    pending = deque(enumerate(requests))
    added: dict[str, float] = {}
    arrivals: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    latencies: list[float] = []
    bar = tqdm(total=sum(r.output_len for r in requests), desc=desc, unit="tok", leave=False)
    start = time.perf_counter()
    while pending or added:
        while pending and len(added) < concurrency:
            i, r = pending.popleft()
            engine.add_request(str(i), r.prompt_token_ids, greedy(r.output_len))
            added[str(i)], arrivals[str(i)], tokens[str(i)] = time.perf_counter(), [], []
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            tokens[d.request_id].extend(d.new_token_ids)
            arrivals[d.request_id].extend([now] * len(d.new_token_ids))
            bar.update(len(d.new_token_ids))
            if d.finished:
                latencies.append(now - added.pop(d.request_id))
    wall = time.perf_counter() - start
    bar.close()
    outputs = [tokens[str(i)] for i in range(len(requests))]
    return {"seconds": wall, "tokens": sum(map(len, outputs)), "outputs": outputs,
            "latencies": latencies, "arrivals": [arrivals[str(i)] for i in range(len(requests))],
            "preemptions": engine.counters().num_preemptions}


class _StepClock:
    """A logits processor that only notes when each generate step reaches sampling."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_transformers(hf_model, requests: list[BenchRequest], batch_size: int, pad_id: int,
                     desc: str, clock: _StepClock | None = None) -> dict:
    """``generate`` on batches of ``batch_size`` prompts, left-padded, greedy, as a user would.

    Each batch runs max(out_len) steps (min_new_tokens too, so EOS cannot stop it early);
    only the tokens each request asked for are returned as output.
    """
    outputs: list[list[int]] = []
    latencies: list[float] = []
    computed = 0
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    start = time.perf_counter()
    for batch in tqdm(batches, desc=desc, unit="batch", leave=False):
        batch_start = time.perf_counter()
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[j, width - r.prompt_len:] = 1
        steps = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                min_new_tokens=steps, pad_token_id=pad_id, logits_processor=[clock] if clock else None,
            )
        computed += len(batch) * (out.shape[1] - width)
        outputs.extend(out[j, width:width + r.output_len].tolist() for j, r in enumerate(batch))
        latencies.extend([time.perf_counter() - batch_start] * len(batch))
    wall = time.perf_counter() - start
    return {"seconds": wall, "tokens": sum(map(len, outputs)), "computed_tokens": computed,
            "outputs": outputs, "latencies": latencies}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each request's tokens before the two engines' outputs first differ."""
    fractions = []
    for x, y in zip(a, b):
        same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        fractions.append(same / max(len(x), 1))
    return float(np.mean(fractions))


def bench_throughput(loaded: LoadedModel, hf_model, settings: Settings, token_ids: np.ndarray, pad_id: int,
                     seed: int, max_num_batched_tokens: int) -> list[dict]:
    """Both engines at each concurrency on the same seeded workload."""
    max_len = settings.prompt_len[1] + settings.output_len[1]
    # The warm-up request is drawn apart from the workload, so that none of its prompts is
    # in the prefix cache when the timing starts, and is short enough for any max_model_len.
    warm_prompt, warm_out = min(16, settings.prompt_len[0]), min(4, settings.output_len[0])
    warm = make_workload(1, token_ids, (warm_prompt, warm_prompt), (warm_out, warm_out), seed + 2)
    run_transformers(hf_model, warm, 1, pad_id, "transformers warm-up")
    rows = []
    for c in settings.concurrency:
        n = max(c, settings.min_requests)
        requests = make_workload(n, token_ids, settings.prompt_len, settings.output_len, seed)
        useful = sum(r.output_len for r in requests)
        logger.info("concurrency %d: %d requests, %d prompt tokens, %d output tokens",
                    c, n, sum(r.prompt_len for r in requests), useful)
        engine = build_engine(loaded, c, max_len, max_num_batched_tokens)
        run_tandem(engine, warm, 1, "tandem warm-up")  # first-call costs, untimed
        t = run_tandem(engine, requests, c, f"tandem c={c}")
        del engine  # free its KV pool before transformers runs
        h = run_transformers(hf_model, requests, c, pad_id, f"transformers c={c}")
        if t["tokens"] != useful or h["tokens"] != useful:
            raise RuntimeError(f"expected {useful} output tokens, got tandem {t['tokens']}, transformers {h['tokens']}")
        row = {
            "concurrency": c, "num_requests": n, "output_tokens": useful,
            "prompt_tokens": sum(r.prompt_len for r in requests),
            "tandem_seconds": t["seconds"], "tandem_tok_s": useful / t["seconds"],
            "tandem_mean_latency_s": float(np.mean(t["latencies"])), "tandem_preemptions": t["preemptions"],
            "transformers_seconds": h["seconds"], "transformers_tok_s": useful / h["seconds"],
            "transformers_mean_latency_s": float(np.mean(h["latencies"])),
            "transformers_computed_tokens": h["computed_tokens"],
            "greedy_agreement": agreement(t["outputs"], h["outputs"]),
        }
        row["ratio"] = row["tandem_tok_s"] / row["transformers_tok_s"]
        logger.info("concurrency %d: tandem %.1f tok/s, transformers %.1f tok/s, ratio %.2f",
                    c, row["tandem_tok_s"], row["transformers_tok_s"], row["ratio"])
        rows.append(row)
    return rows


def bench_single_stream(loaded: LoadedModel, hf_model, settings: Settings, token_ids: np.ndarray, pad_id: int,
                        seed: int, weight_bytes: int, bandwidth: float) -> dict:
    """One request, decode steps timed token to token (the prefill step left out)."""
    p, o = settings.tpot_prompt_len, settings.tpot_output_len
    request = make_workload(1, token_ids, (p, p), (o, o), seed + 1)
    warm = make_workload(1, token_ids, (p, p), (4, 4), seed + 2)
    engine = build_engine(loaded, 1, p + o, p + o)
    run_tandem(engine, warm, 1, "tandem warm-up")
    tandem_steps = np.diff(run_tandem(engine, request, 1, "tandem single stream")["arrivals"][0]).tolist()
    del engine
    run_transformers(hf_model, warm, 1, pad_id, "transformers warm-up")
    clock = _StepClock()
    run_transformers(hf_model, request, 1, pad_id, "transformers single stream", clock)
    hf_steps = np.diff(clock.times).tolist()
    floor = weight_bytes / bandwidth
    result: dict[str, Any] = {"prompt_len": p, "output_len": o, "weight_bytes": weight_bytes, "floor_s": floor}
    for name, steps in (("tandem", tandem_steps), ("transformers", hf_steps)):
        tpot = float(np.mean(steps))
        result[name] = {"tpot_s": tpot, "median_s": float(np.median(steps)),
                        "p90_s": float(np.percentile(steps, 90)), "utilisation": floor / tpot,
                        "step_s": steps}
    return result


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    step_settings = decode_steps.settings_from_args(args)
    threads = args.num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logger.info("bench engine: %s, %d torch threads, settings %s", "quick" if args.quick else "full", threads, settings)

    # One load: transformers runs this model object, tandem runs weights taken from it.
    start = time.perf_counter()
    source = resolve_model_source(args.model)
    hf_model, tokenizer = load_hf_model(source)
    loaded = loaded_from_hf_model(hf_model, tokenizer, source.name, torch.float32)
    model_config, weights = loaded.config, loaded.weights
    logger.info("loaded %s in %.1f s (%.0f MB of weights read per decode step)",
                source.name, time.perf_counter() - start, weights.num_bytes / 1e6)
    token_ids = allowed_token_ids(model_config.vocab_size, excluded_token_ids(tokenizer, model_config.eos_token_ids))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model_config.eos_token_ids[0]

    rows = bench_throughput(loaded, hf_model, settings, token_ids, pad_id, args.seed, args.max_num_batched_tokens)
    # Measured right before the single-stream TPOT, so that both see the same machine state.
    bw = measure_copy_bandwidth(settings.copy_mib, settings.copy_repeats)
    single = bench_single_stream(loaded, hf_model, settings, token_ids, pad_id, args.seed, weights.num_bytes,
                                 bw.bytes_per_s)
    formats = decode_steps.load_formats(loaded, step_settings.formats, source)
    step_bw = measure_copy_bandwidth(settings.copy_mib, settings.copy_repeats)  # the machine as the steps see it
    step_rows = decode_steps.bench_decode_steps(formats, step_settings, token_ids, args.seed, step_bw.bytes_per_s)

    results = {
        "model": model_config.name, "dtype": "float32", "num_threads": threads, "torch": torch.__version__,
        "quick": args.quick, "seed": args.seed,
        "workload": {"prompts": "uniform random token ids (special, added and EOS ids excluded)",
                     "prompt_len": list(settings.prompt_len), "output_len": list(settings.output_len),
                     "min_requests": settings.min_requests,
                     "sampling": "temperature=0, ignore_eos=True, max_tokens=out_len"},
        "bandwidth": bw.as_dict(), "throughput": rows, "single_stream": single,
        "decode_steps": {"bandwidth": step_bw.as_dict(), "rows": step_rows,
                         "gguf_file": source.gguf_file, "timed": "steps after every prompt's first token: "
                         "pure decode steps of batch_size sequences, engine.step() wall time"},
    }
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=2))
    paths = [json_path, *plots.write_plots(results, out_dir)]
    plots.print_report(results)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
