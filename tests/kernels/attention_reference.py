"""Independent oracles for the attention kernels: float64 attention written from the
definition, and paged caches built with plain indexing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor) -> torch.Tensor:
    """q: [n, H, d] at q_positions; k, v: [ctx, KVH, d] at positions 0..ctx-1. float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) / math.sqrt(q.shape[-1])
    visible = torch.arange(k.shape[0])[None, :] <= q_positions.cpu()[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


@dataclass
class PagedCache:
    k_cache: torch.Tensor
    """[num_blocks, block_size, num_kv_heads, head_dim], garbage outside the sequences' tokens."""
    v_cache: torch.Tensor
    tables: list[list[int]]
    """Each sequence's block ids, in shuffled order."""

    def block_tables(self) -> torch.Tensor:
        """[num_seqs, longest] int64, padded with block 0."""
        width = max((len(t) for t in self.tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int64, device=self.k_cache.device).view(len(rows), width)

    def slots(self, seq: int, positions: range) -> torch.Tensor:
        bs = self.k_cache.shape[1]
        table = self.tables[seq]
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.int64,
                            device=self.k_cache.device)


def paged(ks: list[torch.Tensor], vs: list[torch.Tensor], num_blocks: int, block_size: int,
          gen: torch.Generator, device: str = "cpu") -> PagedCache:
    """Put each sequence's K and V (plain indexing, no kernel) into blocks drawn at random."""
    num_kv_heads, head_dim = ks[0].shape[1:]
    dtype = ks[0].dtype
    # Large garbage everywhere else: reading a slot outside a sequence's own tokens shows.
    k_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100).to(dtype)
    v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in zip(ks, vs):
        table = [free.pop() for _ in range(-(-k.shape[0] // block_size))]
        for p in range(k.shape[0]):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        tables.append(table)
    return PagedCache(k_cache.to(device), v_cache.to(device), tables)


def tolerance(dtype: torch.dtype) -> dict:
    """The usual bound of each dtype against a float64 result."""
    return {torch.float32: dict(rtol=1e-3, atol=1e-4),
            torch.float16: dict(rtol=1e-2, atol=2e-3),
            torch.bfloat16: dict(rtol=4e-2, atol=2e-2)}[dtype]
