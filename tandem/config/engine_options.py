"""Engine options, each defined once: the flags of ``tandem serve`` and ``tandem chat`` and the
keyword defaults of ``LLM(...)`` and :meth:`tandem.config.EngineConfig.build`.

With one definition the three entry points cannot drift apart (they did: the KV pool was
1.0 GiB in ``chat`` and ``LLM`` but 0.5 GiB in ``serve``, and ``serve`` had no swap or
preemption flags). Torch-free, like names.py beneath it: the router builds its
parser without loading torch.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tandem.config.names import (
    ACTIVATION_QUANTIZATIONS,
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    PREEMPTION_MODES,
    QUANTIZATION_CHOICES,
    check_device_name,
)

logger = logging.getLogger(__name__)

MODEL_HELP = ("local HF directory, .gguf file or Hugging Face hub id (org/name; the local hub cache first) "
              "(default: embedded SmolLM2-135M-Instruct)")
"""``--model``'s help, the same in every command that loads (or plans) a model."""


@dataclass(frozen=True)
class EngineOption:
    """One engine option: a keyword of EngineConfig.build (and LLM) and its ``--flag``."""

    name: str
    """The keyword, e.g. kv_cache_memory_gib; the flag is --kv-cache-memory-gib."""
    type: Callable[[str], Any]
    default: Any
    help: str
    """argparse help; %(default)s expands to the default."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    """More flags for it: vLLM's names where they differ (--swap-space, -tp)."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.type is bool:  # --flag / --no-flag, as vLLM spells them
            parser.add_argument(self.flag, *self.aliases, action=argparse.BooleanOptionalAction, default=self.default,
                                help=self.help)
            return
        parser.add_argument(self.flag, *self.aliases, type=self.type, default=self.default, help=self.help,
                            choices=self.choices, metavar=self.metavar)


PRIORITY_POLICY = "priority"
"""The scheduling policy under which requests' priorities count (any other takes only 0)."""
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", PRIORITY_POLICY)
"""``--scheduling-policy``'s choices, vLLM's names: the keys of the waiting-queue registry
(tandem/engine/waiting_queue.py's WAITING_QUEUES; named here, beneath the engine, so that
the router and ``tandem plan`` read them without loading torch)."""

ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("device", check_device_name, "auto",
                 "where weights, KV pool and every step's tensors live: auto (CUDA when this process sees a "
                 "GPU, else CPU), cpu, cuda or cuda:N (default %(default)s)", metavar="{auto,cpu,cuda,cuda:N}"),
    EngineOption("dtype", str, "auto",
                 "weights and activations (and the KV cache, unless --kv-cache-dtype says otherwise): auto is "
                 "bfloat16 on CUDA (float16 where the GPU lacks bfloat16), float32 on the CPU (default %(default)s)",
                 choices=DTYPE_CHOICES),
    EngineOption("kv_cache_dtype", str, "auto",
                 "the KV cache's dtype, which may differ from the activations' (--dtype): keys and values are "
                 "rounded to it as they are stored and read back in the activations' dtype; bfloat16 halves "
                 "a float32 engine's KV bytes (twice the tokens per GiB), but a request's tokens may then depend on "
                 "what shares its steps. auto: --dtype's (default %(default)s)",
                 choices=KV_CACHE_DTYPE_CHOICES),
    EngineOption("block_size", int, 16, "tokens per KV block (default %(default)s)"),
    # 1.0 GiB: what LLM(...), tandem chat, the README and the Helm chart's values assume.
    EngineOption("kv_cache_memory_gib", float, 1.0,
                 "KV pool of each engine (each worker, under tandem serve) in GiB (default %(default)s)"),
    EngineOption("gpu_memory_utilization", float, None,
                 "fraction of the GPU's memory this engine (each worker, under tandem serve) may use: the KV "
                 "pool gets what is left after the weights and the measured peak of one full-budget step; "
                 "replaces --kv-cache-memory-gib on CUDA (default: the fixed pool size)", metavar="FRACTION"),
    EngineOption("max_model_len", int, None,
                 "longest sequence, prompt + output (default: the model's context, at most what the pool holds)"),
    EngineOption("max_num_seqs", int, 64, "sequences running at once (default %(default)s)"),
    EngineOption("max_num_batched_tokens", int, 1024, "token budget of one step (default %(default)s)"),
    EngineOption("long_prefill_token_threshold", int, None,
                 "most tokens of one long prompt's chunk per step, so that short prompts behind it start in "
                 "the next step (default: half the token budget)", metavar="TOKENS"),
    EngineOption("swap_space_gib", float, 0.5,
                 "host memory that preempted sequences swap their KV into, in GiB (default %(default)s; "
                 "0: always recompute)", aliases=("--swap-space",)),
    EngineOption("preemption_mode", str, "auto",
                 "when blocks run out: swap (when the host pool has room), recompute, or auto (swap long "
                 "sequences, recompute short ones) (default %(default)s)", choices=PREEMPTION_MODES),
    EngineOption("scheduling_policy", str, "fcfs",
                 "the order requests are served in: fcfs (arrival order) or priority (each request's priority, "
                 "lower first, then arrival order; a nonzero priority is refused under fcfs) (default %(default)s)",
                 choices=SCHEDULING_POLICIES),
    EngineOption("quantization", str, "auto",
                 "weights' format: auto (the model's own: a GGUF file's Q4_1 projections kept as int4, Q8_0 "
                 "ones as int8; float checkpoints stay float), none (float weights, a GGUF file dequantized), "
                 "int8 (per output channel) or int4 (groups of 32) (default %(default)s)",
                 choices=QUANTIZATION_CHOICES),
    EngineOption("activation_quantization", str, "none",
                 "on the CPU, whether quantized weights' products keep their float32 activations (none) or "
                 "round them to 8 bits per group of 32, as llama.cpp does (int8, on CPUs with AVX-512 VNNI: "
                 "integer dot products, 1.5-2.4x faster; +1.8%% perplexity on the default model, and a "
                 "request's tokens may then depend on what shares its steps and where its prefill ran) "
                 "(default %(default)s)",
                 choices=ACTIVATION_QUANTIZATIONS),
    EngineOption("num_speculative_tokens", int, 0,
                 "draft tokens per decode step by prompt lookup (default 0: off)", metavar="K"),
    EngineOption("enable_prefix_caching", bool, True,
                 "reuse the KV blocks of prompt prefixes already computed (default: on)"),
    EngineOption("kv_offload_host_gib", float, 0.0,
                 "host memory for prefix blocks an accelerator's KV pool evicts, in GiB: copied there on the "
                 "pool's stream and loaded back instead of recomputed; what it has no room for goes on to "
                 "--kv-offload-disk-gib (default 0: none; not on the CPU, whose pool is host memory)"),
    EngineOption("kv_offload_disk_gib", float, 0.0,
                 "disk space for prefix blocks the KV pool evicts, in GiB: they are written there off the step's "
                 "path and loaded back instead of recomputed (default 0: evicted blocks are forgotten)"),
    EngineOption("kv_offload_dir", str, None,
                 "where --kv-offload-disk-gib keeps its files; workers of one model sharing it on one host reuse "
                 "each other's prefixes (default: $TANDEM_CACHE_DIR/kv-offload, else ~/.cache/tandem/kv-offload)",
                 metavar="DIR"),
    EngineOption("tensor_parallel_size", int, 1,
                 "tensor-parallel ranks of each engine, one device each (under tandem serve: every worker of "
                 "both pools, unless --prefill-tp / --decode-tp say otherwise) (default %(default)s)",
                 aliases=("-tp",), metavar="N"),
    EngineOption("enforce_eager", bool, False,
                 "run every decode step op by op: no CUDA graphs on a GPU, no compiled step on the CPU "
                 "(default: off, decode steps of each batch-size bucket replay graphs captured at start on "
                 "CUDA, and run as one compiled call on the CPU)"),
    EngineOption("seed", int, None,
                 "seed of the engine's random numbers, so that unseeded sampling repeats across restarts "
                 "(a request's own seed still wins) (default: none)"),
)

VLLM_KEYWORDS: Mapping[str, str] = MappingProxyType({"swap_space": "swap_space_gib"})
"""vLLM's keyword -> the engine option's, where they differ (LLM(...) takes either)."""
NO_EFFECT_KEYWORDS = frozenset({"disable_log_stats", "trust_remote_code"})
"""vLLM keywords accepted without effect: tandem logs no per-step stats, and loads only
architectures it implements (no remote code runs)."""

ENGINE_DEFAULTS: Mapping[str, Any] = MappingProxyType({o.name: o.default for o in ENGINE_OPTIONS})
"""Each option's default by keyword: EngineConfig.build's and LLM's defaults."""


def from_vllm_keywords(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """LLM(...)'s keywords with vLLM's names taken as the engine options' (swap_space ->
    swap_space_gib) and its no-effect ones dropped; both names of one option are refused."""
    out = {}
    for name, value in kwargs.items():
        if name in NO_EFFECT_KEYWORDS:
            logger.debug("%s=%r has no effect in tandem", name, value)
            continue
        ours = VLLM_KEYWORDS.get(name, name)
        if ours in out:
            raise ValueError(f"{name} and {ours} name the same option: give one")
        out[ours] = value
    return out


def add_engine_options(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """Every engine option as a flag (``tandem serve`` and ``tandem chat`` both call this), or
    only those in ``names`` (``tandem plan`` takes the dtype and block size)."""
    wanted = None if names is None else set(names)
    unknown = set() if wanted is None else wanted - ENGINE_DEFAULTS.keys()
    if unknown:
        raise ValueError(f"no such engine options: {', '.join(sorted(unknown))}")
    for option in ENGINE_OPTIONS:
        if wanted is None or option.name in wanted:
            option.add_to(parser)


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options parsed by add_engine_options, as EngineConfig.build's keywords."""
    return {o.name: getattr(args, o.name) for o in ENGINE_OPTIONS}


BUILD_ONLY_OPTIONS = ("num_kv_blocks", "num_swap_blocks", "enable_chunked_prefill", "long_prefill_token_threshold",
                      "prompt_lookup_max", "prompt_lookup_min", "max_cudagraph_capture_size")
"""EngineConfig.build's keywords that no flag sets (tests and benchmarks size pools in blocks);
with ENGINE_DEFAULTS' names, every keyword an EngineOptions may hold."""


@dataclass(frozen=True, eq=False)
class EngineOptions(Mapping[str, Any]):
    """Engine options by keyword (ENGINE_OPTIONS' names, BUILD_ONLY_OPTIONS), only those given: every other one is
    at its default (ENGINE_DEFAULTS), as EngineConfig.build takes it. Frozen, and a plain tuple
    inside, so it pickles (a MappingProxyType would not reach a Ray actor).

    ``EngineOptions.of({"max_num_seqs": 8})["max_num_seqs"] == 8``; an unknown keyword is refused."""

    given: tuple[tuple[str, Any], ...] = ()
    """(keyword, value) of each option given, sorted by keyword."""

    def __post_init__(self) -> None:
        names = [name for name, _ in self.given]
        unknown = sorted(set(names) - ENGINE_DEFAULTS.keys() - set(BUILD_ONLY_OPTIONS))
        if unknown:
            raise ValueError(f"no such engine options: {', '.join(unknown)}")
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"engine options given twice: {', '.join(twice)}")
        # One order, so that equal options compare (and hash) equal.
        object.__setattr__(self, "given", tuple(sorted(self.given, key=lambda item: item[0])))

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> EngineOptions:
        return cls(tuple(options.items()))

    def replace(self, **changes: Any) -> EngineOptions:
        """These options with ``changes`` (keyword -> value) given too, over any given before."""
        return EngineOptions.of({**dict(self.given), **changes})

    def __getitem__(self, name: str) -> Any:
        for key, value in self.given:
            if key == name:
                return value
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.given)

    def __len__(self) -> int:
        return len(self.given)

    def __hash__(self) -> int:  # Mapping's __eq__ (equal to a dict of the same items) wants its own hash
        return hash(self.given)
