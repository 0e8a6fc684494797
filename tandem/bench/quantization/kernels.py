"""Weight-only int8 and int4 matrix products on CPU, per number of activation rows M.

The table behind the kernel choices of quantization.py and int4_matmul.py: one
SmolLM2-135M layer's four projections (summed) and its LM head, for each way of computing
``x @ w.T``, microseconds, best of --repeats, float32 activations. Random weights (the time
does not depend on the values). Run: python -m tandem.bench.quantization.kernels [--num-threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tandem.model.int4 import quantize_int4
from tandem.model.int4_matmul import DEQUANTIZE_BF16, DEQUANTIZE_F32, GEMV_F32, KERNEL, int4_matmul
from tandem.model.quantization import int8_matmul, quantize_int8

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536, vocab 49152.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LM_HEAD_SHAPE = ((49152, 576),)
ROWS = (1, 8, 16, 32, 64, 128, 256)
SLOW_MAX_ROWS = 8
"""The unvectorized float32 int4 kernel is timed up to this many rows only."""


def _f32_int4_kernel(x: torch.Tensor, w) -> torch.Tensor:
    """torch's int4 kernel with float32 activations, scales and zeros (for the table only)."""
    scale = w.scale.float()
    scale_zeros = torch.stack((scale, w.offset.float() + 8 * scale), -1).transpose(0, 1).contiguous()
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.cpu_pack.values, w.group_size, scale_zeros)


# label -> (prepare the weight once, product on the prepared weight, most rows to time)
Candidate = tuple[Callable, Callable, int]
CANDIDATES: dict[str, Candidate] = {
    "float32 F.linear": (lambda w: w, F.linear, 1 << 30),
    "bfloat16 F.linear": (lambda w: w.bfloat16(), lambda x, w: F.linear(x.bfloat16(), w).float(), 1 << 30),
    "int8, _weight_int8pack_mm bf16": (quantize_int8, lambda x, q: int8_matmul(x, q, use_kernel=True), 1 << 30),
    "int8, dequantize to bf16": (quantize_int8, lambda x, q: int8_matmul(x, q, use_kernel=False), 1 << 30),
    "int4, dequantize to float32": (quantize_int4, lambda x, q: int4_matmul(x, q, DEQUANTIZE_F32), 1 << 30),
    "int4, dequantize to bf16": (quantize_int4, lambda x, q: int4_matmul(x, q, DEQUANTIZE_BF16), 1 << 30),
    "int4, _weight_int4pack_mm f32": (quantize_int4, _f32_int4_kernel, SLOW_MAX_ROWS),
    "int4, _weight_int4pack_mm bf16": (quantize_int4, lambda x, q: int4_matmul(x, q, KERNEL), 1 << 30),
    "int4, tandem gemv f32": (quantize_int4, lambda x, q: int4_matmul(x, q, GEMV_F32), 1 << 30),
}


def best_us(fn: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` wall times of ``fn()`` in microseconds, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def measure(shapes: tuple[tuple[int, int], ...], rows: tuple[int, ...], repeats: int) -> dict[str, list[float | None]]:
    """label -> microseconds per M in ``rows`` (summed over ``shapes``; None: not timed)."""
    gen = torch.Generator().manual_seed(0)
    floats = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes]
    table: dict[str, list[float | None]] = {}
    for label, (prepare, product, max_rows) in CANDIDATES.items():
        weights = [prepare(w) for w in floats]
        for w in weights:
            getattr(w, "cpu_pack", None)  # build the int4 kernel's layout outside the timing
        table[label] = []
        for m in rows:
            if m > max_rows:
                table[label].append(None)
                continue
            xs = [torch.randn(m, i, generator=gen) for _, i in shapes]
            table[label].append(sum(best_us(lambda: product(x, w), repeats) for x, w in zip(xs, weights)))
    return table


def best_of_rounds(shapes: tuple[tuple[int, int], ...], args: argparse.Namespace) -> dict[str, list[float | None]]:
    """Each cell's best over ``args.rounds`` whole measurements (noise on a shared machine only adds)."""
    tables = [measure(shapes, ROWS, args.repeats) for _ in range(args.rounds)]
    return {label: [None if cells[0] is None else min(cells) for cells in zip(*(t[label] for t in tables))]
            for label in tables[0]}


def format_table(title: str, table: dict[str, list[float | None]], rows: tuple[int, ...]) -> list[str]:
    lines = [title, f"{'M':<32}" + "".join(f"{m:>7}" for m in rows)]
    for label, values in table.items():
        lines.append(f"{label:<32}" + "".join(f"{'-' if v is None else round(v):>7}" for v in values))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure everything this many times and keep each cell's best (a shared machine)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    layer, head = best_of_rounds(LAYER_SHAPES, args), best_of_rounds(LM_HEAD_SHAPE, args)
    print(f"torch {torch.__version__}, {args.num_threads} threads, microseconds, best of {args.repeats} "
          f"x {args.rounds} round(s)")
    shapes = " + ".join(f"{o}x{i}" for o, i in LAYER_SHAPES)
    for line in format_table(f"one SmolLM2-135M layer ({shapes})", layer, ROWS) + format_table(
            "LM head 49152x576", head, ROWS):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": ROWS, "layer": layer, "lm_head": head, "threads": args.num_threads}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
