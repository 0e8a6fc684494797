"""The operations the model calls (attention, the KV store, weight-only GEMVs): the one place
that picks an implementation.

`TANDEM_ATTENTION_BACKEND` chooses: `auto` (the default: Triton on CUDA tensors; on CPU
tensors the compiled CPU decode-attention kernel for the dtypes in AUTO_CPU_KERNEL_DTYPES
and torch for everything else), `triton` (also on CPU tensors, which needs
`TRITON_INTERPRET=1` set before the kernels are first imported), `torch`, or `cpu_kernel`
(the compiled CPU kernel for decode attention in any dtype it supports, torch for the
rest; CPU tensors only). It is read at every call, so a test or an operator can switch it
without rebuilding the engine.
"""

from __future__ import annotations

import enum
import os

import torch

from tandem.kernels import layer_ops_cpu, triton_ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.int4_gemv import int4_gemv_torch
from tandem.kernels.int8_gemv import int8_gemv_torch
from tandem.kernels.paged_decode_attention import paged_decode_attention_torch
from tandem.kernels.paged_decode_attention_cpu import load_extension, paged_decode_attention_cpu
from tandem.kernels.prefill_attention import prefill_attention_torch
from tandem.kernels.store_kv import store_kv_torch

BACKEND_ENV = "TANDEM_ATTENTION_BACKEND"


class Backend(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CPU_KERNEL = "cpu_kernel"


# Where `auto` runs decode attention on CPU tensors with the compiled kernel
# (paged_decode_attention_cpu.py): 2.2-3.9x the torch reference, and the float32 engine
# stays token-exact with transformers on it. float16 has no CPU kernel (torch runs it).
AUTO_CPU_KERNEL_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16})


_BACKENDS = {b.value: b for b in Backend}  # a dict lookup: Backend(name) costs a microsecond on every op


def requested_backend() -> Backend:
    """The value of TANDEM_ATTENTION_BACKEND (AUTO when unset)."""
    name = os.environ.get(BACKEND_ENV, Backend.AUTO.value)
    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"{BACKEND_ENV}={name!r}: must be one of {', '.join(_BACKENDS)}")
    return backend


def backend_for(t: torch.Tensor) -> Backend:
    """The implementation of the ops other than decode attention on tensors like `t`:
    TORCH or TRITON, never AUTO or CPU_KERNEL (see decode_attention_backend)."""
    backend = requested_backend()
    if backend is Backend.AUTO:
        return Backend.TRITON if t.is_cuda else Backend.TORCH
    if backend is Backend.CPU_KERNEL:
        if t.is_cuda:
            raise RuntimeError(f"{BACKEND_ENV}=cpu_kernel is for CPU tensors; use auto or triton on CUDA")
        return Backend.TORCH
    if backend is Backend.TRITON and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{BACKEND_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 "
                           "set before the process first imports the Triton kernels")
    return backend


def decode_attention_backend(q: torch.Tensor) -> Backend:
    """The implementation of decode attention on queries like `q`: TORCH, TRITON or CPU_KERNEL.

    CPU_KERNEL still runs the torch reference where the kernel cannot be built or does not
    handle the shapes (it logs a warning once), so picking it never fails a request.
    """
    backend = backend_for(q)
    if backend is Backend.TORCH:
        requested = requested_backend()
        if requested is Backend.CPU_KERNEL or (requested is Backend.AUTO and q.dtype in AUTO_CPU_KERNEL_DTYPES):
            return Backend.CPU_KERNEL
    return backend


def prepare_cpu_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """Load the compiled CPU kernels an engine on `device` in `dtype` would use (decode
    attention, the layer kernels): at start-up (building them if `make install` did not), never on a
    request's step. (The GEMV kernels load as the weights are packed for them.)"""
    if device.type != "cpu":
        return
    like_q = torch.empty(0, dtype=dtype, device="meta")  # a CPU tensor's choice, without one
    if decode_attention_backend(like_q) is Backend.CPU_KERNEL:
        load_extension()
    if dtype == torch.float32:
        layer_ops_cpu.load_extension()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k, v into their slots (meta.slot_mapping), rounded to the cache's dtype where it differs
    from theirs (to nearest even, as torch's conversion)."""
    if backend_for(k) is Backend.TRITON:
        if k.dtype != k_cache.dtype:
            # NOTE: cast here, not by the kernel's store: Triton's implicit conversion truncates
            # (its interpreter does), and the cache must hold what every other path stores.
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        if torch.compiler.is_compiling():  # traced: the custom op (triton_ops.py); eager: the kernel itself
            torch.ops.tandem.store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        from tandem.kernels.store_kv_triton import store_kv_triton
        store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a packed batch whose new K and V are already in the cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: q's dtype or the KV cache's own (read back in q's dtype)
    returns: [num_tokens, num_heads, head_dim]
    """
    num_decode = meta.num_decode_tokens
    decode_backend = decode_attention_backend(q)
    if decode_backend is Backend.TRITON and k_cache.dtype != q.dtype:
        # NOTE: the Triton attention kernels read a cache of q's dtype only: another (a float32
        # engine's bfloat16 KV) runs the torch reference, which casts. (The compiled CPU kernel
        # checks for itself: paged_decode_attention_cpu.supports.)
        decode_backend = Backend.TORCH
    if decode_backend is Backend.TRITON:
        # traced: the custom op (triton_ops.py); eager: the same function, without the op's dispatch
        attend = torch.ops.tandem.attention_triton if torch.compiler.is_compiling() else triton_ops.attention_triton
        return attend(q, k_cache, v_cache, num_decode, meta.decode_block_tables, meta.decode_context_lens,
                      meta.max_decode_context_len, meta.prefill_block_tables, meta.prefill_layout,
                      meta.max_prefill_query_len, scale)
    groups = meta.decode_groups or None
    decode = paged_decode_attention_cpu if decode_backend is Backend.CPU_KERNEL else paged_decode_attention_torch
    if meta.num_prefills == 0:
        return decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, groups)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = decode(
            q[:num_decode], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, groups)
    k, v = k[num_decode:], v[num_decode:]
    if k_cache.dtype != q.dtype:
        # NOTE: the chunk's own K and V as the cache holds them (rounded to its dtype), as every
        # later step reads them: else a token's output would depend on whether its keys were
        # computed in the same step (chunking, drafts), and so on the batch.
        k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
    out[num_decode:] = prefill_attention_torch(
        q[num_decode:], k, v, k_cache, v_cache,
        meta.prefill_query_starts, meta.prefill_query_lens,
        meta.prefill_context_lens, meta.prefill_block_tables, scale)
    return out


def int8_gemv(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 product ``x2 @ (qweight * scale[:, None]).T``.

    x2: [M, K] float16/bfloat16/float32; qweight: [N, K] int8; scale: [N] float32
    returns: [M, N] float32
    """
    if backend_for(x2) is Backend.TRITON:
        if torch.compiler.is_compiling():
            return torch.ops.tandem.int8_gemv_triton(x2, qweight, scale)
        from tandem.kernels.int8_gemv_triton import int8_gemv_triton
        return int8_gemv_triton(x2, qweight, scale)
    return int8_gemv_torch(x2, qweight, scale)


def int4_gemv(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """Weight-only int4 product ``x2 @ w.T``, ``w = q * scale + offset`` per group of columns.

    x2: [M, K] float16/bfloat16/float32; qweight: [N, K // 2] uint8 (low nibble first)
    scale, offset: [N, K // group_size] float16
    returns: [M, N] float32
    """
    if backend_for(x2) is Backend.TRITON:
        if torch.compiler.is_compiling():
            return torch.ops.tandem.int4_gemv_triton(x2, qweight, scale, offset, group_size)
        from tandem.kernels.int4_gemv_triton import int4_gemv_triton
        return int4_gemv_triton(x2, qweight, scale, offset, group_size)
    return int4_gemv_torch(x2, qweight, scale, offset, group_size)
