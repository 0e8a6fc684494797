"""The int4 product ``x @ w.T`` for an Int4Weight on CPU (or any device without Triton).

Kernels, measured on this machine's CPU (AMD EPYC, AVX512 with bf16 dot products; torch
2.13, 2 threads; microseconds, best of 10 x 3 rounds, float32 activations; the float and
int8 rows from the same run), for M rows of activations. Reproduce with
``python -m tandem.bench.quantization.kernels --rounds 3``:

    one SmolLM2-135M layer (qkv 960x576 + o 576x576 + gate_up 3072x576 + down 576x1536)
    M                                 1      8     16     32     64    128    256
    float32 F.linear                201    630    913   1470   2605   5286  14307
    bfloat16 F.linear               199    238    312    462    757   1265   2314
    int8, _weight_int8pack_mm bf16   73    229    429    839   1661   3381   6607
    int8, dequantize to bf16        426    471    535    681    990   1530   2667
    int4, dequantize to float32    2519   3166   3439   4122   5458  12073  19893
    int4, _weight_int4pack_mm f32  3245  23396      -      -      -      -      -
    int4, _weight_int4pack_mm bf16   81    215    401    771   1502   2981   6004  <- M <= 160
    int4, dequantize to bf16       2548   2713   2697   2794   3153   3605   4623  <- M > 160
    int4, tandem gemv f32           121    357    700   1365   2693   5443  10967  <- float32, M <= 160
    LM head 49152x576
    float32 F.linear               7239   9305  11708  17568  30132  48720 101376
    bfloat16 F.linear              1814   2206   2824   3935   6093  10638  19872
    int8, _weight_int8pack_mm bf16  716   2014   4104   8132  16282  32165  93218
    int8, dequantize to bf16       3648   4178   4806   6557   9336  14768  65569
    int4, dequantize to float32   58851  61188  64707  69409  81282 100309 154142
    int4, _weight_int4pack_mm f32 24652 183082      -      -      -      -      -
    int4, _weight_int4pack_mm bf16  453   1594   3290   6556  12822  25726  64816  <- M <= 160
    int4, dequantize to bf16      37411  22304  21360  22790  25255  30154  39536  <- M > 160
    int4, tandem gemv f32           790   2700   5410  10898  22421  46765 104004  <- float32, M <= 160

torch's ``_weight_int4pack_mm_for_cpu`` reads the packed int4 weight directly: for one row
2.5x (layers) to 16x (LM head) faster than float32, and about as fast as the int8 kernel:
it reads 5/8 of int8's bytes but unpacks nibbles and applies a scale and zero per group.
(Repeated products of one layer's 3.5 MB find it in cache; a decode step streams all the
layers from memory: tandem bench quant measures that.) Its float32 variant is unvectorized
(16-40x slower than float32).
Dequantizing an int4 weight (unpack, scale, offset, round: 2.5 ms a layer, 20-40 ms the LM
head) costs far more than dequantizing int8, so the kernel wins up to a few hundred rows:
the crossover, measured at 128/160/192/224 rows, lies between 160 and 192 for both shapes.
Dequantizing to float32 never wins. Hence: the kernel up to KERNEL_MAX_TOKENS rows, a bf16
GEMM on the dequantized weight above (float16 for float16 activations).

tandem's own kernel (kernels/int4_gemv_cpu.py; its rows above were measured on another day,
on an Intel Xeon with AVX-512, against a `_weight_int4pack_mm bf16` row of 157 / 467 / 889 /
1743 / 3429 / 6797 / 13687 for the layer and 937 / 3455 / ... / 121445 for the LM head) keeps
float32 activations and the file's float16 scales, over a copy of the weight with 16 output
channels interleaved: 1.2-1.3x torch's kernel at every size, and exact to float32 rounding.
So float32 activations take it up to GEMV_MAX_TOKENS rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import int4_gemv_cpu
from tandem.model.int4 import Int4Weight

KERNEL = "kernel"
"""torch's ``_weight_int4pack_mm_for_cpu`` in bf16 on the packed weight (Int4Weight.cpu_pack)."""
DEQUANTIZE_BF16 = "dequantize-bf16"
"""Dequantize the weight to bf16, then a bf16 ``F.linear``."""
DEQUANTIZE_F32 = "dequantize-f32"
"""Dequantize the weight to float32, then a float32 ``F.linear`` (the exact weight)."""
GEMV_F32 = "gemv-f32"
"""tandem's compiled CPU kernel (kernels/int4_gemv_cpu.py): float32 activations, the packed
weight read in place with its float16 scales and offsets."""
PATHS = (KERNEL, DEQUANTIZE_BF16, DEQUANTIZE_F32, GEMV_F32)

KERNEL_MAX_TOKENS = 160
"""Most rows for which the int4 kernel beats dequantizing (measured: 160 vs 192, layers and LM head)."""
GEMV_MAX_TOKENS = 160
"""Most rows of float32 activations for which tandem's kernel runs: it beats torch's kernel at
every size measured and dequantizing up to 128-256 rows (table above), so the same bound."""


def choose_path(num_tokens: int, w: Int4Weight, dtype: torch.dtype = torch.bfloat16) -> str:
    """The faster CPU way for ``num_tokens`` rows of ``dtype`` activations (see the measured table)."""
    if (dtype == torch.float32 and num_tokens <= GEMV_MAX_TOKENS and w.qweight.device.type == "cpu"
            and int4_gemv_cpu.takes(w.shape[0], w.shape[1], w.group_size)
            and int4_gemv_cpu.load_extension() is not None):
        return GEMV_F32
    return KERNEL if w.has_cpu_kernel and num_tokens <= KERNEL_MAX_TOKENS else DEQUANTIZE_BF16


def _compute_dtype(x2: torch.Tensor) -> torch.dtype:
    # float16 activations keep float16 in a dequantized GEMM; anything else runs in bf16.
    return torch.float16 if x2.dtype == torch.float16 else torch.bfloat16


def int4_matmul(x2: torch.Tensor, w: Int4Weight, path: str | None = None) -> torch.Tensor:
    """x2: [M, in] float -> [M, out] float32: ``x2 @ w.dequantize().T``.

    GEMV_F32: float32 throughout, the exact weight (summed in another order than F.linear);
    KERNEL: x2 rounded to bf16, the weight's scales and zeros in bf16 (Int4Weight.cpu_pack),
    float32 accumulation; DEQUANTIZE_BF16: x2 and the dequantized weight rounded to bf16
    (float16 for float16 activations); DEQUANTIZE_F32: the exact weight in float32.
    path None: the faster for M rows (choose_path).
    """
    if path is None:
        path = choose_path(x2.shape[0], w, x2.dtype)
    if path == GEMV_F32:
        return w.gemv_pack.matmul(x2.float())
    if path == KERNEL:
        pack = w.cpu_pack
        # out: [M, out] bf16
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), pack.values,
                                                          w.group_size, pack.scale_zeros)
        return out.float()
    if path == DEQUANTIZE_BF16:
        dtype = _compute_dtype(x2)
        return F.linear(x2.to(dtype), w.dequantize(dtype)).float()
    if path == DEQUANTIZE_F32:
        return F.linear(x2.float(), w.dequantize(torch.float32))
    raise ValueError(f"int4 path must be one of {', '.join(PATHS)}, got {path!r}")
