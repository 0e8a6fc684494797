"""Configuration, frozen once built: every derived value is worked out before construction."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tandem.config_names import PREEMPTION_MODES
from tandem.kvcache.capacity import kv_bytes_per_token
from tandem.model.quantization import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# RoPE variants whose frequencies change with the sequence length: not supported yet.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_architecture(architecture: str, where: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r} in {where}: tandem supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from its transformers config."""

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
    def from_hf_config(cls, hf_config, name: str, eos_token_ids: tuple[int, ...]) -> ModelConfig:
        architecture = (hf_config.architectures or ["?"])[0]
        check_architecture(architecture, name)
        rope = getattr(hf_config, "rope_parameters", None) or {}
        if rope.get("rope_type") in UNSUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {rope['rope_type']!r} in {name}")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        # Qwen2 always has q/k/v biases; Llama and Mistral say so in `attention_bias`.
        attention_bias = architecture == "Qwen2ForCausalLM" or bool(
            getattr(hf_config, "attention_bias", False)
        )
        sliding_window = getattr(hf_config, "sliding_window", None)
        if architecture == "Qwen2ForCausalLM" and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None
        return cls(
            name=name,
            architecture=architecture,
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            attention_bias=attention_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_window=sliding_window,
            eos_token_ids=eos_token_ids,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype, tp: int = 1) -> int:
        """K and V of one token across all layers, on one of ``tp`` tensor-parallel ranks."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype.itemsize, tp)


@dataclass(frozen=True)
class EngineConfig:
    """What one engine (a pool worker, or the colocated engine) runs with.

    Build it with :meth:`build`, which derives the pool size and the limits.
    """

    model: ModelConfig
    dtype: torch.dtype
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    """Longest sequence (prompt + output); never more than the pool holds."""
    max_num_seqs: int
    max_num_batched_tokens: int
    """Token budget of one step; without chunked prefill at least max_model_len."""
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    num_swap_blocks: int
    """Host blocks that preempted sequences may swap their KV into (0: never swap)."""
    preemption_mode: str
    """auto (swap or recompute, by the sequence's size), swap (when the host pool has room) or recompute."""
    num_speculative_tokens: int = 0
    """Draft tokens proposed by prompt lookup per decode step, verified in one forward (0: off)."""
    prompt_lookup_max: int = 4
    """Longest n-gram matched against the sequence's earlier tokens to find drafts."""
    prompt_lookup_min: int = 2
    """Shortest n-gram tried before giving up on drafts for a step."""
    quantization: str | None = None
    """Weight-only quantization of the projections and LM head, done at start (None: float weights; int8)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (each holds its heads' KV: the pool sizes are per rank)."""

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        *,
        dtype: str = "float32",
        block_size: int = 16,
        kv_cache_memory_gib: float = 1.0,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        swap_space_gib: float = 0.5,
        num_swap_blocks: int | None = None,
        preemption_mode: str = "auto",
        num_speculative_tokens: int = 0,
        prompt_lookup_max: int = 4,
        prompt_lookup_min: int = 2,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> EngineConfig:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        torch_dtype = DTYPES[dtype]
        _require(block_size >= 1, "block_size", block_size, ">= 1")
        _require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, ">= 1")
        _require(max_num_batched_tokens >= 1, "max_num_batched_tokens", max_num_batched_tokens, ">= 1")
        _require(tensor_parallel_size >= 1, "tensor_parallel_size", tensor_parallel_size, ">= 1")
        tp = tensor_parallel_size
        if num_kv_blocks is None:
            _require(kv_cache_memory_gib > 0, "kv_cache_memory_gib", kv_cache_memory_gib, "> 0")
            block_bytes = block_size * model.kv_bytes_per_token(torch_dtype, tp)
            num_kv_blocks = int(kv_cache_memory_gib * 2**30) // block_bytes
        _require(num_kv_blocks >= 1, "num_kv_blocks", num_kv_blocks, ">= 1 (a bigger kv_cache_memory_gib?)")
        _require(preemption_mode in PREEMPTION_MODES, "preemption_mode", preemption_mode,
                 f"one of {', '.join(PREEMPTION_MODES)}")
        if num_swap_blocks is None:
            _require(swap_space_gib >= 0, "swap_space_gib", swap_space_gib, ">= 0")
            num_swap_blocks = int(swap_space_gib * 2**30) // (block_size * model.kv_bytes_per_token(torch_dtype, tp))
        _require(num_swap_blocks >= 0, "num_swap_blocks", num_swap_blocks, ">= 0")
        _require(num_speculative_tokens >= 0, "num_speculative_tokens", num_speculative_tokens, ">= 0")
        _require(prompt_lookup_min >= 1, "prompt_lookup_min", prompt_lookup_min, ">= 1")
        _require(prompt_lookup_max >= prompt_lookup_min, "prompt_lookup_max", prompt_lookup_max,
                 f">= prompt_lookup_min ({prompt_lookup_min})")
        _require(quantization is None or quantization in QUANTIZATION_METHODS, "quantization", quantization,
                 f"None or one of {', '.join(QUANTIZATION_METHODS)}")
        # NOTE: swapped blocks never outnumber the device pool, so more host blocks go unused.
        num_swap_blocks = min(num_swap_blocks, num_kv_blocks)

        limit = model.max_position_embeddings
        if max_model_len is not None:
            _require(max_model_len >= 1, "max_model_len", max_model_len, ">= 1")
            limit = min(limit, max_model_len)
        if model.sliding_window is not None and model.sliding_window < limit:
            # NOTE: below the window, sliding-window attention equals full attention.
            logger.info("max_model_len capped at the sliding window (%d)", model.sliding_window)
            limit = model.sliding_window
        limit = min(limit, num_kv_blocks * block_size)
        if not enable_chunked_prefill:
            # A whole prompt must fit in one step's budget.
            max_num_batched_tokens = max(max_num_batched_tokens, limit)
        return cls(
            model=model,
            dtype=torch_dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=limit,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            num_swap_blocks=num_swap_blocks,
            preemption_mode=preemption_mode,
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=prompt_lookup_max,
            prompt_lookup_min=prompt_lookup_min,
            quantization=quantization,
            tensor_parallel_size=tp,
        )


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
