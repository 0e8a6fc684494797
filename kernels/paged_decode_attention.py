"""Attention of one new query token per sequence over its paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Sequences attended together; each group gathers only up to its own longest context.
GROUP_SIZE = 8


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference (and CPU) version: gathers each sequence's blocks, then masked attention.

    Sequences are sorted by context length and attended in groups, so that a batch of
    mixed lengths does not gather and attend over padding up to the longest one.

    q: [num_seqs, num_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_num_blocks] int64; context_lens: [num_seqs] int64
    returns: [num_seqs, num_heads, head_dim]
    """
    num_seqs = q.shape[0]
    if num_seqs <= GROUP_SIZE:
        return _attend(q, k_cache, v_cache, block_tables, context_lens, scale)
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for idx in torch.argsort(context_lens).split(GROUP_SIZE):
        lens = context_lens[idx]
        num_blocks = -(-int(lens.max()) // block_size)
        out[idx] = _attend(q[idx], k_cache, v_cache, block_tables[idx, :num_blocks], lens, scale)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    num_seqs, max_num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    max_len = max_num_blocks * block_size
    flat_table = block_tables.reshape(-1)
    # k, v: [num_seqs, num_kv_heads, max_len, head_dim] (index_select: parallel, unlike [] indexing)
    k = k_cache.index_select(0, flat_table).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat_table).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    # mask: [num_seqs, 1, 1, max_len], True where the position holds a real token
    mask = torch.arange(max_len, device=q.device) < context_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=num_kv_heads != q.shape[1],
    )
    return out.squeeze(2)
