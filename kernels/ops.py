"""The attention operations the model calls: the one place that picks an implementation."""

from __future__ import annotations

import torch

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.paged_decode_attention import paged_decode_attention_torch
from tandem.kernels.prefill_attention import prefill_attention_torch
from tandem.kernels.store_kv import store_kv_torch


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a packed batch whose new K and V are already in the cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    returns: [num_tokens, num_heads, head_dim]
    """
    num_decode = meta.num_decode_tokens
    if meta.num_prefills == 0:
        return paged_decode_attention_torch(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = paged_decode_attention_torch(
            q[:num_decode], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    out[num_decode:] = prefill_attention_torch(
        q[num_decode:], k[num_decode:], v[num_decode:], k_cache, v_cache,
        meta.prefill_query_starts, meta.prefill_query_lens,
        meta.prefill_context_lens, meta.prefill_block_tables, scale)
    return out
