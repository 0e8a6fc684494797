"""Weight-only int4 (grouped, with scale and offset) matrix product for decode.

``w[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]`` with ``q`` in 0..15 packed two
per byte (column ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one), the
layout of tandem.model.int4.Int4Weight. The Triton kernel is `int4_gemv_triton` in
int4_gemv_triton.py; this is its torch reference.
"""

from __future__ import annotations

import torch


def int4_gemv_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Reference version: dequantize to float32, then the plain float32 product.

    x: [M, K] float16/bfloat16/float32
    qweight: [N, K // 2] uint8; scale, offset: [N, K // group_size] float16
    returns: [M, N] float32
    """
    n, k_half = qweight.shape
    # q: [N, K // 2, 2] -> [N, K]; the new last axis interleaves low (even) and high (odd) columns.
    q = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).reshape(n, 2 * k_half)
    # w: [N, K] float32
    w = (q.float() * scale.float().repeat_interleave(group_size, dim=1)
         + offset.float().repeat_interleave(group_size, dim=1))
    return x.float() @ w.t()
