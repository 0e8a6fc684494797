"""The small operations of a float32 layer on the CPU, each one compiled call
(csrc/layer_ops_cpu.cpp): RMSNorm, the residual add with the next RMSNorm, and RoPE with the
KV store. A decode step runs about twenty operations a layer on a handful of rows, where each
of torch's costs ~5-10 us of dispatch on the 2-core machine against ~1 us of arithmetic. Their
torch references are `tandem.model.layer_ops`' other paths; a float32 CPU model takes these
where they are built (cpu_build.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch

from tandem.kernels import cpu_build
from tandem.kernels.cpu_build import CpuExtension

_csrc = Path(__file__).with_name("csrc")
_openmp = ("-fopenmp",) if sys.platform.startswith("linux") else ()
# -ffp-contract=off: no fused multiply-add, so that RoPE rounds as torch does (bit for bit).
EXTENSION = CpuExtension("tandem_layer_ops_cpu", (_csrc / "layer_ops_cpu.cpp",),
                         (_csrc / "rms_norm_cpu.h", _csrc / "rope_cpu.h"),
                         ("-O3", "-ffp-contract=off", *_openmp), _openmp)


def load_extension() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (logged once)."""
    return cpu_build.load_or_none(EXTENSION, "CPU layer kernels (RMSNorm, RoPE)",
                                  "those operations run torch's")


def supports(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def kernels_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled kernels where they run on ``tensors`` (float32 CPU, built), else None."""
    return load_extension() if supports(*tensors) else None
