"""A KV cache in another dtype than the activations' (bfloat16 under float32): the store rounds
to it, and decode and prefill attention read it back and compute in the activations' dtype,
equal (to float32's rounding) to float64 attention written from the definition over the
bfloat16-rounded keys and values."""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import naive_attention, paged, tolerance
from backends import BACKENDS, device_for

from tandem.kernels import layer_ops_cpu, ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.paged_decode_attention import paged_decode_attention_torch
from tandem.kernels.paged_decode_attention_cpu import paged_decode_attention_cpu
from tandem.kernels.prefill_attention import prefill_attention_torch
from tandem.kernels.store_kv import store_kv_torch
from tandem.model.layer_ops import rope_and_store_kv

BF16 = torch.bfloat16
HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 64, 16
F32 = tolerance(torch.float32)


def rounded(t: torch.Tensor) -> torch.Tensor:
    """What a bfloat16 cache holds of float32 ``t`` (round to nearest even), back in float32."""
    return t.to(BF16).float()


def _store_meta(slots: torch.Tensor) -> AttentionMetadata:
    """A step of len(slots) prefill tokens whose K and V go to `slots` (all store_kv reads)."""
    none = torch.zeros(0, 1, dtype=torch.int64, device=slots.device)
    return AttentionMetadata(slots, 0, none, torch.zeros(0, dtype=torch.int64), 0, (), (), (), none,
                             torch.zeros(0, 3, dtype=torch.int64))


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_the_store_rounds_to_the_cache_dtype(backend, monkeypatch):
    """Every path rounds to nearest even, as torch's conversion (Triton's own store truncates:
    ops.store_kv casts before it)."""
    gen = torch.Generator().manual_seed(0)
    device = device_for(backend)
    k, v = (torch.randn(9, KV_HEADS, DIM, generator=gen).to(device) for _ in range(2))
    k_cache, v_cache = (torch.zeros(4, BLOCK, KV_HEADS, DIM, dtype=BF16, device=device) for _ in range(2))
    slots = torch.tensor([3, 17, 18, 40, 41, 42, 60, 5, 0], device=device)
    if backend == "reference":
        store_kv_torch(k, v, k_cache, v_cache, slots)
    else:
        monkeypatch.setenv(ops.BACKEND_ENV, backend)
        ops.store_kv(k, v, k_cache, v_cache, _store_meta(slots))
    assert k_cache.dtype == BF16
    assert torch.equal(k_cache.view(-1, KV_HEADS, DIM)[slots].cpu(), k.to(BF16).cpu())
    assert torch.equal(v_cache.view(-1, KV_HEADS, DIM)[slots].cpu(), v.to(BF16).cpu())


def _decode_case(context_lens: list[int], seed: int):
    """-> (q float32, PagedCache of bfloat16 K/V, the float32 K/V those round, as lists)."""
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in context_lens]
    vs = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in context_lens]
    cache = paged([k.to(BF16) for k in ks], [v.to(BF16) for v in vs], 64, BLOCK, gen)
    q = torch.randn(len(context_lens), HEADS, DIM, generator=gen)
    return q, cache, ks, vs


def _decode_reference(q, ks, vs) -> torch.Tensor:
    """float64 attention of each query over its whole (bfloat16-rounded) context."""
    return torch.cat([naive_attention(q[i:i + 1], rounded(k), rounded(v), torch.tensor([k.shape[0] - 1]))
                      for i, (k, v) in enumerate(zip(ks, vs))])


# 3 sequences: one group; 11 of mixed lengths: grouped by length (GROUP_SIZE 8).
@pytest.mark.parametrize("context_lens", [[1, 17, 40], [5, 80, 3, 16, 33, 64, 2, 9, 48, 71, 30]])
@pytest.mark.parametrize("decode", [paged_decode_attention_torch, paged_decode_attention_cpu], ids=["torch", "cpu"])
def test_decode_attention_over_a_bf16_cache_is_float64_over_rounded_kv(context_lens, decode):
    q, cache, ks, vs = _decode_case(context_lens, seed=len(context_lens))
    out = decode(q, cache.k_cache, cache.v_cache, cache.block_tables(), torch.tensor(context_lens),
                 1 / math.sqrt(DIM))
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), _decode_reference(q, ks, vs), **F32)


def test_prefill_attention_over_a_bf16_cache_is_float64_over_rounded_kv():
    """Chunks with nothing cached (their own keys, rounded as the cache holds them), after a
    cached prefix, and one long: every key and value is read as the cache rounds it."""
    gen = torch.Generator().manual_seed(7)
    chunks = [(5, 5), (4, 20), (33, 33), (16, 50)]  # (query_len, context_len)
    ks = [torch.randn(c, KV_HEADS, DIM, generator=gen) for _, c in chunks]
    vs = [torch.randn(c, KV_HEADS, DIM, generator=gen) for _, c in chunks]
    cache = paged([k.to(BF16) for k in ks], [v.to(BF16) for v in vs], 64, BLOCK, gen)
    q_lens = [n for n, _ in chunks]
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen)
    # This step's own keys and values, in float32 as the projection gives them.
    k_new = torch.cat([k[c - n:] for k, (n, c) in zip(ks, chunks)])
    v_new = torch.cat([v[c - n:] for v, (n, c) in zip(vs, chunks)])
    starts = tuple(sum(q_lens[:i]) for i in range(len(chunks)))
    out = prefill_attention_torch(q, k_new, v_new, cache.k_cache, cache.v_cache, starts, tuple(q_lens),
                                  tuple(c for _, c in chunks), cache.block_tables(), 1 / math.sqrt(DIM))
    assert out.dtype == torch.float32
    expected = torch.cat([naive_attention(q[s:s + n], rounded(k), rounded(v), torch.arange(c - n, c))
                          for s, (n, c), k, v in zip(starts, chunks, ks, vs)])
    torch.testing.assert_close(out.double(), expected, **F32)


def _mixed_meta(cache, decode_lens: list[int], chunks: list[tuple[int, int]], seqs: list[int]) -> AttentionMetadata:
    """Decodes of sequences 0..len(decode_lens)-1, then prefill chunks of the sequences `seqs`."""
    tables = cache.block_tables()
    q_lens = [n for n, _ in chunks]
    starts = [sum(q_lens[:i]) for i in range(len(chunks))]
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=len(decode_lens),
        decode_block_tables=tables[:len(decode_lens)], decode_context_lens=torch.tensor(decode_lens),
        max_decode_context_len=max(decode_lens), prefill_query_starts=tuple(starts),
        prefill_query_lens=tuple(q_lens), prefill_context_lens=tuple(c for _, c in chunks),
        prefill_block_tables=tables[seqs], prefill_layout=torch.tensor(
            [(s, n, c) for s, (n, c) in zip(starts, chunks)], dtype=torch.int64).view(-1, 3))


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu_kernel", "triton"])
def test_ops_attention_over_a_bf16_cache_in_every_backend(backend, monkeypatch):
    """Decodes and a prefill chunk in one batch: each backend asked for gives float64's result
    over the rounded KV (auto and cpu_kernel: the CPU kernel or its torch fallback; triton: the
    torch reference, as the Triton kernels read a cache of q's dtype only)."""
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    lens = [12, 40, 3, 25]  # sequences 0, 1 decode; 2 and 3: prefill chunks of 3 and 9 tokens
    q_all, cache, ks, vs = _decode_case(lens, seed=11)
    chunks = [(3, 3), (9, 25)]
    gen = torch.Generator().manual_seed(12)
    q = torch.cat([q_all[:2], torch.randn(12, HEADS, DIM, generator=gen)])
    k_new = torch.cat([ks[2], ks[3][16:]])
    v_new = torch.cat([vs[2], vs[3][16:]])
    out = ops.attention(q, torch.cat([torch.zeros(2, KV_HEADS, DIM), k_new]),
                        torch.cat([torch.zeros(2, KV_HEADS, DIM), v_new]), cache.k_cache, cache.v_cache,
                        _mixed_meta(cache, lens[:2], chunks, [2, 3]), 1 / math.sqrt(DIM))
    expected = torch.cat([_decode_reference(q[:2], ks[:2], vs[:2]),
                          naive_attention(q[2:5], rounded(ks[2]), rounded(vs[2]), torch.arange(0, 3)),
                          naive_attention(q[5:], rounded(ks[3]), rounded(vs[3]), torch.arange(16, 25))])
    torch.testing.assert_close(out.double(), expected, **F32)


def test_rope_and_store_kv_stores_rounded_keys_into_a_bf16_cache():
    """The compiled layer kernel stores into a bfloat16 cache too: the same q, k and v as into a
    float32 one, to the bit, and the cache holds them rounded as torch rounds them; the torch
    path (no kernels) stores the same bytes."""
    kernels = layer_ops_cpu.load_extension()
    if kernels is None:
        pytest.skip("the compiled layer kernels cannot be built here")
    gen = torch.Generator().manual_seed(3)
    num_tokens = 7
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    angles = torch.rand(num_tokens, DIM // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.tensor([0, 1, 2, 19, 20, 33, 63])
    meta = _store_meta(slots)
    caches = {}
    outs = {}
    for name, dtype, with_kernels in (("f32", torch.float32, kernels), ("bf16", BF16, kernels), ("torch", BF16, None)):
        k_cache, v_cache = (torch.zeros(4, BLOCK, KV_HEADS, DIM, dtype=dtype) for _ in range(2))
        outs[name] = rope_and_store_kv(qkv.clone(), cos, sin, k_cache, v_cache, meta, HEADS, KV_HEADS, with_kernels)
        caches[name] = (k_cache, v_cache)
    for a, b in zip(outs["f32"], outs["bf16"]):
        assert b.dtype == torch.float32 and torch.equal(b, a)
    _, k, v = outs["bf16"]
    k_cache, v_cache = caches["bf16"]
    assert torch.equal(k_cache.view(-1, KV_HEADS, DIM)[slots], k.to(BF16))
    assert torch.equal(v_cache.view(-1, KV_HEADS, DIM)[slots], v.to(BF16))
    assert all(torch.equal(a, b) for a, b in zip(caches["bf16"], caches["torch"]))
