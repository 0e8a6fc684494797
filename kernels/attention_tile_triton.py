"""Device functions shared by the Triton attention kernels: reading a tile of keys or values
through a block table, and one step of the online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_tile(cache_ptr, block_table_ptr, tokens, token_mask, kv_head, dims, dim_mask,
                    block_size, stride_block, stride_slot, stride_head, UPCAST: tl.constexpr):
    """The rows of `tokens` (positions in one sequence) of a [blocks, block_size, heads, dim]
    cache, for one KV head. -> [len(tokens), len(dims)], zero where masked."""
    blocks = tl.load(block_table_ptr + tokens // block_size, mask=token_mask, other=0)
    slots = tokens % block_size
    tile = tl.load(cache_ptr + blocks[:, None] * stride_block + slots[:, None] * stride_slot
                   + kv_head * stride_head + dims[None, :],
                   mask=token_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2):
    """Fold one tile of keys into running (max, sum, weighted values), in log2 units.

    q: [M, D]; k, v: [N, D]; visible: [M, N]; m_i, l_i: [M]; acc: [M, D] (float32)
    NOTE: each row must see at least one key in its first tile, or its max stays -inf.
    """
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc
