"""Triton kernel: weight-only int4 (grouped scale + offset) matrix product for decode.

The torch reference is `int4_gemv_torch` in int4_gemv.py.

``out[m, n] = sum_k x[m, k] * (q[n, k] * scale[n, k // G] + offset[n, k // G])`` with ``q``
in 0..15, two per byte: column ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the
high one (tandem.model.int4.Int4Weight's layout, GGUF Q4_1's and GPTQ/AWQ's values).

The packed bytes are read as they are; each tile is unpacked and dequantized in registers
(``q * s + o`` in float32, one FMA per value) and never written back. The low and high
nibbles of a byte tile are the even and odd columns, so they are multiplied with x's even
and odd columns rather than interleaved back into order.

Tiles follow int8_gemv_triton.py (see its docstring: the FMA path for M <= 4, the
"swap AB" tl.dot path above, split-K, EVEN_K), with these differences:
- A step covers INT4_BLOCK_K = 128 columns, 64 bytes of each weight row: at 256 columns
  the dequantized float32 tile took 168 registers per thread for one row (96 at 128).
- The weight tile is [BLOCK_N, T_GROUPS, T_INNER] bytes: T_GROUPS runs that each lie in
  one scale group (G columns, or the whole step when G is a multiple of it), so scale and
  offset are loaded once per run and broadcast. (Gathering them per element, ``k // G``,
  compiled to 128 scalar loads per thread per step.) A group size that is not a power of
  two pads its run to one (masked lanes).
- Untimed (no GPU was available); compiled ahead of time for sm_90, without spills, for
  every configuration the host picks (G = 32 and 128): 96 registers for one row, 80-128
  for 2-4, 128-229 for the tl.dot path.

Precision: the FMA path dequantizes to float32 and accumulates in float32. The tl.dot path
rounds the dequantized tile to the activations' dtype (float16 or bfloat16, as int4 GEMM
kernels such as Marlin and AWQ's do; float32 activations keep float32 and run "tf32x3"),
so there each weight carries one extra rounding of that dtype (2**-11 or 2**-8 relative),
far below int4's own quantization error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.int8_gemv_triton import (
    NUM_STAGES,
    NUM_WARPS,
    TL_DTYPES,
    choose_split_k,
    dot_dtype,
    gemv_config,
    split_k_chunks,
)

INT4_BLOCK_K = 128
"""int4 weight columns per step: 64 packed bytes of each weight row (see the module docstring)."""


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sg,
    stride_offn, stride_offg,
    stride_os, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, GROUP_COLS: tl.constexpr, T_GROUPS: tl.constexpr, T_INNER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, W_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
):
    # One step covers T_GROUPS runs of GROUP_COLS columns, each inside one scale group
    # (GROUP_COLS is G, or BLOCK_K when a group spans several steps); a run's GROUP_COLS // 2
    # bytes sit in T_INNER lanes (a power of two: lanes past the run are masked).
    STEP: tl.constexpr = T_GROUPS * GROUP_COLS
    PADDED: tl.constexpr = T_INNER != GROUP_COLS // 2
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    cols64 = cols.to(tl.int64)
    runs = tl.arange(0, T_GROUPS)
    lanes = tl.arange(0, T_INNER)

    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # output-major, as in the int8 kernel
    for c0 in range(k_start, k_end, STEP):
        first = c0 + runs * GROUP_COLS  # [T_GROUPS] first column of each run
        byte = first[:, None] // 2 + lanes[None, :]  # [T_GROUPS, T_INNER]: columns 2b (low), 2b + 1 (high)
        # run_mask: [T_GROUPS, T_INNER]; without it (EVEN_K) the masks stay constant along K.
        run_mask = tl.full([T_GROUPS, T_INNER], 1, tl.int1)
        if not EVEN_K:
            run_mask = run_mask & (first < k_end)[:, None]
        if PADDED:
            run_mask = run_mask & (lanes < GROUP_COLS // 2)[None, :]
        w_mask = col_mask[:, None, None] & run_mask[None, :, :]
        # packed: [BLOCK_N, T_GROUPS, T_INNER] uint8
        packed = tl.load(w_ptr + cols64[:, None, None] * stride_wn + byte[None, :, :] * stride_wk,
                         mask=w_mask, other=0)
        # s, o: [BLOCK_N, T_GROUPS], one scale and offset per run, loaded once per step.
        groups = first // GROUP_SIZE
        g_mask = col_mask[:, None] & (first < k_end)[None, :]
        s = tl.load(scale_ptr + cols64[:, None] * stride_sn + groups[None, :] * stride_sg, mask=g_mask, other=0.0)
        o = tl.load(offset_ptr + cols64[:, None] * stride_offn + groups[None, :] * stride_offg, mask=g_mask,
                    other=0.0)
        s = s.to(tl.float32)[:, :, None]
        o = o.to(tl.float32)[:, :, None]
        # w_even, w_odd: [BLOCK_N, T_GROUPS, T_INNER] float32, the even and odd columns
        w_even = (packed & 0x0F).to(tl.float32) * s + o
        w_odd = (packed >> 4).to(tl.float32) * s + o
        if USE_DOT:
            x_mask = row_mask[:, None, None] & run_mask[None, :, :]
            x_base = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xm + (2 * byte)[None, :, :] * stride_xk
            # x_even, x_odd: [BLOCK_M, T_GROUPS * T_INNER]; masked lanes are 0, so the
            # weight in those lanes (the offset) adds nothing.
            x_even = tl.reshape(tl.load(x_base, mask=x_mask, other=0.0), [BLOCK_M, T_GROUPS * T_INNER])
            x_odd = tl.reshape(tl.load(x_base + stride_xk, mask=x_mask, other=0.0), [BLOCK_M, T_GROUPS * T_INNER])
            # Round the dequantized tile to the activations' dtype (W_DTYPE) as int4 GEMM
            # kernels do, then to the dot operand type (float32 only in the interpreter).
            w_even = tl.reshape(w_even.to(W_DTYPE).to(DOT_DTYPE), [BLOCK_N, T_GROUPS * T_INNER])
            w_odd = tl.reshape(w_odd.to(W_DTYPE).to(DOT_DTYPE), [BLOCK_N, T_GROUPS * T_INNER])
            acc = tl.dot(w_even, tl.trans(x_even.to(DOT_DTYPE)), acc, input_precision="tf32x3")
            acc = tl.dot(w_odd, tl.trans(x_odd.to(DOT_DTYPE)), acc, input_precision="tf32x3")
        else:
            for r in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + r
                # NOTE: built from a tensor: the interpreter turns (bool tensor & bool scalar) into int32.
                x_r_mask = run_mask & (row < M)
                # x_pair: [T_GROUPS, T_INNER, 2], columns (2b, 2b + 1) side by side: one
                # contiguous (vectorized) load, split in registers.
                pair = tl.arange(0, 2)[None, None, :]
                x_pair = tl.load(x_ptr + row.to(tl.int64) * stride_xm + ((2 * byte)[:, :, None] + pair) * stride_xk,
                                 mask=x_r_mask[:, :, None] & (pair < 2), other=0.0).to(tl.float32)
                # x_even, x_odd: [T_GROUPS, T_INNER]
                x_even, x_odd = tl.split(x_pair)
                prod = w_even * x_even[None, :, :] + w_odd * x_odd[None, :, :]
                part = tl.sum(tl.sum(prod, axis=2), axis=1)  # [BLOCK_N]
                acc = tl.where(tl.arange(0, BLOCK_M)[None, :] == r, acc + part[:, None], acc)

    out_ptrs = out_ptr + split * stride_os + rows.to(tl.int64)[None, :] * stride_om + cols[:, None] * stride_on
    tl.store(out_ptrs, acc, mask=col_mask[:, None] & row_mask[None, :])


def int4_tile(group_size: int) -> tuple[int, int, int]:
    """-> (GROUP_COLS, T_GROUPS, T_INNER): how one step of INT4_BLOCK_K columns meets the groups.

    A group that is a multiple of the step gives one run of INT4_BLOCK_K columns (one scale
    per row per step); a smaller group gives INT4_BLOCK_K // G runs of G columns; a group
    that is not a power of two is padded to one (masked lanes).
    """
    if group_size % INT4_BLOCK_K == 0:
        return INT4_BLOCK_K, 1, INT4_BLOCK_K // 2
    t_inner = triton.next_power_of_2(group_size // 2)
    return group_size, max(1, (INT4_BLOCK_K // 2) // t_inner), t_inner


def int4_gemv_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] float16/bfloat16/float32 (any strides)
    qweight: [N, K // 2] uint8, low nibble first
    scale, offset: [N, K // group_size] float (``w = q * scale + offset`` per group)
    group_size: even, dividing K
    split_k: K splits (chosen from the device when None; 1 off CUDA)
    returns (or fills `out`): [M, N] float32 ``x @ w.T``
    """
    if x.dim() != 2 or qweight.dim() != 2 or 2 * qweight.shape[1] != x.shape[1]:
        raise ValueError(f"int4 gemv: x {tuple(x.shape)} and packed qweight {tuple(qweight.shape)} do not match")
    if qweight.dtype != torch.uint8:
        raise TypeError(f"int4 gemv: qweight must be uint8 (two values per byte), got {qweight.dtype}")
    if x.dtype not in TL_DTYPES:
        raise TypeError(f"int4 gemv: x must be float16, bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    n = qweight.shape[0]
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(f"int4 gemv: group size {group_size} must be even and divide K = {k}")
    groups = k // group_size
    if scale.shape != (n, groups) or offset.shape != (n, groups):
        raise ValueError(f"int4 gemv: scale {tuple(scale.shape)} and offset {tuple(offset.shape)} "
                         f"must be [{n}, {groups}]")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.float32:
        raise ValueError(f"int4 gemv: out {tuple(out.shape)} {out.dtype} must be [{m}, {n}] float32")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()

    cfg = gemv_config(m, x.dtype)
    group_cols, t_groups, t_inner = int4_tile(group_size)
    step = group_cols * t_groups
    num_tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    if split_k is None:
        # Half a byte per weight: the same bytes per split as int8 take twice the columns.
        split_k = choose_split_k(num_tiles, k // 2, x.device)
    k_per_split, split_k = split_k_chunks(k, step, split_k)
    # partial: [split_k, M, N] when split, else the output itself
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.block_m))](
        x, qweight, scale, offset, partial,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1),
        qweight.stride(0), qweight.stride(1),
        scale.stride(0), scale.stride(1),
        offset.stride(0), offset.stride(1),
        partial.stride(0) if split_k > 1 else 0, partial.stride(-2), partial.stride(-1),
        GROUP_SIZE=group_size, GROUP_COLS=group_cols, T_GROUPS=t_groups, T_INNER=t_inner,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        USE_DOT=cfg.use_dot, W_DTYPE=TL_DTYPES[x.dtype], DOT_DTYPE=dot_dtype(x), EVEN_K=k % step == 0,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if split_k > 1:
        torch.sum(partial, dim=0, out=out)
    return out
