"""Weight-only int8 and int4 against float32 and bfloat16 on one model, in one run.

Variants: float32, bfloat16, int8 (the layers' projections and the LM head in int8, the
rest of the model in float32), int4 (the same in int4 groups of 32; from a GGUF file, the
file's own Q4_1 blocks, bit-exact) and int8+bf16 / int4+bf16 (the same on a bfloat16
model). For each: decode tokens/s of one greedy batch (--num-seqs chat prompts, --max-tokens
each, timed from the second decode step on, alternating order over --rounds, a fresh engine
each run), the bytes of weights one decode step reads and the bytes held, the memory-floor
utilisation (the bytes one decode step reads, weights and the mean KV context, over the copy
bandwidth measured in the same run, divided by the measured step time), and how close it
stays to float32:
the share of float32's greedy tokens it picks given float32's own prefix (teacher-forced
in chunks of 16 tokens: the decode-sized int8 path), the share of identical tokens when it
generates on its own (one early near-tie changes all the rest), and the perplexity of a
fixed English text (standard-library docstrings, one prefill). Writes results.json and
quant.png to --out-dir.

"float32" is the model as loaded. The default model's file is already 4-bit (GGUF Q4_1), so
its float32 row is that file dequantized and the int4 rows (its own Q4_1 blocks) measure the
cost of bf16 arithmetic in the int4 products and of the int8 LM head, not of 4-bit weights;
for that cost see tests/model/test_gptq_awq.py and docs/quantization.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import subprocess
import time
import unittest
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem.bench.bandwidth import measure_copy_bandwidth
from tandem.bench.quantization.report import print_report, write_plot
from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.llm import LLM
from tandem.model.dtypes import DTYPES
from tandem.model.int4 import Int4Weight
from tandem.model.llama import LlamaModel, ModelWeights
from tandem.model.loader import LoadedModel, load_hf_model, loaded_from_hf_model, quantized
from tandem.model.quantization import weight_bytes, weight_key
from tandem.model.source import resolve_model_source
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# (name, model dtype, quantization)
VARIANTS = (("float32", "float32", None), ("bfloat16", "bfloat16", None),
            ("int8", "float32", "int8"), ("int8+bf16", "bfloat16", "int8"),
            ("int4", "float32", "int4"), ("int4+bf16", "bfloat16", "int4"))
QUESTIONS = (
    "What are some good ways to stay healthy during a busy week?",
    "Write a short story about a robot who wants to learn how to paint.",
    "Why do people enjoy travelling to new places?",
    "Give me some ideas for a birthday party for a ten year old.",
    "Explain how a bicycle stays upright.",
    "Describe the water cycle to a child.",
    "What should I pack for a weekend of camping?",
    "How does a library decide which books to buy?",
)
# Fixed English text available offline (the docstrings tests/reference.py uses too).
_TEXT_SOURCES = (argparse, collections, json, logging, subprocess, unittest)
TF_CHUNK = 16


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench quant``; ``--quick`` changes the defaults of the unset ones."""
    parser.add_argument("--model", default=None,
                        help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run: 2 sequences, 12 tokens, 1 round, 128 text tokens, 256 MiB bandwidth copy")
    parser.add_argument("--num-seqs", type=int, default=None,
                        help=f"sequences in the decode batch, at most {len(QUESTIONS)} (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per sequence (default: 64)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed runs per variant, order alternating (default: 3)")
    parser.add_argument("--ppl-tokens", type=int, default=None, help="tokens of the perplexity text (default: 1024)")
    parser.add_argument("--out-dir", default="bench-results/quant", help="where results.json and quant.png go")


def _settings(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(num_seqs, max_tokens, rounds, ppl_tokens) from the options and their defaults."""
    defaults = (2, 12, 1, 128) if args.quick else (8, 64, 3, 1024)
    given = (args.num_seqs, args.max_tokens, args.rounds, args.ppl_tokens)
    n, max_tokens, rounds, ppl_tokens = (d if g is None else g for g, d in zip(given, defaults))
    if not 1 <= n <= len(QUESTIONS) or max_tokens < 2 or rounds < 1 or ppl_tokens < 2:
        raise ValueError(f"need 1 <= num-seqs <= {len(QUESTIONS)}, max-tokens >= 2, rounds >= 1, ppl-tokens >= 2")
    return n, max_tokens, rounds, ppl_tokens


def fixed_text_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` token ids of a fixed English text."""
    ids = tokenizer.encode("\n\n".join(m.__doc__ or "" for m in _TEXT_SOURCES))
    if len(ids) < num_tokens:
        raise ValueError(f"the fixed text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def teacher_forced_logits(loaded: LoadedModel, dtype: str, token_ids: list[int], chunk: int | None = None,
                          quantization: str | None = None, **engine_args: Any) -> torch.Tensor:
    """The model's logits after each of ``token_ids`` but the last, fed ``chunk`` tokens per
    forward (None: all in one prefill); engine_args: more EngineConfig.build options.
    -> [len(token_ids) - 1, vocab] float32."""
    block_size = 16
    config = EngineConfig.build(loaded.config, dtype=dtype, block_size=block_size, quantization=quantization,
                                num_kv_blocks=-(-len(token_ids) // block_size), **engine_args)
    loaded = quantized(loaded, quantization)
    model = LlamaModel(loaded.config, loaded.weights, config.max_model_len)
    runner = ModelRunner(config, model)
    seq = Sequence("tf", list(token_ids), SamplingParams(temperature=0, max_tokens=1), 0)
    seq.block_ids = list(range(config.num_kv_blocks))
    rows = []
    while seq.num_computed_tokens < len(token_ids) - 1:
        n = min(chunk or len(token_ids), len(token_ids) - 1 - seq.num_computed_tokens)
        input_ids, positions, meta, _ = runner.prepare(ScheduledBatch([seq], [n]))
        rows.append(model.forward(input_ids, positions, runner.kv_cache, meta, torch.arange(n)))
        seq.num_computed_tokens += n
    return torch.cat(rows)


def perplexity(loaded: LoadedModel, dtype: str, token_ids: list[int], quantization: str | None = None) -> float:
    """exp(mean negative log-likelihood of each token given those before it), one prefill."""
    logits = teacher_forced_logits(loaded, dtype, token_ids, quantization=quantization)
    return math.exp(F.cross_entropy(logits, torch.tensor(token_ids[1:])).item())


def forced_agreement(loaded: LoadedModel, dtype: str, prompts: list[list[int]], outputs: list[list[int]],
                     quantization: str | None = None) -> float:
    """Share of ``outputs`` tokens that are the model's argmax given the prompt and the
    outputs before them (teacher-forced in chunks of TF_CHUNK tokens)."""
    loaded = quantized(loaded, quantization)  # once: each prompt's engine then finds it quantized
    same = total = 0
    for prompt, out in zip(prompts, outputs):
        logits = teacher_forced_logits(loaded, dtype, prompt + out, TF_CHUNK, quantization)
        picks = logits[len(prompt) - 1:].argmax(-1)  # [len(out)]
        same += int((picks == torch.tensor(out)).sum())
        total += len(out)
    return same / total


def decode_run(loaded: LoadedModel, dtype: str, quantization: str | None, prompts: list[list[int]],
               max_tokens: int) -> tuple[float, list[list[int]]]:
    """One greedy batch on a fresh engine -> (decode tokens/s after the first decode step, outputs)."""
    llm = LLM.from_loaded(loaded, dtype=dtype, kv_cache_memory_gib=0.25, quantization=quantization)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for request_id, prompt in zip(outputs, prompts):
        engine.add_request(request_id, prompt, params)

    def step() -> int:
        deltas = engine.step()
        for d in deltas:
            outputs[d.request_id].extend(d.new_token_ids)
        return sum(len(d.new_token_ids) for d in deltas)

    while min(len(o) for o in outputs.values()) < 2:  # the prefill and one decode step, untimed
        step()
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished:
        tokens += step()
    return tokens / (time.perf_counter() - start), list(outputs.values())


def held_bytes(weights: ModelWeights) -> int:
    """Bytes of every weight held (num_bytes, plus an embedding table the LM head is not, plus
    the CPU kernel's copy of each int4 weight)."""
    extra = 0 if weight_key(weights.lm_head) == weight_key(weights.embed_tokens) else weight_bytes(weights.embed_tokens)
    int4 = {weight_key(w): w for w in [weights.lm_head] + [t for layer in weights.layers for t in vars(layer).values()]
            if isinstance(w, Int4Weight)}
    return weights.num_bytes + extra + sum(w.held_bytes - w.num_bytes for w in int4.values())


def kv_read_bytes(loaded: LoadedModel, dtype: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Mean KV bytes one timed decode step reads: decode step k (k = 2 .. max_tokens - 1 are
    timed) attends over prompt + k tokens of every sequence."""
    timed = range(2, max_tokens)
    if not timed:
        return 0.0
    mean_context = sum(len(p) for p in prompts) + len(prompts) * sum(timed) / len(timed)
    return mean_context * loaded.config.kv_bytes_per_token(DTYPES[dtype])


def run(args: argparse.Namespace) -> int:
    num_seqs, max_tokens, rounds, ppl_tokens = _settings(args)
    threads = args.num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    bandwidth = measure_copy_bandwidth(256 if args.quick else 1024, 3 if args.quick else 5)
    source = resolve_model_source(args.model)
    hf_model, tokenizer = load_hf_model(source)
    floats = {d: loaded_from_hf_model(hf_model, tokenizer, source.name, getattr(torch, d))
              for d in ("float32", "bfloat16")}
    del hf_model
    models: dict[str, LoadedModel] = {}
    for name, dtype, quant in VARIANTS:  # quantized once; each engine then finds its weights quantized
        models[name] = quantized(floats[dtype], quant, source)  # int4 from GGUF: the file's own blocks
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                              add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
               for q in QUESTIONS[:num_seqs]]
    for name, dtype, quant in VARIANTS:  # warm-up, untimed: first-call costs of every path
        decode_run(models[name], dtype, quant, prompts[:1], 3)
    speeds: dict[str, list[float]] = {name: [] for name, _, _ in VARIANTS}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name, dtype, quant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            tok_s, outputs[name] = decode_run(models[name], dtype, quant, prompts, max_tokens)
            speeds[name].append(tok_s)
            logger.info("%s, round %d: %.1f decode tok/s", name, r + 1, tok_s)
    text = fixed_text_ids(tokenizer, ppl_tokens)
    reference = outputs["float32"]
    rows: list[dict[str, Any]] = []
    for name, dtype, quant in VARIANTS:
        weights = models[name].weights
        same = sum(a == b for o, ref in zip(outputs[name], reference) for a, b in zip(o, ref))
        tok_s = sum(speeds[name]) / len(speeds[name])
        step_bytes = weights.num_bytes + kv_read_bytes(models[name], dtype, prompts, max_tokens)
        step_s = num_seqs / tok_s  # every step makes one token of each sequence
        rows.append({"variant": name, "dtype": dtype, "quantization": quant,
                     "decode_tok_s": tok_s, "decode_tok_s_runs": speeds[name],
                     "read_bytes": weights.num_bytes, "held_bytes": held_bytes(weights),
                     "step_read_bytes": step_bytes, "step_s": step_s, "floor_s": step_bytes / bandwidth.bytes_per_s,
                     "floor_utilisation": step_bytes / bandwidth.bytes_per_s / step_s,
                     "forced_agreement": forced_agreement(models[name], dtype, prompts, reference, quant),
                     "same_tokens": same / sum(len(ref) for ref in reference),
                     "perplexity": perplexity(models[name], dtype, text, quant)})
    base = rows[0]
    for row in rows:
        row["tok_s_ratio"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["bytes_ratio"] = row["read_bytes"] / base["read_bytes"]
        row["perplexity_rel_diff"] = row["perplexity"] / base["perplexity"] - 1
    results = {"model": source.name, "num_threads": threads, "torch": torch.__version__, "quick": args.quick,
               "num_seqs": num_seqs, "max_tokens": max_tokens, "rounds": rounds, "ppl_tokens": ppl_tokens,
               "gguf_file": source.gguf_file, "bandwidth": bandwidth.as_dict(), "rows": rows}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    write_plot(results, out_dir / "quant.png")
    print_report(results)
    print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'quant.png'}")
    return 0
