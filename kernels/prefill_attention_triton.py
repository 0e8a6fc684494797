"""Triton kernel: causal flash attention for a packed batch of prompt chunks over the paged cache.

The torch reference is `prefill_attention_torch` in prefill_attention.py.

Each program takes one tile of query tokens of one chunk and one query head, and walks the
chunk's keys and values through its block table with an online softmax, so no
[query, key] matrix is ever materialised. This step's keys and values are already in the
cache (store_kv runs first), so a cached prefix (prefix-cache hit or earlier chunk) and the
chunk itself are read the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.attention_tile_triton import load_paged_tile, online_softmax_step

LOG2E = 1.4426950408889634
TILE_QUERIES = 32
TILE_KEYS = 32


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, layout_ptr, out_ptr,
    scale_log2, block_size,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    query_start = tl.load(layout_ptr + chunk * 3)
    query_len = tl.load(layout_ptr + chunk * 3 + 1)
    context_len = tl.load(layout_ptr + chunk * 3 + 2)
    if tile * TILE_M >= query_len:
        return
    kv_head = head // QUERIES_PER_KV

    rows = tile * TILE_M + tl.arange(0, TILE_M)
    row_mask = rows < query_len
    positions = context_len - query_len + rows  # each query token's position in its sequence
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    # q: [TILE_M, HEAD_DIM_PAD]
    q = tl.load(q_ptr + (query_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([TILE_M], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, HEAD_DIM_PAD], tl.float32)
    # Keys beyond the tile's last query position are invisible to all of its rows.
    key_end = tl.minimum(context_len, context_len - query_len + (tile + 1) * TILE_M)
    table_ptr = block_tables_ptr + chunk * stride_bt
    for key_start in range(0, key_end, TILE_N):
        keys = key_start + tl.arange(0, TILE_N)
        key_mask = keys < key_end
        # k, v: [TILE_N, HEAD_DIM_PAD]
        k = load_paged_tile(k_cache_ptr, table_ptr, keys, key_mask, kv_head, dims, dim_mask,
                            block_size, stride_kb, stride_kt, stride_kh, UPCAST)
        v = load_paged_tile(v_cache_ptr, table_ptr, keys, key_mask, kv_head, dims, dim_mask,
                            block_size, stride_vb, stride_vt, stride_vh, UPCAST)
        # NOTE: key 0 is visible to every row, so no row's maximum stays -inf after tile 0.
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None])
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (query_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    layout: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], the chunks packed one after another
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], holding every chunk's
    keys and values (prefix and the chunk itself)
    block_tables: [num_chunks, max_num_blocks] int
    layout: [num_chunks, 3] int (query start, query length, context length) per chunk
    max_query_len: the longest chunk (host-side, sizes the grid without a device sync)
    returns (or fills `out`): [num_tokens, num_heads, head_dim]; query token i of a chunk sits
    at position context_len - query_len + i and sees every position up to its own.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if out is None:
        out = torch.empty_like(q)
    num_chunks = layout.shape[0]
    if num_chunks == 0 or max_query_len == 0:
        return out
    layout = layout.contiguous()
    grid = (triton.cdiv(max_query_len, TILE_QUERIES), num_chunks, num_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, layout, out,
        scale * LOG2E, k_cache.shape[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        TILE_M=TILE_QUERIES, TILE_N=TILE_KEYS,
        # Triton's interpreter multiplies bfloat16 tiles wrongly in tl.dot: upcast there.
        UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
    )
    return out
