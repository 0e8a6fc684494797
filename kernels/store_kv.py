"""Write new keys and values into their slots of the paged cache."""

from __future__ import annotations

import torch


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference version.

    k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64
    """
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
