"""Attention of one new query token per sequence over its paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.attention_metadata import DecodeGroup

# Sequences attended together; each group gathers only up to its own longest context.
GROUP_SIZE = 8


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    groups: tuple[DecodeGroup, ...] | None = None,
) -> torch.Tensor:
    """Reference (and CPU) version: gathers each sequence's blocks, then masked attention.

    Sequences are sorted by context length and attended in groups, so that a batch of
    mixed lengths does not gather and attend over padding up to the longest one.

    q: [num_seqs, num_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or the KV
    cache's own (e.g. bfloat16 under float32 queries): read back in q's dtype, attended in it
    block_tables: [num_seqs, max_num_blocks] int64; context_lens: [num_seqs] int64
    returns: [num_seqs, num_heads, head_dim]
    """
    num_seqs = q.shape[0]
    if groups is None:
        if num_seqs <= GROUP_SIZE:
            return _attend(q, k_cache, v_cache, block_tables, context_lens, scale)
        groups = decode_groups(context_lens.tolist(), k_cache.shape[1], q.device)
    if len(groups) == 1:
        return _attend(q, k_cache, v_cache, block_tables[:, :groups[0].num_blocks], context_lens, scale)
    out = torch.empty_like(q)
    for g in groups:
        idx = g.seq_indices
        out[idx] = _attend(q[idx], k_cache, v_cache, block_tables[idx, :g.num_blocks], context_lens[idx], scale)
    return out


def decode_group_plan(context_lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """-> (sequence rows, blocks of the longest) per group: all in one group when they are at
    most GROUP_SIZE, else sorted by context length in groups of GROUP_SIZE (host ints only)."""
    n = len(context_lens)
    if n <= GROUP_SIZE:
        chunks = [list(range(n))] if n else []
    else:
        order = sorted(range(n), key=context_lens.__getitem__)
        chunks = [order[i:i + GROUP_SIZE] for i in range(0, n, GROUP_SIZE)]
    return [(rows, -(-max(context_lens[r] for r in rows) // block_size)) for rows in chunks]


def decode_groups(context_lens: list[int], block_size: int, device: torch.device) -> tuple[DecodeGroup, ...]:
    """decode_group_plan with each group's rows as a tensor on ``device``."""
    return tuple(DecodeGroup(torch.tensor(rows, dtype=torch.int64, device=device), num_blocks)
                 for rows, num_blocks in decode_group_plan(context_lens, block_size))


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    num_seqs, max_num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    max_len = max_num_blocks * block_size
    flat_table = block_tables.reshape(-1)
    # k, v: [num_seqs, num_kv_heads, max_len, head_dim] (index_select: parallel, unlike [] indexing)
    k = k_cache.index_select(0, flat_table).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat_table).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    # A cache in another dtype than q's (bfloat16 KV, float32 activations): SDPA wants one dtype,
    # and the arithmetic is q's (.to: no copy when they agree).
    k, v = k.to(q.dtype), v.to(q.dtype)
    # mask: [num_seqs, 1, 1, max_len], True where the position holds a real token
    mask = torch.arange(max_len, device=q.device) < context_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=num_kv_heads != q.shape[1],
    )
    return out.squeeze(2)
