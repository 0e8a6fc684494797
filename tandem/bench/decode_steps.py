"""The decode-step table of ``tandem bench engine``: per weight format and batch size, the
mean pure-decode step time against that step's memory floor.

A decode step reads every weight once and the K and V of every token in each sequence's
context, so its floor is (weight bytes + KV bytes read) / copy bandwidth, the bandwidth
measured in the same run (bandwidth.py). B requests of the same prompt and output length
are added at once; the steps after the one that gave the last of them its first token are
pure decode steps of exactly B sequences (no prefill chunk in them), and only those are
timed. Each batch size runs every format on the same prompts, the formats' order
alternating from one batch size to the next so that drift in the machine's speed hits them
alike. Each row also records the share of the machine's CPU other processes took while it ran
(serving/interference.py): 10% or more makes its figures suspect, and the table says so.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import numpy as np

from tandem.bench.serving.interference import CpuWatch
from tandem.bench.workload import make_workload
from tandem.config.names import auto_kv_cache_dtype_name
from tandem.llm import LLM
from tandem.model.loader import LoadedModel, quantized
from tandem.model.source import ModelSource
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FORMATS: dict[str, str | None] = {"float32": None, "int8": "int8", "int4": "int4"}
"""``--formats`` names -> the engine's ``quantization`` (float32 activations and KV for all).
``auto``, the model's own format, resolves to one of these (see resolve_format). For a GGUF
file int4 keeps the file's own Q4_1 blocks (loader.quantized)."""
EAGER = "-eager"
"""A format name with this suffix runs with --enforce-eager: the quantized formats' decode steps
op by op instead of as one compiled call (tandem/model/compiled_step.py), side by side."""
FORMAT_CHOICES = (*FORMATS, "auto", *(f"{name}{EAGER}" for name in ("int8", "int4", "auto")))


@dataclass(frozen=True)
class StepSettings:
    """What the decode-step table runs; ``--quick`` only changes the defaults."""

    batch_sizes: list[int]
    prompt_len: int
    output_len: int
    formats: list[str]


FULL = StepSettings([1, 8, 32], 128, 64, ["float32", "int4", f"int4{EAGER}"])
QUICK = StepSettings([1, 2], 16, 4, ["float32", "int4"])


def add_args(parser: argparse.ArgumentParser) -> None:
    """The decode-step table's options of ``tandem bench engine``."""
    parser.add_argument("--formats", nargs="+", choices=FORMAT_CHOICES, default=None,
                        help="weight formats of the decode-step table: float32 (a GGUF file dequantized), int8, "
                             "int4 (a GGUF file's own Q4_1 blocks), auto (the model's own format); with -eager "
                             "(int4-eager, ...): under --enforce-eager (default: float32 int4 int4-eager)")
    parser.add_argument("--step-batch-sizes", type=int, nargs="+", default=None,
                        help="sequences per decode step in the decode-step table (default: 1 8 32)")
    parser.add_argument("--step-prompt-len", type=int, default=None,
                        help="prompt tokens of each sequence there (default: 128)")
    parser.add_argument("--step-output-len", type=int, default=None,
                        help="output tokens of each sequence there, >= 3 (default: 64)")


def settings_from_args(args: argparse.Namespace) -> StepSettings:
    base = QUICK if args.quick else FULL
    pick = lambda value, default: default if value is None else value  # noqa: E731
    s = StepSettings(list(pick(args.step_batch_sizes, base.batch_sizes)), pick(args.step_prompt_len, base.prompt_len),
                     pick(args.step_output_len, base.output_len), list(dict.fromkeys(pick(args.formats, base.formats))))
    if min(s.batch_sizes) < 1 or s.prompt_len < 1 or s.output_len < 3:
        raise ValueError("--step-batch-sizes and --step-prompt-len must be >= 1, --step-output-len >= 3 "
                         "(the first decode step after the prefill is the first one timed)")
    return s


def resolve_format(name: str, source: ModelSource | None) -> str | None:
    """A ``--formats`` name -> the engine's ``quantization``: auto is the model's own format."""
    name = name.removesuffix(EAGER)
    if name != "auto":
        return FORMATS[name]
    try:
        from tandem.model.gguf_format import resolve_quantization
    except ImportError:  # an engine without --quantization auto
        raise ValueError("--formats auto needs an engine with --quantization auto") from None
    return resolve_quantization("auto", source)


@dataclass(frozen=True)
class Format:
    """One weight format measured: its name, the engine's quantization, the weights in it."""

    name: str
    quantization: str | None
    loaded: LoadedModel
    enforce_eager: bool = False

    def engine_kwargs(self) -> dict:
        """LLM(...)'s keywords for this format: the one place a name becomes engine options."""
        return {"dtype": "float32", "quantization": self.quantization, "enforce_eager": self.enforce_eager}


def load_formats(loaded: LoadedModel, names: list[str], source: ModelSource | None) -> list[Format]:
    """Each format's weights, quantized once from the float32 ``loaded`` (shared, not copied:
    a format and its -eager twin run the same weights)."""
    formats: list[Format] = []
    weights: dict[str | None, LoadedModel] = {}
    for name in names:
        quantization = resolve_format(name, source)
        if quantization not in weights:
            weights[quantization] = quantized(loaded, quantization, source)
        label = name if not name.startswith("auto") else f"{name} ({quantization or 'float32'})"
        formats.append(Format(label, quantization, weights[quantization], name.endswith(EAGER)))
    return formats


def _engine(fmt: Format, batch: int, max_len: int):
    """A fresh engine whose pool holds ``batch`` whole sequences (no preemption muddles the
    steps) and whose token budget takes every prompt in one step, so that all the sequences
    start decoding together and run every decode step together."""
    block_size = 16
    llm = LLM.from_loaded(fmt.loaded, **fmt.engine_kwargs(), block_size=block_size,
                          num_kv_blocks=batch * -(-(max_len + 1) // block_size), max_model_len=max_len,
                          max_num_seqs=batch, max_num_batched_tokens=batch * max_len)
    return llm.engine


def decode_step_times(fmt: Format, prompts: list[list[int]], output_len: int, warm_prompt: list[int]) -> list[float]:
    """Seconds of each pure decode step of ``prompts`` run together (greedy, EOS ignored)."""
    batch = len(prompts)
    engine = _engine(fmt, batch, max(len(prompts[0]), len(warm_prompt)) + output_len)
    engine.add_request("warm", warm_prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished:  # first-call costs of this engine and format, untimed
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    started: set[str] = set()
    times: list[float] = []
    while engine.has_unfinished:
        all_started = len(started) == batch  # before this step: then it holds no prefill
        start = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - start
        made = sum(len(d.new_token_ids) for d in deltas)
        started.update(d.request_id for d in deltas if d.new_token_ids)
        if all_started:
            if made != batch:
                raise RuntimeError(f"a decode step of {batch} sequences made {made} tokens")
            times.append(elapsed)
    return times


def kv_bytes_per_step(loaded: LoadedModel, batch: int, prompt_len: int, num_steps: int,
                      kv_cache_dtype: str = "float32") -> float:
    """Mean KV bytes one timed step reads: pure decode step k (k = 1 .. num_steps) feeds the
    k-th output token, so each sequence attends over its prompt and k tokens (K and V, in the
    engine's pool's dtype)."""
    mean_context = prompt_len + (num_steps + 1) / 2
    return batch * mean_context * loaded.config.kv_bytes_per_token(kv_cache_dtype)


def bench_decode_steps(formats: list[Format], settings: StepSettings, token_ids: np.ndarray, seed: int,
                       bandwidth: float) -> list[dict]:
    """The decode-step table's rows: every format at every batch size."""
    p, o = settings.prompt_len, settings.output_len
    (warm,) = make_workload(1, token_ids, (min(p, 16),) * 2, (1, 1), seed + 4)
    rows = []
    for i, batch in enumerate(settings.batch_sizes):
        prompts = [r.prompt_token_ids for r in make_workload(batch, token_ids, (p, p), (o, o), seed + 3)]
        for fmt in formats if i % 2 == 0 else formats[::-1]:
            watch = CpuWatch([])  # on a shared machine a neighbour's job can double a step: say so
            watch.start()
            steps = decode_step_times(fmt, prompts, o, warm.prompt_token_ids)
            others = watch.stop()
            weight_bytes = fmt.loaded.weights.num_bytes
            # the pool's dtype as the engine resolves auto
            kv_bytes = kv_bytes_per_step(fmt.loaded, batch, p, len(steps),
                                         auto_kv_cache_dtype_name("float32", fmt.quantization, "cpu"))
            step = float(np.mean(steps))
            floor = (weight_bytes + kv_bytes) / bandwidth
            rows.append({"format": fmt.name, "quantization": fmt.quantization, "batch_size": batch,
                         "prompt_len": p, "output_len": o, "decode_steps": len(steps),
                         "step_s": step, "median_s": float(np.median(steps)),
                         "p90_s": float(np.percentile(steps, 90)), "tok_s": batch / step,
                         "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "floor_s": floor,
                         "floor_fraction": floor / step, "others_cpu": others, "step_times_s": steps})
            logger.info("decode steps, %s, batch %d: %.2f ms a step, floor %.2f ms (%.0f%%)", fmt.name, batch,
                        step * 1e3, floor * 1e3, 100 * floor / step)
    order = {fmt.name: k for k, fmt in enumerate(formats)}
    return sorted(rows, key=lambda r: (order[r["format"]], r["batch_size"]))
