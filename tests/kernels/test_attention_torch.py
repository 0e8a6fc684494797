"""The CPU attention paths match a float64 computation written from the definition."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels.paged_decode_attention import paged_decode_attention_torch
from tandem.kernels.prefill_attention import prefill_attention_torch
from tandem.kernels.store_kv import store_kv_torch

BLOCK_SIZE = 4


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor) -> torch.Tensor:
    """q: [n, H, d] at q_positions; k, v: [ctx, KVH, d] at positions 0..ctx-1. float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) / math.sqrt(q.shape[-1])
    visible = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def paged(ks: list[torch.Tensor], vs: list[torch.Tensor], num_blocks: int, gen: torch.Generator):
    """Store each sequence's K and V into shuffled blocks; -> (k_cache, v_cache, block tables)."""
    num_kv_heads, head_dim = ks[0].shape[1:]
    # Garbage everywhere else: reading a slot outside a sequence's own tokens shows.
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen) * 100
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen) * 100
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in zip(ks, vs):
        table = [free.pop() for _ in range(-(-k.shape[0] // BLOCK_SIZE))]
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(k.shape[0])])
        store_kv_torch(k, v, k_cache, v_cache, slots)
        tables.append(table)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("context_lens", [[1], [3, 4, 5], [1, 7, 8, 9, 33, 2, 16, 17, 40, 12, 5]])
def test_paged_decode_attention(num_heads, num_kv_heads, context_lens):
    gen = torch.Generator().manual_seed(len(context_lens) * num_heads)
    head_dim = 16
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in context_lens]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in context_lens]
    k_cache, v_cache, tables = paged(ks, vs, 64, gen)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    out = paged_decode_attention_torch(q, k_cache, v_cache, block_tables, torch.tensor(context_lens),
                                       1 / math.sqrt(head_dim))
    for i, n in enumerate(context_lens):
        expected = naive_attention(q[i:i + 1], ks[i], vs[i], torch.tensor([n - 1]))
        torch.testing.assert_close(out[i:i + 1].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_prefill_attention_with_and_without_cached_prefix(num_heads, num_kv_heads):
    """Chunks of (query_len, context_len): fresh prompts and chunks after a cached prefix."""
    gen = torch.Generator().manual_seed(num_heads)
    head_dim = 16
    chunks = [(5, 5), (3, 11), (1, 9), (16, 16), (6, 25)]
    ks = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for _, c in chunks]
    vs = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for _, c in chunks]
    k_cache, v_cache, tables = paged(ks, vs, 64, gen)
    q_lens = [n for n, _ in chunks]
    starts = [sum(q_lens[:i]) for i in range(len(chunks))]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    k_new = torch.cat([k[c - n:] for k, (n, c) in zip(ks, chunks)])
    v_new = torch.cat([v[c - n:] for v, (n, c) in zip(vs, chunks)])
    out = prefill_attention_torch(q, k_new, v_new, k_cache, v_cache, tuple(starts), tuple(q_lens),
                                  tuple(c for _, c in chunks), tuple(torch.tensor(t) for t in tables),
                                  1 / math.sqrt(head_dim))
    for i, (n, c) in enumerate(chunks):
        expected = naive_attention(q[starts[i]:starts[i] + n], ks[i], vs[i], torch.arange(c - n, c))
        torch.testing.assert_close(out[starts[i]:starts[i] + n].double(), expected, rtol=1e-5, atol=1e-5)
