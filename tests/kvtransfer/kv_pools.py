"""Pools of random KV and a check that a transfer moved exactly the right bytes."""

from __future__ import annotations

import random

import torch

from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender


def random_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def token_rows(pool: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """-> [layers, 2, num_tokens, heads, dim]: a request's KV read with plain indexing."""
    block_size = pool.shape[3]
    return torch.stack([pool[:, :, block_ids[t // block_size], t % block_size] for t in range(num_tokens)], dim=2)


def pick_blocks(rng: random.Random, free: list[int], num_tokens: int, block_size: int) -> list[int]:
    """Take the blocks for num_tokens tokens from `free`, in random order."""
    n = -(-num_tokens // block_size)
    rng.shuffle(free)
    taken, free[:] = free[:n], free[n:]
    return taken


def pair(src: torch.Tensor, dst: torch.Tensor, timeout_s: float = 10.0) -> tuple[KVSender, KVReceiver]:
    receiver = KVReceiver(dst, timeout_s=timeout_s)
    return KVSender(src, timeout_s=timeout_s), receiver
