"""Attention of one new query token per sequence over its paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference version: gathers each sequence's blocks, then masked attention.

    q: [num_seqs, num_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_num_blocks] int64; context_lens: [num_seqs] int64
    returns: [num_seqs, num_heads, head_dim]
    """
    num_seqs, max_num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    max_len = max_num_blocks * block_size
    # k, v: [num_seqs, num_kv_heads, max_len, head_dim]
    k = k_cache[block_tables].view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables].view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    # mask: [num_seqs, 1, 1, max_len], True where the position holds a real token
    mask = torch.arange(max_len, device=q.device) < context_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=num_kv_heads != q.shape[1],
    )
    return out.squeeze(2)
