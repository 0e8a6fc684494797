"""Causal attention for a packed batch of prompt chunks, over any prefix already cached."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_starts: tuple[int, ...],
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference version, one sequence at a time.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    (this step's keys and values, already stored in the cache too)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or the KV
    cache's own (e.g. bfloat16 under float32 queries): read back in q's dtype, attended in it
    block_tables: [num_chunks, max_num_blocks] int64
    returns: [num_tokens, num_heads, head_dim]; query token i of a chunk sits at position
    context_len - query_len + i and sees every position up to its own.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    gqa = num_kv_heads != q.shape[1]
    cache_dtype = k_cache.dtype
    out = torch.empty_like(q)
    for start, q_len, ctx_len, table in zip(query_starts, query_lens, context_lens, block_tables):
        # qs: [1, num_heads, q_len, head_dim] (4-D: CPU SDPA's fast kernel wants a batch dim)
        qs = q[start:start + q_len].transpose(0, 1)[None]
        if ctx_len == q_len:  # nothing cached before this chunk: use its own keys
            ks = k[start:start + q_len].transpose(0, 1)[None]
            vs = v[start:start + q_len].transpose(0, 1)[None]
            if cache_dtype != q.dtype:
                # Rounded as the cache holds them: a prompt's output is then the same whether
                # its chunks were computed here or read back (a cached prefix, a later chunk,
                # the decode worker's copy), as the Triton path, which reads the cache only.
                ks, vs = ks.to(cache_dtype).to(q.dtype), vs.to(cache_dtype).to(q.dtype)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            num_blocks = -(-ctx_len // block_size)
            # ks, vs: [1, num_kv_heads, ctx_len, head_dim]
            blocks = table[:num_blocks]
            ks = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx_len].transpose(0, 1)[None]
            vs = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx_len].transpose(0, 1)[None]
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)  # (no copy when the cache is in q's dtype)
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out
