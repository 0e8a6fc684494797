"""Triton kernel: weight-only int8 matrix product for decode-sized batches (GEMV / skinny GEMM).

The torch reference is `int8_gemv_torch` in int8_gemv.py.

``out[m, n] = scale[n] * sum_k x[m, k] * qweight[n, k]``: the int8 weight is read as it is
(never a float copy in memory), converted in registers, multiplied in float32 (or exactly
in float16/bfloat16 on the tensor cores, see below) and accumulated in float32; the
per-output-channel scale multiplies the accumulated sum once.

Why these shapes (chosen, not autotuned). No GPU was available, so nothing here is timed;
each configuration the host code can pick was compiled ahead of time for sm_90 (H100)
with Triton 3.9 to check registers, spills and load widths (numbers below are from that):
- A decode step multiplies a few rows of activations by every weight once: each weight
  byte feeds 2*M flops, so for small M the product is bound by reading the weight. The
  kernel's job is to keep enough weight bytes in flight to saturate HBM (H100: about
  3.35 TB/s x ~600 ns ~ 2 MB in flight, ~16 KB per SM) with few instructions per byte.
- The weight is [N, K] row-major, so a tile is BLOCK_N rows x BLOCK_K contiguous bytes:
  BLOCK_K = 128 int8 is one 128-byte line per row, loaded as 16-byte vectors; a [64, 128]
  tile is 8 KB per program per step.
- M <= 4 (the common decode case): FMA path. Each activation row (a static loop) is
  multiplied with the weight tile in the tile's own register layout and reduced over K
  every step. (A 3-D [M, N, K] product, the obvious way to write it, made Triton move
  the whole tile through shared memory every step.) 64 registers per thread for one row
  (room for 8 programs, 64 KB of loads in flight, per SM), 93-96 for 2-4 rows; BLOCK_N is halved
  for 3-4 rows to stay there.
- M > 4: tensor-core path. ``tl.dot(w, x.T)`` with the weight rows in the MMA's M slot
  and the activation rows in its N slot (the "swap AB" of skinny GEMMs): Hopper's wgmma
  needs 64 rows in M but takes as few as 16 in N, so BLOCK_M = 16 pads 5..16 rows only to
  16 (compiled: wgmma m64n16k16, loads pipelined through shared memory over 3 stages).
  int8 values are exact in float16/bfloat16, so for those activations every product is
  exact; float32 activations use input_precision="tf32x3" (about float32 accuracy from
  three tf32 passes) rather than "ieee", which Triton lowers to FMAs that spilled
  thousands of bytes per thread here. Larger M takes BLOCK_M up to 64 (16 for float32),
  and more M tiles after that, each re-reading the weight: correct for any M, but a
  prefill-sized product wants a real GEMM (or dequantize + cuBLAS).
- Split-K: a [4096 x 4096] layer has only 64 tiles of 64 rows, fewer than H100's 132
  SMs. Each program takes one K range of a tile so that about 4 programs per SM run; the
  partial sums land in a [split_k, M, N] float32 buffer that is summed afterwards (in a
  fixed order, so results are deterministic, unlike atomics). No split below 512 columns
  per program: the partial buffer and the program start would outweigh a short K loop.
- K not a multiple of BLOCK_K: masked loads (EVEN_K drops the K masks when they are not
  needed, so that every mask is constant along K and the loads stay vectorized); N and M
  edges: masked rows/columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FMA_MAX_M = 4
"""Up to this many rows the FMA path runs; above it, tl.dot with activation rows padded to 16."""
FMA_BLOCK_N = 64
"""Weight rows per program in the FMA path for 1-2 rows of activations (half that for 3-4)."""
INT8_BLOCK_K = 128
"""int8 weight columns per step: one 128-byte line of each weight row."""
DOT_BLOCK_N = 64
DOT_MAX_BLOCK_M = 64
NUM_WARPS = 4
NUM_STAGES = 3  # the tl.dot path's loads are pipelined through shared memory, 3 tiles deep
PROGRAMS_PER_SM = 4
MIN_K_PER_SPLIT = 512
"""Fewest weight columns per split-K program (below it, splitting costs more than it gains)."""

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True)
class GemvConfig:
    """Tile shape for M rows: see the module docstring for the reasoning."""

    block_m: int
    block_n: int
    use_dot: bool


def gemv_config(m: int, dtype: torch.dtype) -> GemvConfig:
    """The tile for M rows of `dtype` activations (see the module docstring)."""
    if m <= FMA_MAX_M:
        block_m = triton.next_power_of_2(max(m, 1))
        return GemvConfig(block_m, FMA_BLOCK_N if block_m <= 2 else FMA_BLOCK_N // 2, use_dot=False)
    # float32 operands (tf32x3: split into two tf32 halves) spill registers above 16 rows.
    max_block_m = DOT_MAX_BLOCK_M if dtype != torch.float32 else 16
    return GemvConfig(min(max_block_m, max(16, triton.next_power_of_2(m))), DOT_BLOCK_N, use_dot=True)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_split_k(num_tiles: int, k: int, device: torch.device) -> int:
    """Splits of K so that about PROGRAMS_PER_SM programs run per SM (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = triton.cdiv(PROGRAMS_PER_SM * _num_sms(index), max(1, num_tiles))
    return max(1, min(wanted, k // MIN_K_PER_SPLIT))


def split_k_chunks(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """-> (columns per split, a multiple of block_k; the number of non-empty splits)."""
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, split_k)), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def dot_dtype(x: torch.Tensor) -> tl.dtype:
    """The tl.dot operand type for activations like `x`."""
    # NOTE: Triton's interpreter multiplies bfloat16 tiles wrongly in tl.dot, so on CPU
    # tensors bfloat16 operands are upcast (exactly) to float32 for the dot.
    if x.dtype == torch.bfloat16 and not x.is_cuda:
        return tl.float32
    return TL_DTYPES[x.dtype]


@triton.jit
def _int8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_os, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # int64 row offsets: an LM head's N * K can pass 2**31.
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]

    # acc: [BLOCK_N, BLOCK_M], output-major so that the FMA path's per-row sums
    # ([BLOCK_N], reduced along the weight tile's K) drop in without a layout change.
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        # Without K masks (EVEN_K) every mask is constant along K: the loads stay vectorized.
        if EVEN_K:
            w_mask = col_mask[:, None]
            x_mask = row_mask[:, None]
        else:
            k_mask = ks < k_end
            w_mask = col_mask[:, None] & k_mask[None, :]
            x_mask = row_mask[:, None] & k_mask[None, :]
        # w: [BLOCK_N, BLOCK_K] int8
        w = tl.load(w_rows + ks[None, :] * stride_wk, mask=w_mask, other=0)
        if USE_DOT:
            # x: [BLOCK_M, BLOCK_K]
            x = tl.load(x_rows + ks[None, :] * stride_xk, mask=x_mask, other=0.0)
            # int8 -> float16/bfloat16 is exact; tf32x3 keeps float32 operands at about
            # float32 accuracy on the tensor cores (see the module docstring).
            acc = tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc, input_precision="tf32x3")
        else:
            wf = w.to(tl.float32)
            # One activation row at a time against the same weight tile: 2-D products in
            # the weight tile's own layout (a 3-D [M, N, K] product would move the tile
            # through shared memory every step).
            for r in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + r
                # A splat, constant along K. NOTE: built from a tensor because Triton's
                # interpreter turns (bool tensor & bool scalar) into int32, not a mask.
                x_r_mask = tl.full([BLOCK_K], 1, tl.int1) & (row < M)
                if not EVEN_K:
                    x_r_mask = x_r_mask & k_mask
                # x_r: [BLOCK_K]
                x_r = tl.load(x_ptr + row.to(tl.int64) * stride_xm + ks * stride_xk, mask=x_r_mask, other=0.0)
                part = tl.sum(wf * x_r.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
                acc = tl.where(tl.arange(0, BLOCK_M)[None, :] == r, acc + part[:, None], acc)

    # The scale belongs to the output channel, so it multiplies the sum (and each split's
    # partial sum: the splits then add up to the scaled total).
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    result = acc * scale[:, None]  # [BLOCK_N, BLOCK_M]
    out_ptrs = out_ptr + split * stride_os + rows.to(tl.int64)[None, :] * stride_om + cols[:, None] * stride_on
    tl.store(out_ptrs, result, mask=col_mask[:, None] & row_mask[None, :])


def int8_gemv_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] float16/bfloat16/float32 (any strides)
    qweight: [N, K] int8; scale: [N] float (``w = qweight * scale[:, None]``)
    split_k: K splits (chosen from the device when None; 1 off CUDA)
    returns (or fills `out`): [M, N] float32 ``x @ w.T``
    """
    if x.dim() != 2 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1]:
        raise ValueError(f"int8 gemv: x {tuple(x.shape)} and qweight {tuple(qweight.shape)} do not match")
    if qweight.dtype != torch.int8:
        raise TypeError(f"int8 gemv: qweight must be int8, got {qweight.dtype}")
    if x.dtype not in TL_DTYPES:
        raise TypeError(f"int8 gemv: x must be float16, bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    n = qweight.shape[0]
    if scale.shape != (n,):
        raise ValueError(f"int8 gemv: scale {tuple(scale.shape)} must be [{n}]")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.float32:
        raise ValueError(f"int8 gemv: out {tuple(out.shape)} {out.dtype} must be [{m}, {n}] float32")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()

    cfg = gemv_config(m, x.dtype)
    num_tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    if split_k is None:
        split_k = choose_split_k(num_tiles, k, x.device)
    k_per_split, split_k = split_k_chunks(k, INT8_BLOCK_K, split_k)
    # partial: [split_k, M, N] when split, else the output itself
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _int8_gemv_kernel[(triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.block_m))](
        x, qweight, scale, partial,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1),
        qweight.stride(0), qweight.stride(1),
        partial.stride(0) if split_k > 1 else 0, partial.stride(-2), partial.stride(-1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=INT8_BLOCK_K,
        USE_DOT=cfg.use_dot, DOT_DTYPE=dot_dtype(x), EVEN_K=k % INT8_BLOCK_K == 0,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if split_k > 1:
        torch.sum(partial, dim=0, out=out)
    return out
