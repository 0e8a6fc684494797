"""Weight-only int4 products on the CPU for a few rows of float32 activations: a small C++
kernel (csrc/int4_gemv_cpu.cpp) that reads the Q4_1 weight once per call.

torch's own CPU int4 kernel (``_weight_int4pack_mm_for_cpu``, int4_matmul.py) rounds the
activations and the scales to bfloat16; this one keeps float32 activations and the file's
float16 scales and offsets, over a copy of the weight packed once for it (`pack`: 16 output
channels interleaved, so each vector load feeds 16 outputs). Built with the other CPU kernels
by `make install` (cpu_build.py); torch's kernel runs where it cannot be built.

On CPUs with AVX-512 VNNI a pack may instead round the activations to 8 bits per group of 32
(`int8_activations`, csrc/int4_q8_gemv_cpu.h), as llama.cpp does: the products then run in
integers at the weight's bytes' pace, 1.5x (one row) to 2.4x (eight) the float32 loop's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from tandem.kernels import cpu_build
from tandem.kernels.cpu_build import CpuExtension

CSRC = Path(__file__).with_name("csrc")
EXTENSION_NAME = "tandem_int4_gemv_cpu"
GROUP_SIZE = 32
"""The group size the kernel takes (GGUF Q4_1's)."""
CHANNELS = 16
"""Output channels interleaved in the packed layout: the output size must be a multiple."""


@dataclass(frozen=True)
class Int4GemvPack:
    """An int4 weight in the kernel's layout (see csrc/int4_gemv_cpu.cpp): 16 output channels
    interleaved, each 32-bit lane holding 8 values of one channel; scale and offset bits paired."""

    values: torch.Tensor  # [out / 16, in / 8, 16] int32
    scale_offset: torch.Tensor  # [out / 16, in / 32, 16] int32: float16 scale bits low, offset bits high
    int8_activations: bool = False
    """The activations rounded to 8 bits per group of 32 before the product (see the module's
    docstring; only where has_int8_dot())."""

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2: [M, in] float32 -> [M, out] float32 (the kernel must be available: see load_extension)."""
        if torch.compiler.is_compiling():  # traced: the op (see _int4_gemv_op); eager: the kernel itself
            return torch.ops.tandem.int4_gemv_cpu(x2, self.values, self.scale_offset, self.int8_activations)
        return _module().int4_gemv(x2, self.values, self.scale_offset, self.int8_activations)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scale_offset))


def takes(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a weight of this shape and group size (build aside)."""
    return group_size == GROUP_SIZE and out_features % CHANNELS == 0 and in_features % GROUP_SIZE == 0


def has_int8_dot() -> bool:
    """Whether this CPU runs the products with 8-bit activations (AVX-512 VNNI, and the kernel built)."""
    module = load_extension()
    return module is not None and bool(module.has_int8_dot())


def pack(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int4GemvPack:
    """qweight: [N, K / 2] uint8 (low nibble first); scale, offset: [N, K / 32] float16 -> the
    kernel's layout (the same bytes, reordered)."""
    n, half = qweight.shape
    blocks = n // CHANNELS
    # Little-endian: byte 4 l + t of a row lands in bits 8 t of its lane l, so nibble k of lane
    # l is column 8 l + k.
    lanes = qweight.contiguous().view(torch.int32)  # [N, K / 8]
    values = lanes.view(blocks, CHANNELS, half // 4).transpose(1, 2).contiguous()
    bits = (scale.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) | (
        offset.contiguous().view(torch.int16).to(torch.int32) << 16)
    scale_offset = bits.view(blocks, CHANNELS, -1).transpose(1, 2).contiguous()
    return Int4GemvPack(values, scale_offset)


_openmp = ("-fopenmp",) if sys.platform.startswith("linux") else ()
EXTENSION = CpuExtension(EXTENSION_NAME, (CSRC / "int4_gemv_cpu.cpp",),
                         (CSRC / "cpu_gemv.h", CSRC / "int4_gemv_cpu.h", CSRC / "int4_q8_gemv_cpu.h",
                          CSRC / "q8_activations_cpu.h"),
                         ("-O3", "-Wno-psabi", *_openmp), _openmp)

def load_extension() -> ModuleType | None:
    """The compiled kernel, or None where it cannot be built (logged once)."""
    return cpu_build.load_or_none(EXTENSION, "CPU int4 kernel", "int4 products use torch's kernel")


def _module() -> ModuleType:
    module = load_extension()
    assert module is not None, "int4_gemv_cpu needs the compiled kernel"
    return module


# The kernel as a torch custom op, so that a traced step holds it as a node of its one graph;
# eager products skip the op's dispatch (several us a call, about the kernel's own at one row).
@torch.library.custom_op("tandem::int4_gemv_cpu", mutates_args=())
def _int4_gemv_op(x2: torch.Tensor, values: torch.Tensor, scale_offset: torch.Tensor,
                  int8_activations: bool) -> torch.Tensor:
    return _module().int4_gemv(x2, values, scale_offset, int8_activations)


@_int4_gemv_op.register_fake
def _(x2: torch.Tensor, values: torch.Tensor, scale_offset: torch.Tensor, int8_activations: bool) -> torch.Tensor:
    # values: [out / 16, in / 8, 16] -> [M, out] float32
    return x2.new_empty((x2.shape[0], values.shape[0] * CHANNELS), dtype=torch.float32)
