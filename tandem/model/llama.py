"""Our forward pass for Llama-family decoders (Llama, Qwen2, Mistral, SmolLM2) over a paged KV cache.

Weights are plain tensors taken from a transformers model (the projections may be int8:
see quantization.py); q/k/v and gate/up are fused so that each layer runs four matrix
products.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, overload

import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.kernels import layer_ops_cpu, ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.layer_ops_cpu import kernels_for
from tandem.model.layer_ops import add_rms_norm, rms_norm, rope_and_store_kv
from tandem.model.quantization import Weight, linear, weight_bytes, weight_key


@dataclass
class LayerWeights:
    qkv_proj: Weight  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Weight  # [hidden, num_heads * head_dim]
    gate_up_proj: Weight  # [2 * intermediate, hidden]
    down_proj: Weight  # [hidden, intermediate]
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Weight  # [vocab, hidden]; the same tensor as embed_tokens when tied (and not quantized)
    rope_inv_freq: torch.Tensor  # [head_dim // 2] float32
    rope_attention_scaling: float

    @property
    def num_bytes(self) -> int:
        """Bytes of weights one decode step reads (each distinct tensor once; int8 + scales
        for a quantized one)."""
        seen: dict[int, int] = {}
        tensors = [self.lm_head, self.norm] + [
            t for layer in self.layers for t in vars(layer).values() if t is not None
        ]
        for t in tensors:
            seen[weight_key(t)] = weight_bytes(t)
        return sum(seen.values())


class LlamaModel:
    """A Llama-family decoder whose attention reads and writes a paged KV cache.

    Under tensor parallelism it is one rank's part: ``weights`` hold ``num_heads`` query and
    ``num_kv_heads`` KV heads (and their share of the MLP), and ``all_reduce`` sums the
    ranks' partial outputs of the row-parallel o and down projections.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_model_len: int,
                 num_heads: int | None = None, num_kv_heads: int | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.config = config
        self.weights = weights
        self.num_heads = config.num_heads if num_heads is None else num_heads
        self.num_kv_heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
        self.all_reduce = all_reduce if all_reduce is not None else (lambda t: t)
        self.scale = config.head_dim ** -0.5
        self.q_size = self.num_heads * config.head_dim
        dtype = weights.embed_tokens.dtype
        # cos, sin: [max_model_len, head_dim], computed as transformers does (float32).
        positions = torch.arange(max_model_len, dtype=torch.float32, device=weights.rope_inv_freq.device)
        freqs = positions[:, None] * weights.rope_inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * weights.rope_attention_scaling).to(dtype)
        self.sin = (emb.sin() * weights.rope_attention_scaling).to(dtype)
        self.layer_kernels = kernels_for(weights.embed_tokens)
        """The compiled layer kernels for a float32 CPU model where they are built (else None:
        torch's operations), chosen once: a step calls them ~100 times."""

    @overload
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor, on_layer_stored: Callable[[int], None] | None = None) -> torch.Tensor: ...

    @overload
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                logits_indices: None, on_layer_stored: Callable[[int], None] | None = None) -> None: ...

    @overload
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None,
                on_layer_stored: Callable[[int], None] | None = None) -> torch.Tensor | None: ...

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,
        on_layer_stored: Callable[[int], None] | None = None,
    ) -> torch.Tensor | None:
        """Run one packed step and return the logits of the tokens at ``logits_indices``.

        on_layer_stored(layer) runs as soon as a layer's new K and V are in the cache, while
        the rest of the step still computes (a prefill worker sends that layer then).

        input_ids, positions: [num_tokens]
        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        logits_indices: [num_logits] -> returns [num_logits, vocab_size] float32 (None: no
        logits, for a rank other than the first)
        """
        cfg, w = self.config, self.weights
        num_tokens = input_ids.shape[0]
        eps, kernels = cfg.rms_norm_eps, self.layer_kernels
        # cos, sin: [num_tokens, head_dim], each token's position's
        cos, sin = self.cos[positions], self.sin[positions]
        # h: [num_tokens, hidden], the residual stream; x: its normalised input to the next block
        h = w.embed_tokens[input_ids]
        x = rms_norm(h, w.layers[0].input_norm, eps)
        for layer_idx, lw in enumerate(w.layers):
            k_cache, v_cache = kv_cache[layer_idx]
            # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
            q, k, v = rope_and_store_kv(linear(x, lw.qkv_proj, lw.qkv_bias), cos, sin, k_cache, v_cache, meta,
                                        self.num_heads, self.num_kv_heads, kernels)
            if on_layer_stored is not None:
                on_layer_stored(layer_idx)
            attn = ops.attention(q, k, v, k_cache, v_cache, meta, self.scale)
            h, x = add_rms_norm(h, self.all_reduce(linear(attn.reshape(num_tokens, self.q_size), lw.o_proj)),
                                lw.post_attention_norm, eps, kernels)
            mlp = self.all_reduce(linear(swiglu(linear(x, lw.gate_up_proj), kernels), lw.down_proj))
            if layer_idx + 1 < len(w.layers):
                h, x = add_rms_norm(h, mlp, w.layers[layer_idx + 1].input_norm, eps, kernels)
            else:
                h = h + mlp
        if logits_indices is None:
            return None
        # Only the rows that are sampled go through the final norm and the LM head.
        h = rms_norm(h[logits_indices], w.norm, eps)
        return linear(h, w.lm_head).float()


def swiglu(gate_up: torch.Tensor, kernels: ModuleType | None) -> torch.Tensor:
    """gate_up: [T, 2 I] (gate | up) -> silu(gate) * up: [T, I]; the layer kernel where given
    (the compiled decode step runs the same arithmetic), else torch's."""
    if kernels is not None and gate_up.stride(-1) == 1:
        return layer_ops_cpu.silu_mul(kernels, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
