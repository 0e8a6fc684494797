"""Weight-only int8 matrix product for decode: ``x @ (qweight * scale[:, None]).T``.

The Triton kernel is `int8_gemv_triton` in int8_gemv_triton.py; this is its torch reference.
"""

from __future__ import annotations

import torch


def int8_gemv_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference version: the plain float32 product (it materializes a float32 weight).

    x: [M, K] float16/bfloat16/float32
    qweight: [N, K] int8; scale: [N] float32 (``w = qweight * scale[:, None]``)
    returns: [M, N] float32
    """
    # Per-output-channel scales factor out of the sum: (x @ q.T) * scale == x @ (q * scale).T.
    return (x.float() @ qweight.float().t()) * scale.float()
