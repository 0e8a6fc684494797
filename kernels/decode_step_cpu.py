"""A whole decode step of a Llama-family model as one compiled call on the CPU
(csrc/decode_step_cpu.cpp): the layer loop in C++, one parallel region a step whose threads take
each stage's units as they come (csrc/step_stages.h), in place of ~12 torch calls a layer (each a Python dispatch and a
wake of torch's threads). It runs the eager kernels' own loops, so its logits equal the eager
path's to the bit; tandem.model.compiled_step decides when a step takes it.

Built with the other CPU kernels by `make install` (cpu_build.py); where it cannot be built, the
eager path runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from tandem.kernels import cpu_build
from tandem.kernels.cpu_build import CpuExtension

_csrc = Path(__file__).with_name("csrc")
_openmp = ("-fopenmp",) if sys.platform.startswith("linux") else ()
# The flags of the GEMV and attention kernels whose loops it runs (the same code, the same bits).
EXTENSION = CpuExtension(
    "tandem_decode_step_cpu", (_csrc / "decode_step_cpu.cpp", _csrc / "paged_decode_attention_cpu_loop.cpp"),
    tuple(_csrc / name for name in ("cpu_gemv.h", "int4_gemv_cpu.h", "int4_q8_gemv_cpu.h", "int8_gemv_cpu.h",
                                    "int8_q8_gemv_cpu.h", "q8_activations_cpu.h", "f32_gemv_cpu.h",
                                    "paged_decode_attention_cpu.h", "paged_decode_attention_cpu_items.h",
                                    "exp_cpu.h", "rms_norm_cpu.h", "rope_cpu.h", "silu_mul_cpu.h", "step_stages.h")),
    ("-O3", "-Wno-psabi", *_openmp), _openmp)


def load_extension() -> ModuleType | None:
    """The compiled step, or None where it cannot be built (logged once)."""
    return cpu_build.load_or_none(EXTENSION, "CPU compiled decode step", "decode steps run eagerly")
