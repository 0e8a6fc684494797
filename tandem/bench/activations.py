"""Quantized weights' products on the CPU with float32 activations against int8 ones
(``--activation-quantization``: rounded to 8 bits per group of 32, kernels/int4_gemv_cpu.py and
int8_gemv_cpu.py), on the default model's own format (int4 projections from its GGUF file, an
int8 LM head, float32 elsewhere): what the rounding costs.

Each choice, on a fresh engine over the same weights:
- the perplexity of a fixed English text (standard-library docstrings), teacher-forced in
  chunks of 16 tokens: decode-sized products, the ones the choice applies to (a prefill of
  more than 160 tokens dequantizes instead); the float32 model (the file dequantized) beside
  them as the floor;
- greedy tokens on the parity prompts (kv_dtype.PARITY_PROMPTS, never tuned on), against
  float32 activations' own (`none`): tokens equal up to the first divergence, and the share
  identical.

Needs a CPU with AVX-512 VNNI for the int8 row. Writes results.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem.bench.kv_dtype import PARITY_PROMPTS, equal_prefix_len, greedy_tokens
from tandem.bench.quant import TF_CHUNK, fixed_text_ids, teacher_forced_logits
from tandem.model.loader import LoadedModel, load_model, quantized
from tandem.model.source import resolve_model_source

logger = logging.getLogger(__name__)

CHOICES = ("none", "int8")
"""--activation-quantization values compared; the first (float32 activations) is the reference."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default %(default)s)")
    parser.add_argument("--ppl-tokens", type=int, default=1024,
                        help="tokens of the perplexity text (default %(default)s)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--out-dir", default="bench-results/activation-quantization", help="where results.json goes")


def chunked_perplexity(loaded: LoadedModel, quantization: str | None, token_ids: list[int],
                       **engine_args: object) -> float:
    """exp(mean negative log-likelihood of each token given those before), TF_CHUNK tokens a forward."""
    logits = teacher_forced_logits(loaded, "float32", token_ids, TF_CHUNK, quantization, **engine_args)
    return math.exp(F.cross_entropy(logits, torch.tensor(token_ids[1:])).item())


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))
    source = resolve_model_source(args.model)
    floats = load_model(source, torch.float32)
    fmt = "int4"
    loaded = quantized(floats, fmt, source)  # from a GGUF file: its own Q4_1 blocks
    assert loaded.tokenizer is not None, "the parity prompts are text: the model needs a tokenizer"
    text = fixed_text_ids(loaded.tokenizer, args.ppl_tokens)
    prompts = [loaded.tokenizer.encode(p) for p in PARITY_PROMPTS]
    floor = chunked_perplexity(floats, None, text)
    rows: list[dict[str, Any]] = []
    reference = None
    for choice in CHOICES:
        ppl = chunked_perplexity(loaded, fmt, text, activation_quantization=choice)
        tokens, _, _ = greedy_tokens(loaded, fmt, "auto", prompts, args.max_tokens, activation_quantization=choice)
        reference = tokens if reference is None else reference
        prefixes = [equal_prefix_len(a, b) for a, b in zip(tokens, reference)]
        rows.append({"activation_quantization": choice, "perplexity": ppl, "equal_prefix": prefixes,
                     "identical_share": sum(a == b for a, b in zip(tokens, reference)) / len(prompts)})
        logger.info("%s activations: perplexity %.3f", choice, ppl)
    print(f"{loaded.config.name}, int4 weights and an int8 LM head, {args.ppl_tokens} text tokens in chunks of "
          f"{TF_CHUNK}, {len(prompts)} parity prompts x {args.max_tokens} greedy tokens")
    print(f"float32 model (the file dequantized): perplexity {floor:.3f}")
    print(f"{'act. quantization':<17} {'perplexity':>10} {'vs none':>15} {'equal prefix (mean)':>20} "
          f"{'identical':>9}")
    for r in rows:
        mean_prefix = sum(r["equal_prefix"]) / len(r["equal_prefix"])
        change = r["perplexity"] / rows[0]["perplexity"] - 1
        print(f"{r['activation_quantization']:<17} {r['perplexity']:>10.3f} {change:>+15.2%} {mean_prefix:>20.2f} "
              f"{r['identical_share']:>9.0%}")
    print("int8 vs none, equal prefix per prompt: " + " ".join(map(str, rows[-1]["equal_prefix"])))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"model": loaded.config.name, "ppl_tokens": args.ppl_tokens,
                                                   "max_tokens": args.max_tokens, "float32_model_perplexity": floor,
                                                   "rows": rows}, indent=2))
    return 0
