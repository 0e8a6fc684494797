"""store_kv, both backends: each token lands in its slot and nothing else changes."""

from __future__ import annotations

import pytest
import torch
from backends import BACKENDS, device_for

from tandem.kernels.store_kv import store_kv_torch


def store(backend, k, v, k_cache, v_cache, slots):
    if backend == "torch":
        store_kv_torch(k, v, k_cache, v_cache, slots)
    else:
        from tandem.kernels.store_kv_triton import store_kv_triton
        store_kv_triton(k, v, k_cache, v_cache, slots)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim, block_size", [(1, 1, 64, 16), (37, 3, 96, 16),
                                                                           (20, 8, 128, 5), (0, 2, 64, 16)])
def test_tokens_land_in_their_slots(backend, dtype, num_tokens, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    device = device_for(backend)
    num_blocks = 12
    # k, v arrive as views into a fused qkv projection: rows are strided, not contiguous.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype).to(device)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:2 * num_kv_heads]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    expected_k, expected_v = k_cache.clone().cpu(), v_cache.clone().cpu()
    for t, slot in enumerate(slots.tolist()):  # plain indexing as the oracle
        expected_k[slot // block_size, slot % block_size] = k[t].cpu()
        expected_v[slot // block_size, slot % block_size] = v[t].cpu()
    store(backend, k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.cpu(), expected_k)
    assert torch.equal(v_cache.cpu(), expected_v)
