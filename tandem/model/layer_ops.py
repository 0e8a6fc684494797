"""A layer's operations around its projections and attention: RMSNorm, the residual add with
the next norm, RoPE with the KV store. Each runs the compiled CPU kernels
(tandem.kernels.layer_ops_cpu) when given them (`kernels`: a float32 CPU model's, chosen once
as it is built), and torch otherwise: the torch paths here are the reference (transformers'
arithmetic), and the GPU's path.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from tandem.kernels import layer_ops_cpu, ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.layer_ops_cpu import kernels_for


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H] -> [..., H], statistics in float32 (transformers' LlamaRMSNorm)."""
    if x.dtype == weight.dtype == torch.float32:
        kernels = kernels_for(x, weight)
        if kernels is not None:
            return layer_ops_cpu.rms_norm(kernels, x, weight, eps)
        return F.rms_norm(x, x.shape[-1:], weight, eps)  # torch's fused norm: the same values
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 kernels: ModuleType | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm. h, delta: [T, H] -> (h + delta, rms_norm of it);
    the kernel adds into ``h`` in place (a step's own residual stream)."""
    if kernels is not None and h.is_contiguous():
        return h, layer_ops_cpu.add_rms_norm(kernels, h, delta, weight, eps)
    h = h + delta
    return h, rms_norm(h, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_and_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
                      kernels: ModuleType | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on the query and key heads of a QKV projection, and the keys and values into their
    cache slots (meta.slot_mapping).

    qkv: [T, (num_heads + 2 * num_kv_heads) * D]; cos, sin: [T, D] (each token's position's)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, D], qkv's dtype or the KV cache's
    own (k and v are rounded to it as they are stored; the returned k, v are not)
    -> q: [T, num_heads, D]; k, v: [T, num_kv_heads, D] (rotated q and k)
    """
    # The compiled kernel stores into a float32 or a bfloat16 cache (rounded as torch's store is).
    if kernels is not None and qkv.stride(-1) == 1 and k_cache.dtype in (torch.float32, torch.bfloat16):
        return layer_ops_cpu.rope_store_kv(kernels, qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, num_heads,
                                           num_kv_heads)
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    # qk: [T, num_heads + num_kv_heads, D]: RoPE on q and k at once (the same arithmetic per
    # element as on each: half the operations)
    qk = qk.view(num_tokens, num_heads + num_kv_heads, head_dim)
    qk = qk * cos.unsqueeze(1) + rotate_half(qk) * sin.unsqueeze(1)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    ops.store_kv(k, v, k_cache, v_cache, meta)
    return q, k, v
