"""Where one decode step's time goes, part by part: scheduling, metadata, each projection,
norms with the residual adds, RoPE with the KV store, attention, the rest of the forward
(embedding, SwiGLU's product, views), sampling,
the sequences' update with detokenization, and the Python left between them; beside the
step's memory floor (weight + KV bytes read / the copy bandwidth measured in the same run).
Where the compiled CPU decode step runs (tandem/model/compiled_step.py), the same steps are
timed both ways, side by side: the eager forward part by part, the compiled one as one part.

Each part is timed by wrapping the function that does it (nothing in the engine changes);
decode steps only, after a warm-up, at each batch size and weight format.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tandem.bench.bandwidth import measure_copy_bandwidth
from tandem.config.names import ACTIVATION_QUANTIZATIONS
from tandem.kernels import ops
from tandem.llm import LLM
from tandem.model import llama
from tandem.sampling_params import SamplingParams

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LAYER_PARTS = ("norms + residual adds", "RoPE + KV store", "attention")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local HF directory or .gguf file (default: the embedded one)")
    parser.add_argument("--formats", nargs="+", default=["none", "auto"],
                        help="--quantization values to profile (default: none auto, i.e. float32 and the file's own)")
    parser.add_argument("--activation-quantization", nargs="+", default=["none"], choices=ACTIVATION_QUANTIZATIONS,
                        help="--activation-quantization values to profile each quantized format with (default none)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default 1 8)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each sequence (default 256)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per row (default 20)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--quick", action="store_true", help="tiny run: batch 1, 32-token context, 3 steps")


class PartTimer:
    """Seconds spent in each wrapped function, by part name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str | Callable[..., str], fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                part = name(*args, **kwargs) if callable(name) else name
                self.seconds[part] += time.perf_counter() - start
        return timed


@contextlib.contextmanager
def timed_parts(llm: LLM, timer: PartTimer) -> Iterator[None]:
    """Wrap the engine's parts with ``timer`` while inside."""
    engine, weights = llm.engine, llm.engine.runner.model.weights
    names = {id(getattr(layer, p)): p for layer in weights.layers for p in PROJECTIONS}
    names[id(weights.lm_head)] = "lm_head"
    patches = [
        (llama, "linear", timer.wrap(lambda x, w, bias=None: names.get(id(w), "other products"), llama.linear)),
        (llama, "rms_norm", timer.wrap("norms + residual adds", llama.rms_norm)),
        (llama, "add_rms_norm", timer.wrap("norms + residual adds", llama.add_rms_norm)),
        (llama, "rope_and_store_kv", timer.wrap("RoPE + KV store", llama.rope_and_store_kv)),
        (ops, "attention", timer.wrap("attention", ops.attention)),
        (engine.scheduler, "schedule", timer.wrap("schedule", engine.scheduler.schedule)),
        (engine.scheduler, "update", timer.wrap("update + detokenize", engine.scheduler.update)),
        (engine.runner, "prepare", timer.wrap("metadata", engine.runner.prepare)),
        (engine.runner, "sample", timer.wrap("sampling", engine.runner.sample)),
        (engine.runner.model, "forward", timer.wrap("forward", engine.runner.model.forward)),
    ]
    if engine.runner.compiled_step is not None:
        patches.append((engine.runner.compiled_step, "forward",
                        timer.wrap("compiled forward", engine.runner.compiled_step.forward)))
    originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, fn in patches:
        setattr(obj, attr, fn)
    try:
        yield
    finally:
        for obj, attr, fn in originals:
            if isinstance(obj, type(llama)):
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)  # the instance attribute: the class's method shows again


@contextlib.contextmanager
def eager_steps(llm: LLM) -> Iterator[None]:
    """Every step through the eager forward while inside (as --enforce-eager would run it)."""
    runner = llm.engine.runner
    compiled, runner.compiled_step = runner.compiled_step, None
    try:
        yield
    finally:
        runner.compiled_step = compiled


def profile(llm: LLM, batch_size: int, context: int, num_steps: int) -> tuple[dict[str, float], float]:
    """-> (ms per step by part, ms per step in all) over ``num_steps`` decode-only steps."""
    engine = llm.engine
    vocab = engine.config.model.vocab_size
    for i in range(batch_size):
        prompt = [(97 * i + 31 * t) % vocab for t in range(context)]
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=num_steps + 8, ignore_eos=True))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.sequences.values()):
        engine.step()  # the prefills
    for _ in range(3):
        engine.step()  # warm-up decodes
    timer = PartTimer()
    with timed_parts(llm, timer):
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        total = (time.perf_counter() - start) / num_steps * 1e3
    for request_id in list(engine.sequences):
        engine.abort_request(request_id)
    parts = {name: s / num_steps * 1e3 for name, s in timer.seconds.items()}
    inner = sum(v for k, v in parts.items() if k in (*PROJECTIONS, "lm_head", "other products", *LAYER_PARTS))
    if "forward" in parts:
        parts["rest of the forward"] = parts.pop("forward") - inner
    parts["Python between"] = total - sum(parts.values())
    return parts, total


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.batch_sizes, args.context, args.steps = [1], 32, 3
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    bandwidth = measure_copy_bandwidth(256 if args.quick else 1024, 3 if args.quick else 5)
    print(f"copy bandwidth {bandwidth.bytes_per_s / 1e9:.2f} GB/s, {torch.get_num_threads()} threads")
    for fmt, activations in itertools.product(args.formats, args.activation_quantization):
        if fmt == "none" and activations != "none":
            continue  # float weights: no quantized products to take the choice
        llm = LLM(args.model, quantization=fmt, kv_cache_memory_gib=0.25, activation_quantization=activations)
        config = llm.engine.config
        weight_bytes = llm.engine.runner.model.weights.num_bytes
        for batch_size in args.batch_sizes:
            kv_bytes = (batch_size * (args.context + args.steps // 2)
                        * config.model.kv_bytes_per_token(config.kv_cache_dtype))
            floor = (weight_bytes + kv_bytes) / bandwidth.bytes_per_s * 1e3
            with eager_steps(llm):
                runs = [("eager", *profile(llm, batch_size, args.context, args.steps))]
            if llm.engine.runner.compiled_step is not None:
                runs.append(("compiled", *profile(llm, batch_size, args.context, args.steps)))
            acts = f", --activation-quantization {activations}" if config.quantization else ""
            print(f"\n--quantization {fmt} ({config.quantization or config.dtype_name}){acts}, batch {batch_size}, "
                  f"context {args.context}: floor {floor:.2f} ms ({weight_bytes / 1e6:.0f} MB weights + "
                  f"{kv_bytes / 1e6:.1f} MB KV)")
            for path, parts, total in runs:
                print(f"{path} step {total:.2f} ms: {floor / total:.0%} of the floor"
                      + (f", {runs[0][2] / total:.2f}x the eager step" if path != "eager" else ""))
                for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
                    print(f"  {name:<22} {ms:8.2f} ms  {ms / total:6.1%}")
    return 0
