"""Write new keys and values into their slots of the paged cache."""

from __future__ import annotations

import torch


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference version.

    k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], k's dtype or another
    (the KV cache's own, e.g. bfloat16 under float32 activations): k and v are rounded to it
    slot_mapping: [num_tokens] int64
    """
    num_kv_heads, head_dim = k.shape[1:]
    # (.to: no copy when the dtypes agree; index_copy_ takes no source of another dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
