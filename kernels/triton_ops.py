"""The Triton kernels of a step as torch custom ops, so that a traced step (torch.compile,
torch.export; a CUDA graph's capture later) holds each as a node of its one graph: dynamo
cannot look inside a Triton launch, and without an op it breaks the graph there.

ops.py calls the ops only while tracing (torch.compiler.is_compiling()); an eager step calls
the same functions directly and skips the op's dispatch (several us a call, on a step that is
mostly launches). The Triton modules are imported in the ops' bodies, as ops.py does, so that
registering them needs no Triton.
"""

from __future__ import annotations

import torch


def attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_decode: int,
                     decode_block_tables: torch.Tensor, decode_context_lens: torch.Tensor,
                     max_decode_context_len: int, prefill_block_tables: torch.Tensor, prefill_layout: torch.Tensor,
                     max_prefill_query_len: int, scale: float) -> torch.Tensor:
    """Decode attention for the first num_decode tokens, prefill attention for the rest.

    q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    returns: [num_tokens, num_heads, head_dim]
    """
    from tandem.kernels.paged_decode_attention_triton import paged_decode_attention_triton
    from tandem.kernels.prefill_attention_triton import prefill_attention_triton

    out = torch.empty_like(q)
    # Both kernels write disjoint rows of `out`; the prefill layout's starts are relative to
    # the prefill tokens, hence the offset views.
    paged_decode_attention_triton(q[:num_decode], k_cache, v_cache, decode_block_tables, decode_context_lens, scale,
                                  max_decode_context_len, out=out[:num_decode])
    prefill_attention_triton(q[num_decode:], k_cache, v_cache, prefill_block_tables, prefill_layout,
                             max_prefill_query_len, scale, out=out[num_decode:])
    return out


@torch.library.custom_op("tandem::attention_triton", mutates_args=())
def _attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_decode: int,
                  decode_block_tables: torch.Tensor, decode_context_lens: torch.Tensor, max_decode_context_len: int,
                  prefill_block_tables: torch.Tensor, prefill_layout: torch.Tensor, max_prefill_query_len: int,
                  scale: float) -> torch.Tensor:
    return attention_triton(q, k_cache, v_cache, num_decode, decode_block_tables, decode_context_lens,
                            max_decode_context_len, prefill_block_tables, prefill_layout, max_prefill_query_len, scale)


@_attention_op.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_decode: int,
      decode_block_tables: torch.Tensor, decode_context_lens: torch.Tensor, max_decode_context_len: int,
      prefill_block_tables: torch.Tensor,
      prefill_layout: torch.Tensor, max_prefill_query_len: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("tandem::store_kv_triton", mutates_args=("k_cache", "v_cache"))
def _store_kv_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    from tandem.kernels.store_kv_triton import store_kv_triton
    store_kv_triton(k, v, k_cache, v_cache, slot_mapping)


@_store_kv_op.register_fake
def _(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      slot_mapping: torch.Tensor) -> None:
    return None


@torch.library.custom_op("tandem::int8_gemv_triton", mutates_args=())
def _int8_gemv_op(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from tandem.kernels.int8_gemv_triton import int8_gemv_triton
    return int8_gemv_triton(x2, qweight, scale)


@_int8_gemv_op.register_fake
def _(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x2: [M, K]; qweight: [N, K] -> [M, N] float32
    return x2.new_empty((x2.shape[0], qweight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tandem::int4_gemv_triton", mutates_args=())
def _int4_gemv_op(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    from tandem.kernels.int4_gemv_triton import int4_gemv_triton
    return int4_gemv_triton(x2, qweight, scale, offset, group_size)


@_int4_gemv_op.register_fake
def _(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
      group_size: int) -> torch.Tensor:
    # x2: [M, K]; qweight: [N, K // 2] -> [M, N] float32
    return x2.new_empty((x2.shape[0], qweight.shape[0]), dtype=torch.float32)
