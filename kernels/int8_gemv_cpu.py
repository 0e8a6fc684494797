"""Weight-only int8 products on the CPU for a few rows of float32 activations: a small C++
kernel (csrc/int8_gemv_cpu.cpp) over a copy of the weight packed once for it (`pack`: 16
output channels interleaved, so each vector load feeds 16 outputs).

torch's ``_weight_int8pack_mm`` (quantization.py) rounds float32 activations to bfloat16;
this one keeps them in float32, as the int4 kernel does (int4_gemv_cpu.py). Built with the
other CPU kernels by `make install` (cpu_build.py); torch's kernel runs where it cannot be.
On CPUs with AVX-512 VNNI a pack may round the activations to 8 bits per group of 32 instead
(`int8_activations`, csrc/int8_q8_gemv_cpu.h), as int4_gemv_cpu.py's may.
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
EXTENSION_NAME = "tandem_int8_gemv_cpu"
CHANNELS = 16
"""Output channels interleaved in the packed layout: the output size must be a multiple."""
ACTIVATION_GROUP = 32
"""Columns per scale of 8-bit activations."""

_openmp = ("-fopenmp",) if sys.platform.startswith("linux") else ()
EXTENSION = CpuExtension(EXTENSION_NAME, (CSRC / "int8_gemv_cpu.cpp",),
                         (CSRC / "cpu_gemv.h", CSRC / "int8_gemv_cpu.h", CSRC / "int8_q8_gemv_cpu.h",
                          CSRC / "q8_activations_cpu.h"),
                         ("-O3", "-Wno-psabi", *_openmp), _openmp)


@dataclass(frozen=True)
class Int8GemvPack:
    """An int8 weight in the kernel's layout (see csrc/int8_gemv_cpu.cpp): 16 output channels
    interleaved, each 32-bit lane holding 4 values of one channel."""

    values: torch.Tensor  # [out / 16, in / 4, 16] int32
    scale: torch.Tensor  # [out] float32
    int8_activations: bool = False
    """The activations rounded to 8 bits per group of 32 before the product (only where
    has_int8_dot() and the input size is a multiple of 32)."""

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2: [M, in] float32 -> [M, out] float32 (the kernel must be available: see load_extension)."""
        if torch.compiler.is_compiling():  # traced: the op (see _int8_gemv_op); eager: the kernel itself
            return torch.ops.tandem.int8_gemv_cpu(x2, self.values, self.scale, self.int8_activations)
        return _module().int8_gemv(x2, self.values, self.scale, self.int8_activations)

    @property
    def num_bytes(self) -> int:
        return self.values.numel() * self.values.element_size()  # the scales are the weight's own


def takes(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape (build aside)."""
    return out_features % CHANNELS == 0 and in_features % 4 == 0


def takes_int8_activations(in_features: int) -> bool:
    """Whether 8-bit activations apply to a weight of this input size (groups of 32)."""
    return in_features % ACTIVATION_GROUP == 0


def pack(qweight: torch.Tensor, scale: torch.Tensor) -> Int8GemvPack:
    """qweight: [N, K] int8; scale: [N] float32 -> the kernel's layout (the same bytes, reordered)."""
    n, k = qweight.shape
    lanes = qweight.contiguous().view(torch.int32)  # [N, K / 4]: column 4 l + t in byte t of lane l
    values = lanes.view(n // CHANNELS, CHANNELS, k // 4).transpose(1, 2).contiguous()
    return Int8GemvPack(values, scale.float().contiguous())


def load_extension() -> ModuleType | None:
    """The compiled kernel, or None where it cannot be built (logged once)."""
    return cpu_build.load_or_none(EXTENSION, "CPU int8 kernel", "int8 products use torch's kernel")


def _module() -> ModuleType:
    module = load_extension()
    assert module is not None, "int8_gemv_cpu needs the compiled kernel"
    return module


# The kernel as a torch custom op, so that a traced step holds it as a node of its one graph;
# eager products skip the op's dispatch (several us a call, about the kernel's own at one row).
@torch.library.custom_op("tandem::int8_gemv_cpu", mutates_args=())
def _int8_gemv_op(x2: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, int8_activations: bool) -> torch.Tensor:
    return _module().int8_gemv(x2, values, scale, int8_activations)


@_int8_gemv_op.register_fake
def _(x2: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, int8_activations: bool) -> torch.Tensor:
    # scale: [out] -> [M, out] float32
    return x2.new_empty((x2.shape[0], scale.shape[0]), dtype=torch.float32)
