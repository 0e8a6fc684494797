"""Triton kernel: one query token per sequence against its paged KV cache (flash-decoding).

The torch reference is `paged_decode_attention_torch` in paged_decode_attention.py.

Each program takes one sequence, one KV head and one split of the context: the query heads
that share the KV head are packed into the rows of one tile (GQA), so every K and V tile is
read once for all of them. Long contexts are split (split-K) so that a few long sequences
still fill the device; the splits' partial results carry their log-sum-exp and are merged
by a second, tiny kernel in this file (the two halves of one algorithm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.attention_tile_triton import load_paged_tile, online_softmax_step

LOG2E = 1.4426950408889634
TILE_TOKENS = 64  # context tokens per inner step (independent of the cache's block size)
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more in merging than it gains


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, tokens_per_split, block_size,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * QUERIES_PER_KV + rows
    row_mask = rows < QUERIES_PER_KV
    dim_mask = dims < HEAD_DIM
    # q: [GROUP_PAD, HEAD_DIM_PAD], the query heads of this KV head
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    for tile_start in range(start, end, TILE):
        tokens = tile_start + tl.arange(0, TILE)
        token_mask = tokens < end
        # k, v: [TILE, HEAD_DIM_PAD]
        k = load_paged_tile(k_cache_ptr, table_ptr, tokens, token_mask, kv_head, dims, dim_mask,
                            block_size, stride_kb, stride_kt, stride_kh, UPCAST)
        v = load_paged_tile(v_cache_ptr, table_ptr, tokens, token_mask, kv_head, dims, dim_mask,
                            block_size, stride_vb, stride_vt, stride_vh, UPCAST)
        m_i, l_i, acc = online_softmax_step(q, k, v, token_mask[None, :], m_i, l_i, acc, scale_log2)

    # NOTE: a split past the end of a shorter sequence attends to nothing: l_i == 0.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        tl.store(part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pk + dims[None, :],
                 out, mask=out_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=row_mask)
    else:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    # lse: [SPLITS_PAD]; parts: [SPLITS_PAD, HEAD_DIM_PAD]
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + splits, mask=split_mask,
                  other=float("-inf"))
    # NOTE: split 0 always holds at least one token (context_len >= 1), so max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    mask = split_mask[:, None] & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + splits[:, None] * stride_pk
                    + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Enough splits that the grid covers the device twice over, none shorter than the minimum."""
    if device.type != "cuda":
        return 1
    num_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(num_programs, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_context_len // MIN_TOKENS_PER_SPLIT))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_num_blocks] int; context_lens: [num_seqs] int, each >= 1
    max_context_len: an upper bound of context_lens (host-side, so no device sync)
    num_splits: context splits per sequence (chosen from the device when None)
    returns (or fills `out`): [num_seqs, num_heads, head_dim]
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, q.device)
    tokens_per_split = triton.cdiv(triton.cdiv(max_context_len, num_splits), TILE_TOKENS) * TILE_TOKENS
    num_splits = triton.cdiv(max_context_len, tokens_per_split)
    split = num_splits > 1
    head_dim_pad = triton.next_power_of_2(head_dim)
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # unused: any tensor with the right number of strides
        part_out = out.unsqueeze(2)
        part_lse = out[..., 0]
    queries_per_kv = num_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * LOG2E, tokens_per_split, k_cache.shape[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        QUERIES_PER_KV=queries_per_kv, GROUP_PAD=max(16, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, head_dim_pad),
        TILE=TILE_TOKENS, SPLIT=split,
        # Triton's interpreter multiplies bfloat16 tiles wrongly in tl.dot: upcast there.
        UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
    )
    if split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
