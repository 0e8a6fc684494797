"""Paged decode attention on the CPU without gathering: a small compiled C++ kernel.

The torch reference (`paged_decode_attention_torch`) copies every sequence's blocks into a
contiguous tensor with `index_select`, then runs masked SDPA: three passes over the KV.
This kernel (csrc/paged_decode_attention_cpu*.cpp) walks each sequence's block table and
reads K and V where they lie, once: per KV head it scores the GQA group's query heads
against each K row, keeps an online softmax and accumulates V in float32 (the heads of a
token walked together, so the blocks stream in memory order). Long contexts are cut into
several work items (flash-decoding partials merged by log-sum-exp), so both cores work even
at batch 1. Threads are torch's own (`at::parallel_for`), so `torch.set_num_threads`
applies and no second thread pool competes with torch's.

It is compiled by `make install` into tandem's kernel cache (cpu_build.py; about 40 s on
2 cores, once per machine); a process that finds it missing builds it at start-up
(`ops.prepare_cpu_kernels`). Without a C++ compiler or ninja, or if the build fails, the torch reference
runs instead, with one logged warning: a request never fails for it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch

from tandem.kernels import cpu_build
from tandem.kernels.attention_metadata import DecodeGroup
from tandem.kernels.cpu_build import CpuExtension
from tandem.kernels.paged_decode_attention import paged_decode_attention_torch

CSRC = Path(__file__).with_name("csrc")
# The torch binding (threads) and the hot loop (no torch headers), and the headers they share
# (the work split and merge are in the items header, which the compiled decode step runs too).
SOURCES = (CSRC / "paged_decode_attention_cpu.cpp", CSRC / "paged_decode_attention_cpu_loop.cpp")
HEADERS = (CSRC / "paged_decode_attention_cpu.h", CSRC / "paged_decode_attention_cpu_items.h", CSRC / "exp_cpu.h")
EXTENSION_NAME = "tandem_paged_decode_attention_cpu"
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_GROUP = 16
# Fewest context tokens per work item: below this a split costs more (a partial written and
# merged, one more item to schedule) than the parallelism it buys. 64, not 128: inside the
# compiled step, whose threads are already running, a lone stream's 65-128-token contexts then
# share its attention between both cores (a step's attention growing 0.36 ms from 16 to 112
# tokens against 0.71, three runs each; batch 8 at 256 tokens unchanged within the noise).
MIN_SPLIT_TOKENS = 64

def build_flags() -> tuple[list[str], list[str]]:
    """-> (compiler flags, linker flags). No -march=native: the built library may be loaded on
    another CPU; the kernel picks AVX-512 / AVX2 / baseline code itself at run time."""
    cflags = ["-O3", "-Wno-psabi"]
    ldflags: list[str] = []
    if sys.platform.startswith("linux"):
        # OpenMP for at::parallel_for and `omp simd`; at run time the loader reuses the
        # libgomp.so.1 that torch has already loaded (same soname), so one pool serves both.
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


EXTENSION = CpuExtension(EXTENSION_NAME, SOURCES, HEADERS, *map(tuple, build_flags()))


def load_extension() -> ModuleType | None:
    """The compiled kernel (built here first if `make install` did not), or None when it
    cannot be built here; the failure is logged once and not retried in this process."""
    return cpu_build.load_or_none(EXTENSION, "CPU paged decode attention kernel",
                                  "decode attention falls back to the torch reference")


def available() -> bool:
    """Whether the compiled kernel can run here (builds it on the first call)."""
    return load_extension() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (device, dtype, head sizes), build aside."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype in DTYPES
            and k_cache.dtype in DTYPES and head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0
            and k_cache.stride(-1) == 1
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    groups: tuple[DecodeGroup, ...] | None = None,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache (torch reference where unsupported).

    q: [num_seqs, num_heads, head_dim] float32 or bfloat16
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16 (q's
    dtype, or bfloat16 under float32 queries)
    block_tables: [num_seqs, max_num_blocks] int64; context_lens: [num_seqs] int64 (host)
    groups: only for the torch fallback (the kernel balances its own work)
    returns: [num_seqs, num_heads, head_dim], q's dtype
    """
    module = load_extension() if supports(q, k_cache) and v_cache.stride() == k_cache.stride() else None
    if module is None:
        return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, groups)
    if torch.compiler.is_compiling():  # traced: the op (see _attention_op); eager: the kernel itself
        return torch.ops.tandem.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens,
                                                           float(scale))
    return module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, float(scale),
                                         MIN_SPLIT_TOKENS)


# The kernel as a torch custom op, so that a traced step holds it as a node of its one graph;
# eager calls skip the op's dispatch (several us a call, ~100 calls a step).
@torch.library.custom_op("tandem::paged_decode_attention_cpu", mutates_args=())
def _attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    module = load_extension()
    assert module is not None, "paged_decode_attention_cpu's op needs the compiled kernel"
    return module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, MIN_SPLIT_TOKENS)


@_attention_op.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
      context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_seqs, num_heads, head_dim], contiguous
