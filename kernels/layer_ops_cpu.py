"""The small operations of a float32 layer on the CPU, each one compiled call
(csrc/layer_ops_cpu.cpp): RMSNorm, the residual add with the next RMSNorm, and RoPE with the
KV store; and after the layers, a greedy row's token with its log-probability. A decode step
runs about twenty operations a layer on a handful of rows, where each of torch's costs ~5-10 us
of dispatch on the 2-core machine against ~1 us of arithmetic. Their torch references are
`tandem.model.layer_ops`' other paths and the sampler's own greedy path; a float32 CPU model
takes these where they are built (cpu_build.py).
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
                         (_csrc / "rms_norm_cpu.h", _csrc / "rope_cpu.h", _csrc / "silu_mul_cpu.h",
                          _csrc / "exp_cpu.h", _csrc / "greedy_pick_cpu.h"),
                         ("-O3", "-ffp-contract=off", *_openmp), _openmp)


def load_extension() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (logged once)."""
    return cpu_build.load_or_none(EXTENSION, "CPU layer kernels (RMSNorm, RoPE, SwiGLU)",
                                  "those operations run torch's")


def supports(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def kernels_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled kernels where they run on ``tensors`` (float32 CPU, built), else None."""
    return load_extension() if supports(*tensors) else None


# The kernels as torch custom ops, so that a traced step (torch.compile, torch.export) holds
# them as nodes of its one graph instead of breaking at an opaque pybind call. Eager calls skip
# the op: its dispatch costs 4-12 us a call against ~1 us of the kernel's own, ~100 calls a
# step. Both run the same kernel, so the values are the same either way.

@torch.library.custom_op("tandem::rms_norm_cpu", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _module().rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # the kernel's output is contiguous


@torch.library.custom_op("tandem::add_rms_norm_cpu", mutates_args=("h",))
def _add_rms_norm_op(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _module().add_rms_norm(h, delta, weight, eps)


@_add_rms_norm_op.register_fake
def _(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(h)


@torch.library.custom_op("tandem::silu_mul_cpu", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _module().silu_mul(gate_up)


@_silu_mul_op.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("tandem::rope_store_kv_cpu", mutates_args=("qkv", "k_cache", "v_cache"))
def _rope_store_kv_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    # The kernel's q, k, v are views of qkv, which an op may not return: rope_store_kv makes them.
    _module().rope_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


@_rope_store_kv_op.register_fake
def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    return None


def _module() -> ModuleType:
    module = load_extension()
    assert module is not None, "the CPU layer kernels are not built"
    return module


def rms_norm(kernels: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H] float32 -> [..., H]: `kernels` (load_extension's) eagerly, its op traced."""
    if torch.compiler.is_compiling():
        return torch.ops.tandem.rms_norm_cpu(x, weight, eps)
    return kernels.rms_norm(x, weight, eps)


def add_rms_norm(kernels: ModuleType, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h += delta in place -> rms_norm(h). h (contiguous), delta: [T, H]; weight: [H]."""
    if torch.compiler.is_compiling():
        return torch.ops.tandem.add_rms_norm_cpu(h, delta, weight, eps)
    return kernels.add_rms_norm(h, delta, weight, eps)


def silu_mul(kernels: ModuleType, gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product. gate_up: [T, 2 I] (gate | up), rows contiguous -> silu(gate) * up: [T, I]."""
    if torch.compiler.is_compiling():
        return torch.ops.tandem.silu_mul_cpu(gate_up)
    return kernels.silu_mul(gate_up)


def rope_store_kv(kernels: ModuleType, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on qkv's q and k heads in place, k and v into their cache slots.

    qkv: [T, (num_heads + 2 * num_kv_heads) * D]; cos, sin: [T, D]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, D]; slot_mapping: [T] int64
    -> q: [T, num_heads, D]; k, v: [T, num_kv_heads, D], views of qkv (as the kernel's)
    """
    if not torch.compiler.is_compiling():
        return kernels.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    torch.ops.tandem.rope_store_kv_cpu(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))
