"""Configuration, frozen once built: every derived value is worked out before construction.

Torch-free, and beneath everything else in tandem: it imports only config_names.py and
engine_options.py (names, defaults). So ``tandem plan`` and the router read a model's shape
and size a KV pool with the same code as an engine, without loading torch. The KV sizing
formula lives here (tandem/kvcache/capacity.py builds on it, not the other way round).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tandem.config_names import DTYPE_BYTES, PREEMPTION_MODES, QUANTIZATION_CHOICES
from tandem.engine_options import ENGINE_DEFAULTS as DEFAULTS
from tandem.engine_options import SCHEDULING_POLICIES

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ARCHITECTURE_OF_MODEL_TYPE: Mapping[str, str] = MappingProxyType(
    {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"})
"""The architectures tandem serves, by model type (GGUF files carry a model type, no architecture)."""
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_OF_MODEL_TYPE.values())
# RoPE variants whose frequencies change with the sequence length: not supported yet.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")
# transformers' defaults where a config.json leaves a field out.
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32768, "MistralForCausalLM": 4096 * 32}
_DEFAULT_RMS_NORM_EPS = 1e-6
_MISTRAL_SLIDING_WINDOW = 4096


def gib_to_bytes(gib: float) -> int:
    """A size in GiB as whole bytes, rounded down: how every pool size is rounded."""
    return int(gib * 2**30)


def kv_heads_per_rank(num_kv_heads: int, tp: int = 1) -> int:
    """KV heads one rank holds: ceil(num_kv_heads / tp), and at least 1 (replicated)."""
    if num_kv_heads < 1 or tp < 1:
        raise ValueError(f"num_kv_heads and tp must be >= 1, got {num_kv_heads} and {tp}")
    return max(1, -(-num_kv_heads // tp))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """2 × layers × KV heads (per rank) × head dim × bytes per element: one token's K and V."""
    return 2 * num_layers * kv_heads_per_rank(num_kv_heads, tp) * head_dim * dtype_bytes


def check_architecture(architecture: str, where: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r} in {where}: tandem supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from its config (config.json's fields)."""

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any], name: str, eos_token_ids: tuple[int, ...] = (),
                         where: str | None = None) -> ModelConfig:
        """The shape from config.json's fields, with the defaults transformers applies where
        one is left out: the one parser of a model's config (a transformers config goes
        through it as its dict, ``tandem plan`` gives it config.json or GGUF metadata).

        where: what to name in errors (default: name). KeyError: a required field is missing.
        """
        where = where or name
        fallback = ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type", ""), "?")
        architecture = (cfg.get("architectures") or [fallback])[0]
        check_architecture(architecture, where)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or rope.get("type")
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {rope_type!r} in {where}")
        num_heads = cfg["num_attention_heads"]
        if architecture == "MistralForCausalLM":
            sliding_window = cfg.get("sliding_window", _MISTRAL_SLIDING_WINDOW)
        elif architecture == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding_window = None
        else:
            sliding_window = cfg.get("sliding_window")
        return cls(
            name=name,
            architecture=architecture,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in `attention_bias`.
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[architecture]),
            sliding_window=sliding_window,
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_hf_config(cls, hf_config, name: str, eos_token_ids: tuple[int, ...]) -> ModelConfig:
        """From a transformers config (a ``PretrainedConfig``): its fields as a dict."""
        return cls.from_config_dict(hf_config.to_dict(), name, eos_token_ids)

    @property
    def num_parameters(self) -> int:
        """Parameters of the weights a worker holds: embeddings, q/k/v/o (+ q/k/v biases),
        gate/up/down, two norms per layer, the final norm and an untied lm_head."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        layer = (qkv * self.hidden_size + (qkv if self.attention_bias else 0)
                 + self.hidden_size * self.num_heads * self.head_dim
                 + 3 * self.intermediate_size * self.hidden_size + 2 * self.hidden_size)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + self.hidden_size

    def context_limit(self, max_model_len: int | None = None) -> int:
        """The longest sequence before a pool's own cap: max_position_embeddings, at most
        max_model_len, at most the sliding window (below it, sliding-window attention equals
        full attention)."""
        limit = self.max_position_embeddings
        if max_model_len is not None:
            _require(max_model_len >= 1, "max_model_len", max_model_len, ">= 1")
            limit = min(limit, max_model_len)
        if self.sliding_window is not None and self.sliding_window < limit:
            limit = self.sliding_window
        return limit

    def kv_bytes_per_token(self, dtype: str | torch.dtype, tp: int = 1) -> int:
        """K and V of one token across all layers, on one of ``tp`` tensor-parallel ranks.

        dtype: a name of DTYPE_BYTES, or a torch dtype (its itemsize)."""
        dtype_bytes = DTYPE_BYTES[dtype] if isinstance(dtype, str) else dtype.itemsize
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes, tp)


@dataclass(frozen=True)
class EngineConfig:
    """What one engine (a pool worker, or the colocated engine) runs with.

    Build it with :meth:`build`, which derives the pool size and the limits.
    """

    model: ModelConfig
    device_name: str
    """Where every tensor of the engine lives: cpu, cuda or cuda:N (resolved: never auto)."""
    dtype_name: str
    """The dtype of weights and KV cache, by name (a key of DTYPE_BYTES; resolved: never auto)."""
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    """Longest sequence (prompt + output); never more than the pool holds."""
    max_num_seqs: int
    max_num_batched_tokens: int
    """Token budget of one step; without chunked prefill at least max_model_len."""
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    """Tokens a prompt being chunked takes first in a step, before waiting prompts that fit whole
    (then what they leave): see tandem/engine/prefill_policy.py. No cap without chunked prefill."""
    num_swap_blocks: int
    """Host blocks that preempted sequences may swap their KV into (0: never swap)."""
    preemption_mode: str
    """auto (swap or recompute, by the sequence's size), swap (when the host pool has room) or recompute."""
    num_speculative_tokens: int
    """Draft tokens proposed by prompt lookup per decode step, verified in one forward (0: off)."""
    prompt_lookup_max: int
    """Longest n-gram matched against the sequence's earlier tokens to find drafts."""
    prompt_lookup_min: int
    """Shortest n-gram tried before giving up on drafts for a step."""
    quantization: str | None
    """Weight-only quantization of the projections and LM head, done at start or kept from the
    file (None: the weights as loaded; int8, int4). Resolved: never auto or none."""
    tensor_parallel_size: int
    """Ranks the model is split over (each holds its heads' KV: the pool sizes are per rank)."""
    seed: int | None = None
    """The engine's random numbers start from it (unseeded requests repeat across restarts); None: unseeded."""
    scheduling_policy: str = "fcfs"
    """The order requests are served in: fcfs or priority (tandem/engine/waiting_queue.py)."""

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of dtype_name, for the engine's tensors. torch is imported here,
        by whoever asks for tensors' dtype, never by importing this module."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def device(self) -> torch.device:
        """The torch device of device_name (torch imported here, as for :attr:`dtype`)."""
        import torch

        return torch.device(self.device_name)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the weights and KV cache."""
        return DTYPE_BYTES[self.dtype_name]

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        *,
        device: str = DEFAULTS["device"],
        dtype: str = DEFAULTS["dtype"],
        block_size: int = DEFAULTS["block_size"],
        kv_cache_memory_gib: float = DEFAULTS["kv_cache_memory_gib"],
        num_kv_blocks: int | None = None,
        max_model_len: int | None = DEFAULTS["max_model_len"],
        max_num_seqs: int = DEFAULTS["max_num_seqs"],
        max_num_batched_tokens: int = DEFAULTS["max_num_batched_tokens"],
        enable_prefix_caching: bool = DEFAULTS["enable_prefix_caching"],
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int | None = None,
        swap_space_gib: float = DEFAULTS["swap_space_gib"],
        num_swap_blocks: int | None = None,
        preemption_mode: str = DEFAULTS["preemption_mode"],
        num_speculative_tokens: int = DEFAULTS["num_speculative_tokens"],
        prompt_lookup_max: int = 4,
        prompt_lookup_min: int = 2,
        quantization: str | None = DEFAULTS["quantization"],
        tensor_parallel_size: int = DEFAULTS["tensor_parallel_size"],
        seed: int | None = DEFAULTS["seed"],
        scheduling_policy: str = DEFAULTS["scheduling_policy"],
    ) -> EngineConfig:
        """The defaults of the engine options are tandem.engine_options' (the CLI flags' too).
        device and dtype may be ``auto`` (resolved here: see tandem/device.py)."""
        from tandem.device import resolve_device, resolve_dtype  # torch only where a GPU is asked about

        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        _require(block_size >= 1, "block_size", block_size, ">= 1")
        _require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, ">= 1")
        _require(max_num_batched_tokens >= 1, "max_num_batched_tokens", max_num_batched_tokens, ">= 1")
        _require(tensor_parallel_size >= 1, "tensor_parallel_size", tensor_parallel_size, ">= 1")
        tp = tensor_parallel_size
        block_bytes = block_size * model.kv_bytes_per_token(dtype, tp)
        if num_kv_blocks is None:
            _require(kv_cache_memory_gib > 0, "kv_cache_memory_gib", kv_cache_memory_gib, "> 0")
            num_kv_blocks = gib_to_bytes(kv_cache_memory_gib) // block_bytes
        _require(num_kv_blocks >= 1, "num_kv_blocks", num_kv_blocks, ">= 1 (a bigger kv_cache_memory_gib?)")
        _require(preemption_mode in PREEMPTION_MODES, "preemption_mode", preemption_mode,
                 f"one of {', '.join(PREEMPTION_MODES)}")
        if num_swap_blocks is None:
            _require(swap_space_gib >= 0, "swap_space_gib", swap_space_gib, ">= 0")
            num_swap_blocks = gib_to_bytes(swap_space_gib) // block_bytes
        _require(num_swap_blocks >= 0, "num_swap_blocks", num_swap_blocks, ">= 0")
        _require(scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", scheduling_policy,
                 f"one of {', '.join(SCHEDULING_POLICIES)}")
        _require(num_speculative_tokens >= 0, "num_speculative_tokens", num_speculative_tokens, ">= 0")
        _require(prompt_lookup_min >= 1, "prompt_lookup_min", prompt_lookup_min, ">= 1")
        _require(prompt_lookup_max >= prompt_lookup_min, "prompt_lookup_max", prompt_lookup_max,
                 f">= prompt_lookup_min ({prompt_lookup_min})")
        _require(quantization is None or quantization in QUANTIZATION_CHOICES, "quantization", quantization,
                 f"None or one of {', '.join(QUANTIZATION_CHOICES)}")
        # With no source to look at, auto means the weights as given (engine/setup.py looks first).
        quantization = None if quantization in ("auto", "none") else quantization
        # NOTE: swapped blocks never outnumber the device pool, so more host blocks go unused.
        num_swap_blocks = min(num_swap_blocks, num_kv_blocks)

        limit = model.context_limit(max_model_len)
        asked = model.max_position_embeddings if max_model_len is None else min(model.max_position_embeddings,
                                                                                max_model_len)
        if limit < asked:  # only the sliding window takes it below
            logger.info("max_model_len capped at the sliding window (%d)", model.sliding_window)
        limit = min(limit, num_kv_blocks * block_size)
        if not enable_chunked_prefill:
            # A whole prompt must fit in one step's budget.
            max_num_batched_tokens = max(max_num_batched_tokens, limit)
        # Default: half the budget each for the long prompt being chunked and the short ones.
        threshold = (max(1, max_num_batched_tokens // 2) if long_prefill_token_threshold is None
                     else long_prefill_token_threshold)
        _require(threshold >= 1, "long_prefill_token_threshold", threshold, ">= 1")
        return cls(
            model=model,
            device_name=device,
            dtype_name=dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=limit,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=min(threshold, max_num_batched_tokens) if enable_chunked_prefill
            else max_num_batched_tokens,
            num_swap_blocks=num_swap_blocks,
            preemption_mode=preemption_mode,
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=prompt_lookup_max,
            prompt_lookup_min=prompt_lookup_min,
            quantization=quantization,
            tensor_parallel_size=tp,
            seed=seed,
            scheduling_policy=scheduling_policy,
        )


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
