"""tandem's custom ops (torch.ops.tandem.*: the compiled CPU kernels and the Triton ones, as a
traced step calls them) against the direct kernel calls an eager step makes, on random inputs:
the same values bit for bit, each mutation declared (the KV store, the in-place RoPE and
residual add), and each fake implementation's shape, dtype and strides those of the real
output (torch.library.opcheck). Triton runs through its interpreter without a GPU."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import pytest
import torch
from backends import TRITON_DEVICE

from tandem.kernels import (
    f32_gemv_cpu,
    int4_gemv_cpu,
    int8_gemv_cpu,
    layer_ops_cpu,
    paged_decode_attention_cpu,
    triton_ops,
)
from tandem.model.int4 import quantize_int4
from tandem.model.quantization import quantize_int8

# NOTE: test_autograd_registration is left out: the ops are inference-only (no backward), and
# it asks for one on every op with float tensor inputs.
OPCHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def built(load: Callable[[], ModuleType | None]) -> ModuleType:
    """A compiled kernel's module (make install builds them; the other tests of each say so too)."""
    module = load()
    assert module is not None, "the CPU kernels are built by make install"
    return module


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def attention_case(device: str, num_seqs: int = 3, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    g = gen(seed)
    num_blocks, block_size = 8, 16
    cache = lambda: torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(device)  # noqa: E731
    return dict(q=torch.randn(num_seqs, num_heads, head_dim, generator=g).to(device), k_cache=cache(),
                v_cache=cache(), block_tables=torch.randperm(num_blocks, generator=g)[:num_seqs * 2].view(num_seqs, 2)
                .to(device), context_lens=torch.tensor([1, 17, 32][:num_seqs], device=device))


def same(op_out: Any, direct_out: Any, mutated: tuple[torch.Tensor, ...] = (),
         direct_mutated: tuple[torch.Tensor, ...] = ()) -> None:
    """The op's output and the tensors it mutated are the direct call's, bit for bit."""
    if direct_out is not None:
        torch.testing.assert_close(op_out, direct_out, rtol=0, atol=0)
    for a, b in zip(mutated, direct_mutated, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def check(op: Any, args: tuple[Any, ...]) -> None:
    torch.library.opcheck(op, args, test_utils=OPCHECKS)


def clone_all(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


CPU_CASES: dict[str, Callable[[], tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]]] = {}
"""name -> () -> (the op, the direct kernel call, its arguments, the positions of those it mutates)."""


def _cpu_case(f: Callable[[], tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]]) -> None:
    CPU_CASES[f.__name__] = f


@_cpu_case
def rms_norm() -> tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    g = gen(1)
    return (torch.ops.tandem.rms_norm_cpu, built(layer_ops_cpu.load_extension).rms_norm,
            (torch.randn(3, 576, generator=g), torch.randn(576, generator=g), 1e-5), ())


@_cpu_case
def add_rms_norm() -> tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    g = gen(2)
    return (torch.ops.tandem.add_rms_norm_cpu, built(layer_ops_cpu.load_extension).add_rms_norm,
            (torch.randn(3, 576, generator=g), torch.randn(3, 576, generator=g), torch.randn(576, generator=g), 1e-5),
            (0,))


@_cpu_case
def rope_store_kv() -> tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    g = gen(3)
    num_tokens, num_heads, num_kv_heads, head_dim = 3, 9, 3, 64
    cache = torch.zeros(8, 16, num_kv_heads, head_dim)
    args = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g),
            torch.randn(num_tokens, head_dim, generator=g), torch.randn(num_tokens, head_dim, generator=g),
            cache, cache.clone(), torch.tensor([5, 40, 127]), num_heads, num_kv_heads)
    return torch.ops.tandem.rope_store_kv_cpu, built(layer_ops_cpu.load_extension).rope_store_kv, args, (0, 3, 4)


@_cpu_case
def paged_decode_attention() -> tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    c = attention_case("cpu")
    module = built(paged_decode_attention_cpu.load_extension)
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], 0.125)
    return (torch.ops.tandem.paged_decode_attention_cpu,
            lambda *a: module.paged_decode_attention(*a, paged_decode_attention_cpu.MIN_SPLIT_TOKENS), args, ())


@_cpu_case
def int4_gemv() -> tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    g = gen(4)
    pack = int4_gemv_cpu.pack(*_int4_parts(quantize_int4(torch.randn(48, 576, generator=g))))
    return (torch.ops.tandem.int4_gemv_cpu, built(int4_gemv_cpu.load_extension).int4_gemv,
            (torch.randn(3, 576, generator=g), pack.values, pack.scale_offset, int4_gemv_cpu.has_int8_dot()), ())


@_cpu_case
def int8_gemv() -> tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    g = gen(5)
    w = quantize_int8(torch.randn(48, 576, generator=g))
    pack = int8_gemv_cpu.pack(w.qweight, w.scale)
    return (torch.ops.tandem.int8_gemv_cpu, built(int8_gemv_cpu.load_extension).int8_gemv,
            (torch.randn(3, 576, generator=g), pack.values, pack.scale, int4_gemv_cpu.has_int8_dot()), ())


@_cpu_case
def f32_gemv() -> tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    g = gen(6)
    return (torch.ops.tandem.f32_gemv_cpu, built(f32_gemv_cpu.load_extension).f32_gemv,
            (torch.randn(3, 576, generator=g), torch.randn(48, 576, generator=g)), ())


def _int4_parts(w: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return w.qweight, w.scale, w.offset


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_op_is_the_kernel(name: str) -> None:
    op, direct, args, mutated = CPU_CASES[name]()
    op_args, direct_args = clone_all(args), clone_all(args)
    op_out, direct_out = op(*op_args), direct(*direct_args)
    if op_out is None:  # rope_store_kv: its q, k, v are views of qkv, compared as qkv below
        direct_out = None
    same(op_out, direct_out, tuple(op_args[i] for i in mutated), tuple(direct_args[i] for i in mutated))
    check(op, clone_all(args))


def triton_cases(device: str) -> dict[str, tuple[Any, Callable[..., Any], tuple[Any, ...], tuple[int, ...]]]:
    """name -> (the op, the direct kernel call, its arguments, the positions of those it mutates)."""
    from tandem.kernels.int4_gemv_triton import int4_gemv_triton
    from tandem.kernels.int8_gemv_triton import int8_gemv_triton
    from tandem.kernels.store_kv_triton import store_kv_triton

    g = gen(6)
    c = attention_case(device, num_seqs=2)
    # q: [2 decodes + a prefill chunk of 3 tokens, num_heads, head_dim]; the chunk sees 20 tokens
    q = torch.randn(5, 4, 32, generator=g).to(device)
    prefill_tables = torch.tensor([[6, 7]], device=device)
    layout = torch.tensor([[0, 3, 20]], device=device)
    attention = (q, c["k_cache"], c["v_cache"], 2, c["block_tables"], c["context_lens"], 17, prefill_tables, layout, 3,
                 0.125)
    kv = torch.randn(2, 3, 2, 32, generator=g).to(device)  # (k, v): [3 tokens, num_kv_heads, head_dim]
    store = (kv[0], kv[1], c["k_cache"], c["v_cache"], torch.tensor([3, 100, 127], device=device))
    x = torch.randn(2, 64, generator=g).to(device)
    w8 = quantize_int8(torch.randn(32, 64, generator=g))
    w4 = quantize_int4(torch.randn(32, 64, generator=g))
    return {
        "attention": (torch.ops.tandem.attention_triton, triton_ops.attention_triton, attention, ()),
        "store_kv": (torch.ops.tandem.store_kv_triton, store_kv_triton, store, (2, 3)),
        "int8_gemv": (torch.ops.tandem.int8_gemv_triton, int8_gemv_triton,
                      (x, w8.qweight.to(device), w8.scale.to(device)), ()),
        "int4_gemv": (torch.ops.tandem.int4_gemv_triton, int4_gemv_triton,
                      (x, w4.qweight.to(device), w4.scale.to(device), w4.offset.to(device), w4.group_size), ()),
    }


@pytest.mark.parametrize("name", ["attention", "store_kv", "int8_gemv", "int4_gemv"])
def test_triton_op_is_the_kernel(name: str) -> None:
    op, direct, args, mutated = triton_cases(TRITON_DEVICE)[name]
    op_args, direct_args = clone_all(args), clone_all(args)
    same(op(*op_args), direct(*direct_args), tuple(op_args[i] for i in mutated),
         tuple(direct_args[i] for i in mutated))
    check(op, clone_all(args))
