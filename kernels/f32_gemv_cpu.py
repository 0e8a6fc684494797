"""float32 products on the CPU for a few rows of float32 activations: a small C++ kernel
(csrc/f32_gemv_cpu.cpp) over the weight as torch holds it ([out, in], row-major; no copy).

The reference is ``F.linear`` (torch's MKL sgemv, summed in another order): at decode sizes
MKL read the default model's float32 weights at about 11 GB/s on the 2-core AMD machine, where
a core reads 25 and two 30; this kernel keeps every vector load of the weight feeding up to 8
rows' sums. Built with the other CPU kernels by `make install` (cpu_build.py); ``F.linear``
runs where it cannot be.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch

from tandem.kernels import cpu_build
from tandem.kernels.cpu_build import CpuExtension

CSRC = Path(__file__).with_name("csrc")
CHANNELS = 16
"""Output channels a unit of work covers: the output size must be a multiple (the input size too)."""
MAX_TOKENS = 8
"""Rows it takes: one pass over the weight (more rows re-read it, where MKL's sgemm reads it once)."""

_openmp = ("-fopenmp",) if sys.platform.startswith("linux") else ()
EXTENSION = CpuExtension("tandem_f32_gemv_cpu", (CSRC / "f32_gemv_cpu.cpp",),
                         (CSRC / "cpu_gemv.h", CSRC / "f32_gemv_cpu.h"), ("-O3", "-Wno-psabi", *_openmp), _openmp)


def takes(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape (build aside)."""
    return out_features % CHANNELS == 0 and in_features % CHANNELS == 0


def uses_kernel(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear`` runs this product here: float32 CPU rows (at most MAX_TOKENS) and weight
    of a shape it takes, the kernel built."""
    return (x2.dtype == torch.float32 and w.dtype == torch.float32 and x2.shape[0] <= MAX_TOKENS
            and w.device.type == "cpu" and x2.device.type == "cpu" and takes(*w.shape)
            and load_extension() is not None)


def matmul(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2: [M, in] float32, w: [out, in] float32 -> [M, out] float32 (the kernel must be built)."""
    if torch.compiler.is_compiling():  # traced: the op; eager: the kernel itself (no op dispatch)
        return torch.ops.tandem.f32_gemv_cpu(x2, w)
    return _module().f32_gemv(x2, w.contiguous())


def load_extension() -> ModuleType | None:
    """The compiled kernel, or None where it cannot be built (logged once)."""
    return cpu_build.load_or_none(EXTENSION, "CPU float32 product kernel", "float32 products use F.linear")


def _module() -> ModuleType:
    module = load_extension()
    assert module is not None, "f32_gemv_cpu needs the compiled kernel"
    return module


@torch.library.custom_op("tandem::f32_gemv_cpu", mutates_args=())
def _f32_gemv_op(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _module().f32_gemv(x2, w.contiguous())


@_f32_gemv_op.register_fake
def _(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # w: [out, in] -> [M, out] float32
    return x2.new_empty((x2.shape[0], w.shape[0]), dtype=torch.float32)
