"""RMSNorm of float32 rows on the CPU in one compiled pass (csrc/rms_norm_cpu.cpp): a decode
step runs two a layer on a few rows, where torch's F.rms_norm costs about ten times as much
in operator overhead as the arithmetic. The torch reference is `tandem.model.llama.rms_norm`'s
own path; this runs where the kernel is built (cpu_build.py) and the tensors are float32 CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch

from tandem.kernels import cpu_build
from tandem.kernels.cpu_build import CpuExtension

_openmp = ("-fopenmp",) if sys.platform.startswith("linux") else ()
EXTENSION = CpuExtension("tandem_rms_norm_cpu", (Path(__file__).with_name("csrc") / "rms_norm_cpu.cpp",), (),
                         ("-O3", *_openmp), _openmp)


def load_extension() -> ModuleType | None:
    """The compiled kernel, or None where it cannot be built (logged once)."""
    return cpu_build.load_or_none(EXTENSION, "CPU RMSNorm kernel", "RMSNorm runs torch's")


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.device.type == "cpu"


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] float32; weight: [H] float32 -> [..., H] float32 (the kernel must be available)."""
    module = load_extension()
    assert module is not None, "rms_norm_cpu needs the compiled kernel"
    return module.rms_norm(x, weight, eps)
