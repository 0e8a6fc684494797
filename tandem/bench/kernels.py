"""Attention kernels against torch's scaled_dot_product_attention (and FlashAttention if
installed) on Llama-8B-like heads: time, achieved memory bandwidth as a fraction of the
device's measured copy bandwidth, and the ratio to SDPA, side by side in one run. Also the
weight-only int8/int4 decode GEMVs against a dense F.linear on the same weight shape.

On a GPU the kernels under test are the Triton ones; on a CPU what the dispatch picks there
(the compiled decode kernel, torch for the rest), so the command always works. On a CPU it
also runs tandem.bench.cpu_decode: the torch reference vs the compiled decode kernel on the
default model's heads. Also: python -m tandem.bench.kernels
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tandem.bench.bandwidth import measure_copy_bandwidth
from tandem.bench.cpu_decode import BATCH_SIZES, CONTEXT_LENS, run_cpu_decode
from tandem.bench.kernels_report import print_report, write_plot
from tandem.kernels import ops
from tandem.kernels.paged_decode_attention import paged_decode_attention_torch
from tandem.kernels.paged_decode_attention_cpu import paged_decode_attention_cpu
from tandem.kernels.prefill_attention import prefill_attention_torch
from tandem.kernels.store_kv import store_kv_torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shapes:
    """Llama-3-8B's attention: 32 query heads, 8 KV heads, head dim 128."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                        help="default: float16 on cuda, float32 on cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="decode batch sizes (default: 1 8 64 128 256 on cuda, 1 8 32 on cpu)")
    parser.add_argument("--context-lens", type=int, nargs="+", default=None,
                        help="decode context lengths "
                             "(default: 128 1024 4096 16384 32768 on cuda, 128 1024 4096 on cpu)")
    parser.add_argument("--max-kv-tokens", type=int, default=None,
                        help="skip decode shapes with more cached tokens (default: 4M on cuda, 64k on cpu)")
    parser.add_argument("--out-dir", default="bench-results/kernels", help="where results.json and the PNG go")


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """-> a function giving the median seconds of a call (after warm-up)."""
    if device.type == "cuda":
        import triton.testing
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100) / 1e3

    def median_s(fn: Callable[[], object]) -> float:
        fn()
        times: list[float] = []
        deadline = time.perf_counter() + 1.0
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return median_s


def flash_attn_decode() -> Callable | None:
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def bench_decode(s: Shapes, batch: int, ctx: int, dtype: torch.dtype, device: torch.device, timed,
                 copy_bw: float) -> dict:
    num_blocks_per_seq = -(-ctx // s.block_size)
    num_blocks = batch * num_blocks_per_seq
    k_cache = torch.randn(num_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    # Shuffled block tables: paging as the engine leaves it, not one contiguous run.
    tables = torch.randperm(num_blocks, device=device).view(batch, num_blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int64, device=device)
    q = torch.randn(batch, s.num_heads, s.head_dim, dtype=dtype, device=device)
    scale = s.head_dim ** -0.5
    if ops.backend_for(q) is ops.Backend.TRITON:
        from tandem.kernels.paged_decode_attention_triton import paged_decode_attention_triton

        def ours():
            return paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale, ctx)
    elif ops.decode_attention_backend(q) is ops.Backend.CPU_KERNEL:
        def ours():
            return paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    else:
        def ours():
            return paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, scale)
    # SDPA's best case: each sequence's K and V contiguous, no paging. [batch, kv_heads, ctx, head_dim]
    k = torch.randn(batch, s.num_kv_heads, ctx, s.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)

    def sdpa():
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    kv_bytes = 2 * batch * ctx * s.num_kv_heads * s.head_dim * k.element_size()
    row = {"batch": batch, "context_len": ctx, "kv_bytes": kv_bytes}
    row.update(timings({"tandem": ours, "sdpa": sdpa, **flash_decode(q, k, v, lens, scale)}, timed, kv_bytes, copy_bw))
    return row


def flash_decode(q, k, v, lens, scale) -> dict:
    fa = flash_attn_decode()
    if fa is None or not q.is_cuda:
        return {}
    k_fa, v_fa = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [batch, ctx, kv_heads, d]
    seqlens = lens.to(torch.int32)
    return {"flash_attn": lambda: fa(q.unsqueeze(1), k_fa, v_fa, cache_seqlens=seqlens, softmax_scale=scale)}


def timings(fns: dict, timed, num_bytes: int, copy_bw: float) -> dict:
    row = {}
    for name, fn in fns.items():
        t = timed(fn)
        row[f"{name}_s"] = t
        row[f"{name}_bw_fraction"] = num_bytes / t / copy_bw
    row["speedup_vs_sdpa"] = row["sdpa_s"] / row["tandem_s"]
    return row


def bench_prefill(s: Shapes, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, timed) -> dict:
    num_blocks_per_seq = -(-seq_len // s.block_size)
    num_blocks = batch * num_blocks_per_seq
    k_cache = torch.randn(num_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, num_blocks_per_seq)
    q = torch.randn(batch * seq_len, s.num_heads, s.head_dim, dtype=dtype, device=device)
    k = torch.randn(batch * seq_len, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    scale = s.head_dim ** -0.5
    starts = tuple(i * seq_len for i in range(batch))
    if ops.backend_for(q) is ops.Backend.TRITON:
        from tandem.kernels.prefill_attention_triton import prefill_attention_triton
        layout = torch.tensor([(st, seq_len, seq_len) for st in starts], dtype=torch.int64, device=device)

        def ours():
            return prefill_attention_triton(q, k_cache, v_cache, tables, layout, seq_len, scale)
    else:
        lens = (seq_len,) * batch

        def ours():
            return prefill_attention_torch(q, k, v, k_cache, v_cache, starts, lens, lens, tables, scale)
    # [batch, heads, seq_len, head_dim]
    qb = q.view(batch, seq_len, s.num_heads, s.head_dim).transpose(1, 2)
    kb = k.view(batch, seq_len, s.num_kv_heads, s.head_dim).transpose(1, 2)
    vb = v.view(batch, seq_len, s.num_kv_heads, s.head_dim).transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)

    flops = 2 * 2 * batch * s.num_heads * s.head_dim * seq_len * (seq_len + 1) / 2  # causal QK^T and PV
    row: dict[str, float] = {"batch": batch, "seq_len": seq_len}
    for name, fn in {"tandem": ours, "sdpa": sdpa}.items():
        t = timed(fn)
        row[f"{name}_s"] = t
        row[f"{name}_tflops"] = flops / t / 1e12
    row["speedup_vs_sdpa"] = row["sdpa_s"] / row["tandem_s"]
    return row


def bench_store_kv(s: Shapes, num_tokens: int, dtype: torch.dtype, device: torch.device, timed, copy_bw: float) -> dict:
    num_blocks = -(-num_tokens // s.block_size) * 2
    k_cache = torch.zeros(num_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(num_tokens, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * s.block_size, device=device)[:num_tokens]
    if ops.backend_for(k) is ops.Backend.TRITON:
        from tandem.kernels.store_kv_triton import store_kv_triton

        def ours():
            return store_kv_triton(k, v, k_cache, v_cache, slots)
    else:
        def ours():
            return store_kv_torch(k, v, k_cache, v_cache, slots)
    moved = 2 * 2 * k.numel() * k.element_size()  # K and V, read and written
    t = timed(ours)
    return {"num_tokens": num_tokens, "tandem_s": t, "tandem_bw_fraction": moved / t / copy_bw}


# Llama-3-8B's decode projections (qkv, o, gate_up, down) as [N, K]; SmolLM2-135M's qkv on CPU.
GEMV_SHAPES_GPU = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
GEMV_SHAPES_CPU = ((960, 576),)
GEMV_GROUP_SIZE = 32


def bench_gemv(kind: str, rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, timed,
               copy_bw: float) -> dict:
    """One weight-only product (kind "int8" or "int4") on random values (the time does not depend on them)."""
    x = torch.randn(rows, k, dtype=dtype, device=device)
    dense = torch.randn(n, k, dtype=dtype, device=device)
    if kind == "int8":
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
        scale = torch.rand(n, device=device)

        def ours():
            return ops.int8_gemv(x, qweight, scale)
        weight_bytes = qweight.numel() + scale.numel() * scale.element_size()
    else:
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        scale = torch.rand(n, k // GEMV_GROUP_SIZE, device=device).half()
        offset = -8 * scale

        def ours():
            return ops.int4_gemv(x, qweight, scale, offset, GEMV_GROUP_SIZE)
        weight_bytes = qweight.numel() + 2 * scale.numel() * scale.element_size()
    dense_bytes = dense.numel() * dense.element_size()
    row: dict[str, Any] = {"kind": kind, "rows": rows, "n": n, "k": k, "weight_bytes": weight_bytes}
    for name, fn, num_bytes in (("tandem", ours, weight_bytes), ("dense", lambda: F.linear(x, dense), dense_bytes)):
        t = timed(fn)
        row[f"{name}_s"] = t
        row[f"{name}_bw_fraction"] = num_bytes / t / copy_bw
    row["speedup_vs_dense"] = row["dense_s"] / row["tandem_s"]
    return row


def defaults(args: argparse.Namespace, on_cuda: bool) -> argparse.Namespace:
    def pick(value, gpu, cpu):
        return value if value is not None else (gpu if on_cuda else cpu)

    return argparse.Namespace(
        dtype=getattr(torch, pick(args.dtype, "float16", "float32")),
        batch_sizes=pick(args.batch_sizes, [1, 8, 64, 128, 256], [1, 8, 32]),
        context_lens=pick(args.context_lens, [128, 1024, 4096, 16384, 32768], [128, 1024, 4096]),
        max_kv_tokens=pick(args.max_kv_tokens, 4 * 2**20, 64 * 2**10),
        prefill=pick(None, [(1, 512), (1, 4096), (8, 1024), (16, 2048)], [(1, 128), (1, 1024), (4, 512)]),
        store_kv_tokens=pick(None, [256, 4096, 32768], [256, 4096]),
        gemv=[(kind, m, n, k) for kind in ("int8", "int4") for m in pick(None, [1, 4, 16], [1])
              for n, k in pick(None, GEMV_SHAPES_GPU, GEMV_SHAPES_CPU)],
    )


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = defaults(args, device.type == "cuda")
    s = Shapes()
    timed = timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    probe = torch.empty(0, device=device)
    logger.info("bench kernels on %s (%s backend), %s", name, ops.backend_for(probe).value, cfg.dtype)
    bw = measure_copy_bandwidth(1024, 10, str(device))
    decode_shapes = [(b, c) for b in cfg.batch_sizes for c in cfg.context_lens if b * c <= cfg.max_kv_tokens]
    with torch.inference_mode():
        decode = [bench_decode(s, b, c, cfg.dtype, device, timed, bw.bytes_per_s)
                  for b, c in tqdm(decode_shapes, desc="decode attention")]
        prefill = [bench_prefill(s, b, n, cfg.dtype, device, timed)
                   for b, n in tqdm(cfg.prefill, desc="prefill attention")]
        store = [bench_store_kv(s, n, cfg.dtype, device, timed, bw.bytes_per_s)
                 for n in tqdm(cfg.store_kv_tokens, desc="store_kv")]
        gemv = [bench_gemv(kind, m, n, k, cfg.dtype, device, timed, bw.bytes_per_s)
                for kind, m, n, k in tqdm(cfg.gemv, desc="int8/int4 gemv")]
    # The compiled CPU decode kernel against the torch reference, at the default model's heads
    # (batch 1 and 8, contexts 256 to 4096, unless the shapes are given).
    cpu_decode = (run_cpu_decode(cfg.dtype, timed, bw.bytes_per_s, args.batch_sizes or BATCH_SIZES,
                                 args.context_lens or CONTEXT_LENS)
                  if device.type == "cpu" and cfg.dtype in (torch.float32, torch.bfloat16) else [])
    decode_backend = ops.decode_attention_backend(probe.to(cfg.dtype)).value
    results = {"device": name, "backend": ops.backend_for(probe).value, "decode_backend": decode_backend,
               "dtype": str(cfg.dtype).removeprefix("torch."),
               "shapes": s.__dict__, "copy_bandwidth": bw.as_dict(), "decode": decode, "prefill": prefill,
               "store_kv": store, "gemv": gemv, "cpu_decode": cpu_decode}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    print_report(results)
    plot = write_plot(results, out_dir)
    print(f"\nwrote {out_dir / 'results.json'}, {plot}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    raise SystemExit(run(parser.parse_args()))
