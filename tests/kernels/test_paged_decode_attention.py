"""Paged decode attention, both backends, against float64 attention from the definition."""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import naive_attention, paged, tolerance
from backends import BACKENDS, decode_attention, device_for


def check(backend: str, num_heads: int, num_kv_heads: int, context_lens: list[int], *, head_dim: int = 64,
          dtype: torch.dtype = torch.float32, block_size: int = 16, num_splits: int | None = None) -> None:
    gen = torch.Generator().manual_seed(sum(context_lens) * num_heads + head_dim)
    device = device_for(backend)
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in context_lens]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in context_lens]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 8
    cache = paged(ks, vs, num_blocks, block_size, gen, device)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
    out = decode_attention(backend, q, cache.k_cache, cache.v_cache, cache.block_tables(), lens,
                           1 / math.sqrt(head_dim), num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    for i, n in enumerate(context_lens):
        expected = naive_attention(q[i:i + 1].cpu(), ks[i], vs[i], torch.tensor([n - 1]))
        torch.testing.assert_close(out[i:i + 1].cpu().double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("context_lens", [[1], [15, 16, 17], [1, 7, 31, 32, 33, 2, 64, 65, 100, 12]],
                         ids=["one-token", "block-boundary", "mixed"])
def test_gqa_ratios_and_lengths(backend, num_heads, num_kv_heads, context_lens):
    check(backend, num_heads, num_kv_heads, context_lens)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_dtypes_and_head_dims(backend, dtype, head_dim):
    check(backend, 8, 2, [1, 17, 40], head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 5, 8, 32])
def test_cache_block_sizes(backend, block_size):
    check(backend, 6, 2, [1, block_size, block_size + 1, 3 * block_size - 1], block_size=block_size)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_merges_partial_results(num_splits):
    """Long and short contexts together: some splits of the short ones attend to nothing."""
    check("triton", 8, 2, [700, 5, 300, 1], num_splits=num_splits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    device = device_for(backend)
    q = torch.randn(0, 4, 64, device=device)
    k_cache = torch.randn(4, 16, 2, 64, device=device)
    out = decode_attention(backend, q, k_cache, k_cache.clone(), torch.zeros(0, 1, dtype=torch.int64, device=device),
                           torch.zeros(0, dtype=torch.int64, device=device), 0.125)
    assert out.shape == (0, 4, 64)
