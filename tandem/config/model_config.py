"""A model's shape, read from its config.json or GGUF file, and the KV sizing formula.

Torch-free, like the whole of tandem/config/: ``tandem plan`` and the router read a model's
shape and size a KV pool with the same code as an engine, without loading torch
(tandem/kvcache/capacity.py builds on this, not the other way round).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tandem.config.names import DTYPE_BYTES, require

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
            require(max_model_len >= 1, "max_model_len", max_model_len, ">= 1")
            limit = min(limit, max_model_len)
        if self.sliding_window is not None and self.sliding_window < limit:
            limit = self.sliding_window
        return limit

    def kv_bytes_per_token(self, dtype: str | torch.dtype, tp: int = 1) -> int:
        """K and V of one token across all layers, on one of ``tp`` tensor-parallel ranks.

        dtype: a name of DTYPE_BYTES, or a torch dtype (its itemsize)."""
        dtype_bytes = DTYPE_BYTES[dtype] if isinstance(dtype, str) else dtype.itemsize
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes, tp)
