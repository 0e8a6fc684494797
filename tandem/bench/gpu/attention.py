"""The attention and KV-store kernels (Triton on CUDA, as ops dispatches) against torch's
scaled_dot_product_attention, on the model's own attention shapes and the timed dtype: the
measurements of ``tandem bench kernels``, at a few shapes that matter for this model."""

from __future__ import annotations

import logging

from tandem.bench.gpu.setup import GpuSetup
from tandem.bench.kernels import Shapes, bench_decode, bench_prefill, bench_store_kv, timer

logger = logging.getLogger(__name__)

DECODE_SHAPES = ((1, 1024), (1, 4096), (32, 1024), (64, 4096))
"""(batch, context length) of paged decode attention."""
PREFILL_SHAPES = ((1, 512), (1, 2048), (4, 1024))
"""(batch, prompt length) of prefill attention."""
STORE_TOKENS = (128, 4096)


def bench(setup: GpuSetup, bandwidth: float) -> list[dict]:
    """One row per kernel and shape: tandem's time, SDPA's where it has a counterpart (decode
    and prefill attention), and the fraction of the copy bandwidth where bytes bound it."""
    cfg = setup.config
    shapes = Shapes(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=16)
    timed = timer(setup.device)
    rows = []
    for batch, ctx in DECODE_SHAPES:
        r = bench_decode(shapes, batch, ctx, setup.dtype, setup.device, timed, bandwidth)
        rows.append({"kernel": "decode", "shape": f"batch {batch} x context {ctx}", "tandem_s": r["tandem_s"],
                     "sdpa_s": r["sdpa_s"], "speedup_vs_sdpa": r["speedup_vs_sdpa"],
                     "bw_fraction": r["tandem_bw_fraction"]})
    for batch, seq_len in PREFILL_SHAPES:
        r = bench_prefill(shapes, batch, seq_len, setup.dtype, setup.device, timed)
        rows.append({"kernel": "prefill", "shape": f"batch {batch} x prompt {seq_len}", "tandem_s": r["tandem_s"],
                     "sdpa_s": r["sdpa_s"], "speedup_vs_sdpa": r["speedup_vs_sdpa"], "tflops": r["tandem_tflops"]})
    for tokens in STORE_TOKENS:
        r = bench_store_kv(shapes, tokens, setup.dtype, setup.device, timed, bandwidth)
        rows.append({"kernel": "store_kv", "shape": f"{tokens} tokens", "tandem_s": r["tandem_s"],
                     "bw_fraction": r["tandem_bw_fraction"]})
    for row in rows:
        logger.info("kernel %s, %s: %.1f us%s", row["kernel"], row["shape"], row["tandem_s"] * 1e6,
                    f", {row['speedup_vs_sdpa']:.2f}x SDPA" if "speedup_vs_sdpa" in row else "")
    return rows
