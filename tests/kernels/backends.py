"""Run each kernel through either backend, the Triton one on a poisoned output."""

from __future__ import annotations

import torch

from tandem.kernels.paged_decode_attention import paged_decode_attention_torch
from tandem.kernels.prefill_attention import prefill_attention_torch

BACKENDS = ["torch", "triton"]
# Triton runs compiled on a GPU, through its interpreter on CPU tensors otherwise.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def device_for(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: an element the kernel does not write shows."""
    return torch.full_like(q, float("nan"))


def decode_attention(backend: str, q, k_cache, v_cache, block_tables, context_lens, scale,
                     num_splits: int | None = None) -> torch.Tensor:
    if backend == "torch":
        return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)
    from tandem.kernels.paged_decode_attention_triton import paged_decode_attention_triton
    max_len = int(context_lens.max()) if len(context_lens) else 0
    return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, max_len,
                                         num_splits=num_splits, out=poisoned_like(q))


def prefill_attention(backend: str, q, k_new, v_new, k_cache, v_cache, block_tables,
                      chunks: list[tuple[int, int]], scale) -> torch.Tensor:
    """chunks: (query_len, context_len) per sequence, packed in order."""
    q_lens = [n for n, _ in chunks]
    starts = [sum(q_lens[:i]) for i in range(len(chunks))]
    if backend == "torch":
        return prefill_attention_torch(q, k_new, v_new, k_cache, v_cache, tuple(starts), tuple(q_lens),
                                       tuple(c for _, c in chunks), block_tables, scale)
    from tandem.kernels.prefill_attention_triton import prefill_attention_triton
    layout = torch.tensor([(s, n, c) for s, (n, c) in zip(starts, chunks)], dtype=torch.int64,
                          device=q.device).view(-1, 3)
    return prefill_attention_triton(q, k_cache, v_cache, block_tables, layout, max(q_lens, default=0), scale,
                                    out=poisoned_like(q))
