"""The compiled CPU paged decode attention kernel against float64 attention from the definition,
its fallback to the torch reference when it cannot be built, and the dispatch that picks it."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from attention_reference import naive_attention, paged, tolerance

from tandem.kernels import cpu_build, ops
from tandem.kernels import paged_decode_attention_cpu as cpu_kernel
from tandem.kernels.paged_decode_attention import paged_decode_attention_torch

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel():
    """The compiled module (built once per machine, then cached); skips where no compiler is."""
    module = cpu_kernel.load_extension()
    if module is None:
        pytest.skip("the CPU kernel cannot be built here (the fallback is tested below)")
    return module


def check(num_heads: int, num_kv_heads: int, context_lens: list[int], dtype: torch.dtype, block_size: int,
          seed: int, head_dim: int = 64) -> None:
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in context_lens]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in context_lens]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 4
    cache = paged(ks, vs, num_blocks, block_size, gen)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int64)
    out = cpu_kernel.paged_decode_attention_cpu(q, cache.k_cache, cache.v_cache, cache.block_tables(), lens,
                                                1 / math.sqrt(head_dim))
    assert out.shape == q.shape and out.dtype == dtype
    for i, n in enumerate(context_lens):
        expected = naive_attention(q[i:i + 1], ks[i], vs[i], torch.tensor([n - 1]))
        torch.testing.assert_close(out[i:i + 1].double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 3), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("batch", [1, 8])
def test_random_ragged_batches(kernel, dtype, block_size, num_heads, num_kv_heads, batch):
    seed = block_size * 1000 + num_heads * 10 + batch
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(batch)]
    if batch > 1:
        lens[:3] = [1, block_size, block_size + 1]  # a single token and both sides of a block edge
    check(num_heads, num_kv_heads, lens, dtype, block_size, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_long_context_split_across_threads(kernel, dtype, threads):
    """At batch 1 the context is cut into partials merged by log-sum-exp (with 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(9, 3, [1000], dtype, 16, seed=7)
        check(8, 2, [777, 5], dtype, 8, seed=8)
    finally:
        torch.set_num_threads(before)


def test_a_sequence_gives_the_same_bits_alone_and_in_a_batch(kernel):
    """Where a context is cut depends on its own length only, not on its batch."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(2, 200, 16, 3, 64, generator=gen).unbind(0)
    tables = torch.randperm(200, generator=gen)[:8 * 25].view(8, 25)
    lens = torch.tensor([400, 3, 77, 250, 129, 16, 1, 390])
    q = torch.randn(8, 9, 64, generator=gen)
    batch = cpu_kernel.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.125)
    for i in (0, 3, 6):
        alone = cpu_kernel.paged_decode_attention_cpu(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1],
                                                      0.125)
        assert torch.equal(alone[0], batch[i])


def test_head_dim_128_and_a_view_of_the_pool(kernel):
    """The engine's caches are views of one pool [layers, 2, blocks, block, kv_heads, dim]."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 2, 12, 16, 2, 128, generator=gen)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    tables = torch.tensor([[5, 2, 9, 0], [11, 3, 0, 0]])
    lens = torch.tensor([50, 20])
    q = torch.randn(2, 8, 128, generator=gen)
    out = cpu_kernel.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 128 ** -0.5)
    expected = paged_decode_attention_torch(q.double(), k_cache.double(), v_cache.double(), tables, lens, 128 ** -0.5)
    torch.testing.assert_close(out.double(), expected, **tolerance(torch.float32))


def test_an_empty_context_gives_zeros(kernel):
    k_cache = torch.randn(4, 16, 1, 64)
    out = cpu_kernel.paged_decode_attention_cpu(torch.randn(2, 2, 64), k_cache, k_cache.clone(),
                                                torch.tensor([[1], [2]]), torch.tensor([0, 3]), 0.125)
    assert torch.equal(out[0], torch.zeros(2, 64)) and out[1].isfinite().all()


def test_unsupported_dtype_runs_the_torch_reference(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "load_extension", lambda: pytest.fail("float16 must not reach the kernel"))
    check(4, 2, [3, 40], torch.float16, 16, seed=1)


def test_failed_build_falls_back_to_torch_with_one_warning(empty_kernel_cache, monkeypatch, caplog):
    """As in a fresh process on a machine where `make install` could not build it."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        check(9, 3, [1, 30, 100], torch.float32, 16, seed=2)
        check(9, 3, [64], torch.bfloat16, 8, seed=3)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "falls back to the torch reference" in warnings[0].getMessage()
    assert "Ninja is required" in warnings[0].getMessage()
    assert not cpu_kernel.available()


@pytest.mark.parametrize("setting, dtype, expected", [
    ("auto", torch.float32, ops.Backend.CPU_KERNEL),
    ("auto", torch.bfloat16, ops.Backend.CPU_KERNEL),
    ("auto", torch.float16, ops.Backend.TORCH),
    ("cpu_kernel", torch.float16, ops.Backend.CPU_KERNEL),
    ("torch", torch.float32, ops.Backend.TORCH),
])
def test_dispatch_on_cpu_tensors(monkeypatch, setting, dtype, expected):
    monkeypatch.setenv(ops.BACKEND_ENV, setting)
    q = torch.empty(0, dtype=dtype)
    assert ops.decode_attention_backend(q) is expected
    assert ops.backend_for(q) is ops.Backend.TORCH  # the other ops keep their torch paths
