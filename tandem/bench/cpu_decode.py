"""CPU paged decode attention on the default model's heads (SmolLM2-135M: 9 query heads, 3 KV
heads, head dim 64, block size 16): the torch reference (gather with index_select, then
masked SDPA), the compiled kernel that reads the blocks in place, and SDPA on contiguous K/V
(no paging: the best case), side by side in one run, with each one's KV-read bandwidth as a
fraction of the copy bandwidth measured in the same run.

Each call reads one of several cache copies in turn (as many as a step's 30 layers, or enough
to pass 64 MiB), so the KV comes from memory as in a decode step, not from the last call's
cache lines. Also part of `tandem bench kernels` on the CPU; alone:
python -m tandem.bench.cpu_decode [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels.paged_decode_attention import paged_decode_attention_torch
from tandem.kernels.paged_decode_attention_cpu import load_extension, paged_decode_attention_cpu

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 8)
CONTEXT_LENS = (256, 1024, 4096)
NUM_LAYERS = 30
COLD_BYTES = 64 * 2**20


@dataclass(frozen=True)
class DefaultModelShapes:
    """SmolLM2-135M's attention."""

    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


def bench_cpu_decode(batch: int, ctx: int, dtype: torch.dtype, timed, copy_bw: float,
                     s: DefaultModelShapes = DefaultModelShapes()) -> dict:
    """One shape: seconds, bandwidth fraction and speedup of the kernel over the reference."""
    blocks_per_seq = -(-ctx // s.block_size)
    num_blocks = batch * blocks_per_seq
    kv_bytes = 2 * batch * ctx * s.num_kv_heads * s.head_dim * torch.finfo(dtype).bits // 8
    copies = max(1, min(NUM_LAYERS, -(-COLD_BYTES // kv_bytes)))
    gen = torch.Generator().manual_seed(batch * 100_000 + ctx)
    # caches: per copy (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
    caches = [tuple(torch.randn(num_blocks, s.block_size, s.num_kv_heads, s.head_dim, generator=gen).to(dtype)
                    for _ in range(2)) for _ in range(copies)]
    # contiguous: per copy (k, v), each [batch, num_kv_heads, ctx, head_dim]
    contiguous = [tuple(torch.randn(batch, s.num_kv_heads, ctx, s.head_dim, generator=gen).to(dtype)
                        for _ in range(2)) for _ in range(copies)]
    # Shuffled block tables: paging as the engine leaves it, not one contiguous run.
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    q = torch.randn(batch, s.num_heads, s.head_dim, generator=gen).to(dtype)  # [batch, num_heads, head_dim]
    scale = s.head_dim ** -0.5

    def cycling(fn):
        it = itertools.cycle(caches)
        return lambda: fn(q, *next(it), tables, lens, scale)

    it_contiguous = itertools.cycle(contiguous)

    def sdpa():
        k, v = next(it_contiguous)
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    fns = {"reference": cycling(paged_decode_attention_torch), "kernel": cycling(paged_decode_attention_cpu),
           "sdpa": sdpa}
    row: dict[str, float] = {"batch": batch, "context_len": ctx, "kv_bytes": kv_bytes, "cache_copies": copies}
    for name, fn in fns.items():
        t = timed(fn)
        row[f"{name}_s"] = t
        row[f"{name}_bw_fraction"] = kv_bytes / t / copy_bw
    row["speedup_vs_reference"] = row["reference_s"] / row["kernel_s"]
    return row


def run_cpu_decode(dtype: torch.dtype, timed, copy_bw: float, batch_sizes=BATCH_SIZES,
                   context_lens=CONTEXT_LENS) -> list[dict]:
    """Every (batch, context) shape; [] with a warning where the kernel cannot be built."""
    if load_extension() is None:
        logger.warning("CPU decode kernel unavailable: skipping its benchmark")
        return []
    with torch.inference_mode():
        return [bench_cpu_decode(b, c, dtype, timed, copy_bw) for b in batch_sizes for c in context_lens]


def print_cpu_decode(rows: list[dict], dtype: str) -> None:
    print(f"\nCPU paged decode attention, default model's heads (9/3/64), {dtype}: torch reference "
          "(gather + SDPA) vs compiled kernel; bw = KV bytes read / time / copy bandwidth")
    print(f"{'batch':>6} {'context':>8} {'ref ms':>8} {'ref bw':>7} {'kernel ms':>10} {'kernel bw':>10} "
          f"{'speedup':>8} {'sdpa ms':>8} {'sdpa bw':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context_len']:>8} {r['reference_s'] * 1e3:>8.3f} "
              f"{r['reference_bw_fraction']:>7.0%} "
              f"{r['kernel_s'] * 1e3:>10.3f} {r['kernel_bw_fraction']:>10.0%} {r['speedup_vs_reference']:>7.2f}x "
              f"{r['sdpa_s'] * 1e3:>8.3f} {r['sdpa_bw_fraction']:>8.0%}")


def main() -> int:
    from tandem.bench.bandwidth import measure_copy_bandwidth
    from tandem.bench.kernels import timer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--context-lens", type=int, nargs="+", default=list(CONTEXT_LENS))
    args = parser.parse_args()
    bw = measure_copy_bandwidth(1024, 10, "cpu")
    print(f"cpu, {torch.get_num_threads()} threads; copy bandwidth {bw.bytes_per_s / 1e9:.1f} GB/s")
    rows = run_cpu_decode(getattr(torch, args.dtype), timer(torch.device("cpu")), bw.bytes_per_s,
                          args.batch_sizes, args.context_lens)
    print_cpu_decode(rows, args.dtype)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(main())
