"""Prefill attention over packed chunks and cached prefixes, both backends, against float64."""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import naive_attention, paged, tolerance
from backends import BACKENDS, device_for, prefill_attention


def check(backend: str, num_heads: int, num_kv_heads: int, chunks: list[tuple[int, int]], *, head_dim: int = 64,
          dtype: torch.dtype = torch.float32, block_size: int = 16) -> None:
    """chunks: (query_len, context_len); context_len > query_len means a cached prefix."""
    gen = torch.Generator().manual_seed(sum(c for _, c in chunks) * num_heads + head_dim)
    device = device_for(backend)
    ks = [torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype) for _, c in chunks]
    vs = [torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype) for _, c in chunks]
    num_blocks = sum(-(-c // block_size) for _, c in chunks) + 8
    cache = paged(ks, vs, num_blocks, block_size, gen, device)
    q_lens = [n for n, _ in chunks]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    k_new = torch.cat([k[c - n:] for k, (n, c) in zip(ks, chunks)]).to(device)
    v_new = torch.cat([v[c - n:] for v, (n, c) in zip(vs, chunks)]).to(device)
    out = prefill_attention(backend, q, k_new, v_new, cache.k_cache, cache.v_cache, cache.block_tables(),
                            chunks, 1 / math.sqrt(head_dim))
    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    for i, (n, c) in enumerate(chunks):
        expected = naive_attention(q[start:start + n].cpu(), ks[i], vs[i], torch.arange(c - n, c))
        torch.testing.assert_close(out[start:start + n].cpu().double(), expected, **tolerance(dtype))
        start += n


# Fresh prompts, chunks after a cached prefix, one-token prompts, lengths around the block
# size (16) and the Triton query/key tile (32).
CHUNKS = [(1, 1), (5, 5), (3, 11), (1, 9), (16, 16), (17, 17), (6, 25), (40, 40), (33, 70)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_gqa_ratios_with_and_without_cached_prefix(backend, num_heads, num_kv_heads):
    check(backend, num_heads, num_kv_heads, CHUNKS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [(1, 1), (15, 15), (16, 16), (17, 17), (31, 47), (1, 33)], ids=str)
def test_single_sequence(backend, chunk):
    check(backend, 4, 2, [chunk])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_dtypes_and_head_dims(backend, dtype, head_dim):
    check(backend, 4, 2, [(5, 5), (20, 37)], head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_cache_block_sizes(backend, block_size):
    check(backend, 4, 2, [(block_size, block_size), (2, block_size + 1), (7, 2 * block_size + 7)],
          block_size=block_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    device = device_for(backend)
    q = torch.randn(0, 4, 64, device=device)
    k_cache = torch.randn(4, 16, 2, 64, device=device)
    out = prefill_attention(backend, q, q[:, :2], q[:, :2], k_cache, k_cache.clone(),
                            torch.zeros(0, 1, dtype=torch.int64, device=device), [], 0.125)
    assert out.shape == (0, 4, 64)
