"""Incremental detokenization side by side: ``tokenizers``' ``DecodeStream`` (the path fast
tokenizers take) against the prefix/read-offset window technique (the fallback), per output
token, on the default model's tokenizer: English and code (tandem's own scheduler source) and
multilingual text with emoji, without and with stop strings (their hold-back on top). Rounds
interleave the two paths, so a busy machine slows both alike; the median is reported."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.engine.detokenizer import IncrementalDetokenizer

MULTILINGUAL = ("Grüße aus Köln! 東京は晴れです。Привет, мир. 🎉🚀 naïve café, "
                "¿Qué tal? 안녕하세요 مرحبا 👩‍👩‍👧 ")
STOP_STRINGS = ("never appears here", "</answer>")


def per_token_us(tokenizer: Any, token_ids: list[int], stop: tuple[str, ...], decode_stream: bool) -> float:
    detokenizer = IncrementalDetokenizer(tokenizer, stop, decode_stream=decode_stream)
    start = time.perf_counter()
    for token_id in token_ids:
        detokenizer.append(token_id)
    detokenizer.flush()
    return (time.perf_counter() - start) / len(token_ids) * 1e6


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local HF directory or .gguf file (default: the embedded model)")
    parser.add_argument("--num-tokens", type=int, default=2000, help="output tokens per text")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds per case (the median is shown)")


def run(args: argparse.Namespace) -> int:
    from tandem.model.gguf_cache import cached_source
    from tandem.model.source import load_tokenizer, resolve_model_source

    tokenizer = load_tokenizer(cached_source(resolve_model_source(args.model)))
    scheduler_source = (Path(__file__).resolve().parents[1] / "engine" / "scheduler.py").read_text()
    texts = {"English and code": scheduler_source, "multilingual and emoji": MULTILINGUAL * 200}
    print(f"{'text':<24} {'stop strings':>12} {'DecodeStream us':>16} {'window us':>10} {'speedup':>8}")
    for name, text in texts.items():
        token_ids = tokenizer.encode(text, add_special_tokens=False)[:args.num_tokens]
        for stop in ((), STOP_STRINGS):
            samples: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for decode_stream in (True, False):
                    samples[decode_stream].append(per_token_us(tokenizer, token_ids, stop, decode_stream))
            fast, window = statistics.median(samples[True]), statistics.median(samples[False])
            print(f"{name:<24} {len(stop):>12} {fast:>16.2f} {window:>10.2f} {window / fast:>7.2f}x")
    return 0
