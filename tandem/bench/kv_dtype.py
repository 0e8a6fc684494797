"""The KV cache in bfloat16 against the activations' float32, on the default model's own
format (int4 from its GGUF file, float32 activations): greedy tokens side by side.

Each --kv-cache-dtype generates greedily from the same parity prompts (PARITY_PROMPTS: a
fixed, varied set written here and used for nothing else, so no choice was ever tuned on
them) on a fresh engine over the same weights. Against the first (float32) it reports
per prompt the tokens equal until the first divergence, and in all: their mean over the
prompts, as tokens and as a share of --max-tokens, and the share of outputs identical
throughout; plus each cache's bytes per token. One early near-tie changes every token after
it, so a divergence says where greedy decoding first met a near-tie, not how far apart the
logits are. Writes results.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.llm import LLM
from tandem.model.gguf_format import resolve_quantization
from tandem.model.loader import LoadedModel, load_model, quantized
from tandem.model.source import resolve_model_source
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PARITY_PROMPTS: tuple[str, ...] = (
    "Write a haiku about a lighthouse in winter.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Q: A train leaves at 3:40 pm and the trip takes 2 hours 35 minutes. When does it arrive?\nA:",
    "List three differences between a violin and a cello:\n1.",
    "Translate into French: The library closes early on Sundays.",
    "Once upon a time, a small robot found a seed in the desert.",
    '{"name": "Ada Lovelace", "born": 1815, "known_for": [',
    "The mitochondria is often called the powerhouse of the cell because",
)
"""Prompts for parity only: fixed, varied (verse, code, arithmetic, a list, translation, a
story, JSON, science), and never used to tune anything."""

KV_DTYPES = ("float32", "bfloat16")
"""--kv-cache-dtype values compared by default; the first is the reference."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quantization", default="auto", help="the weights' format (default: the model's own)")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=list(KV_DTYPES),
                        help="KV cache dtypes compared, the first the reference (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default %(default)s)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--out-dir", default="bench-results/kv-dtype", help="where results.json goes")


@dataclass(frozen=True)
class KVDtypeRow:
    """One KV cache dtype's greedy outputs against the reference's."""

    kv_cache_dtype: str
    """As the engine resolved it (never auto)."""
    bytes_per_token: int
    """K and V of one token, all layers, in this dtype."""
    equal_prefix: tuple[int, ...]
    """Per prompt: tokens equal to the reference's before the first that differs."""
    identical: tuple[bool, ...]
    """Per prompt: the whole output equal to the reference's."""
    max_tokens: int

    @property
    def mean_equal_prefix(self) -> float:
        return sum(self.equal_prefix) / len(self.equal_prefix)

    @property
    def identical_share(self) -> float:
        return sum(self.identical) / len(self.identical)


def equal_prefix_len(a: list[int], b: list[int]) -> int:
    """Tokens equal at the start of ``a`` and ``b``, up to the first that differs (or the shorter's end)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def default_model(model: str | None, quantization: str) -> tuple[LoadedModel, str | None]:
    """-> (the model loaded in float32 and quantized as ``quantization`` resolves, that format)."""
    source = resolve_model_source(model)
    fmt = resolve_quantization(quantization, source)
    return quantized(load_model(source, torch.float32), fmt, source), fmt


def greedy_tokens(loaded: LoadedModel, quantization: str | None, kv_cache_dtype: str, prompts: list[list[int]],
                  max_tokens: int, **engine_args: Any) -> tuple[list[list[int]], int, str]:
    """-> (each prompt's greedy tokens, KV bytes per token, the resolved KV dtype) on a fresh
    engine (engine_args: more of its options)."""
    llm = LLM.from_loaded(loaded, quantization=quantization or "none", kv_cache_dtype=kv_cache_dtype,
                          kv_cache_memory_gib=0.1, max_num_seqs=len(prompts), **engine_args)
    config = llm.config
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return ([list(o.outputs[0].token_ids) for o in outputs], config.model.kv_bytes_per_token(config.kv_cache_dtype),
            config.kv_cache_dtype_name)


def compare_kv_dtypes(loaded: LoadedModel, quantization: str | None, kv_dtypes: list[str], prompts: list[list[int]],
                      max_tokens: int) -> list[KVDtypeRow]:
    """One row per KV dtype, each against the first's outputs (the reference's row: all equal)."""
    rows, reference = [], None
    for kv_dtype in kv_dtypes:
        tokens, per_token, resolved = greedy_tokens(loaded, quantization, kv_dtype, prompts, max_tokens)
        reference = tokens if reference is None else reference
        rows.append(KVDtypeRow(resolved, per_token, tuple(equal_prefix_len(a, b) for a, b in zip(tokens, reference)),
                               tuple(a == b for a, b in zip(tokens, reference)), max_tokens))
    return rows


def report_lines(rows: list[KVDtypeRow]) -> list[str]:
    """The table `run` prints: a row per KV dtype, then each prompt's equal prefix."""
    lines = [f"{'kv cache dtype':<15} {'bytes/token':>11} {'equal prefix (mean)':>20} {'of max':>7} "
             f"{'identical':>9}"]
    for r in rows:
        lines.append(f"{r.kv_cache_dtype:<15} {r.bytes_per_token:>11} {r.mean_equal_prefix:>20.2f} "
                     f"{r.mean_equal_prefix / r.max_tokens:>7.0%} {r.identical_share:>9.0%}")
    for r in rows[1:]:
        lines.append(f"{r.kv_cache_dtype} vs {rows[0].kv_cache_dtype}, equal prefix per prompt: "
                     + " ".join(str(n) for n in r.equal_prefix))
    return lines


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))
    loaded, fmt = default_model(args.model, args.quantization)
    assert loaded.tokenizer is not None, "the parity prompts are text: the model needs a tokenizer"
    prompts = [loaded.tokenizer.encode(p) for p in PARITY_PROMPTS]
    rows = compare_kv_dtypes(loaded, fmt, args.kv_cache_dtypes, prompts, args.max_tokens)
    print(f"{loaded.config.name}, weights {fmt or 'float'}, {len(prompts)} parity prompts, "
          f"{args.max_tokens} greedy tokens each")
    print("\n".join(report_lines(rows)))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = [dict(asdict(r), mean_equal_prefix=r.mean_equal_prefix, identical_share=r.identical_share)
               for r in rows]
    (out / "results.json").write_text(json.dumps({"model": loaded.config.name, "quantization": fmt,
                                                   "rows": results}, indent=2))
    logger.info("wrote %s", out / "results.json")
    return 0
