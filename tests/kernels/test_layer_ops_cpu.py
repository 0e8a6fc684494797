"""The compiled CPU layer kernels (RMSNorm, the residual add with RMSNorm, RoPE with the KV
store into a float32 or bfloat16 cache, SwiGLU's product) against float64 definitions,
transformers' own RoPE and torch's bfloat16 rounding, and the model's choice of them (float32
CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tandem.kernels import layer_ops_cpu
from tandem.model import layer_ops

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def kernel():
    module = layer_ops_cpu.load_extension()
    assert module is not None, "make install builds it; a machine without a compiler runs torch's"
    return module


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (3, 5, 960), (2, 17), (4, 0)])
def test_rms_norm_matches_float64(kernel, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    out = kernel.rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == torch.float32
    expected = rms_norm64(x, weight, 1e-5)
    # A sum of H squares, a division, a square root and two products, each rounded in float32.
    bound = (shape[-1] + 8) * U32 * expected.abs() + 1e-30
    assert bool(((out.double() - expected).abs() <= bound).all())


def test_rms_norm_on_a_strided_input_and_the_model_path(kernel):
    x = torch.randn(4, 1152)[:, ::2]  # not contiguous
    weight = torch.randn(576)
    out = layer_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (576,), weight, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, kernel.rms_norm(x, weight, 1e-6), rtol=0, atol=0)


def test_add_rms_norm_adds_in_place_and_normalises(kernel):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, 576, generator=gen)
    delta = torch.randn(5, 1152, generator=gen)[:, :576]  # rows of a wider output
    weight = torch.randn(576, generator=gen)
    expected_h = h + delta  # torch's float32 add
    h_out, x = layer_ops.add_rms_norm(h, delta, weight, 1e-5, kernel)
    assert h_out is h  # the step's residual stream, added to in place
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
    expected = rms_norm64(h, weight, 1e-5)
    bound = (576 + 8) * U32 * expected.abs() + 1e-30
    assert bool(((x.double() - expected).abs() <= bound).all())


def rope_case(num_tokens: int, num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    num_blocks, block_size = 8, 4
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    meta = SimpleNamespace(slot_mapping=slots)  # all that the store reads of a step's metadata
    return qkv, cos, sin, k_cache, v_cache, meta


@pytest.mark.parametrize("path", ["kernel", "torch"])  # torch: the path of other dtypes and devices
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_rope_and_store_kv_is_transformers_rope_to_the_bit(kernel, num_tokens, path):
    qkv, cos, sin, k_cache, v_cache, meta = rope_case(num_tokens, seed=num_tokens)
    q_in, k_in, v_in = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    # transformers' apply_rotary_pos_emb on [batch, heads, tokens, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q_in.reshape(num_tokens, 9, 64).transpose(0, 1)[None],
                                        k_in.reshape(num_tokens, 3, 64).transpose(0, 1)[None], cos[None], sin[None])
    v_ref = v_in.reshape(num_tokens, 3, 64).clone()
    q, k, v = layer_ops.rope_and_store_kv(qkv, cos, sin, k_cache, v_cache, meta, 9, 3,
                                          kernel if path == "kernel" else None)
    if path == "kernel":
        assert q.data_ptr() == qkv.data_ptr()  # views of the projection's output, rotated in place
    torch.testing.assert_close(q, q_ref[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(k, k_ref[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    flat_k, flat_v = k_cache.view(-1, 3, 64), v_cache.view(-1, 3, 64)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[meta.slot_mapping], v, rtol=0, atol=0)
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[meta.slot_mapping] = False
    assert not flat_k[others].any() and not flat_v[others].any()  # no other slot written


def test_rope_stores_into_a_bfloat16_cache_as_torch_rounds(kernel):
    qkv, cos, sin, k_cache, v_cache, meta = rope_case(5, seed=11)
    qkv[0, 9 * 64 + 3] = float("nan")  # NaN stays NaN
    qkv[1, 9 * 64 + 5] = 1.0 + 2.0 ** -8  # a tie: to even
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    q, k, v = kernel.rope_store_kv(qkv, cos, sin, k16, v16, meta.slot_mapping, 9, 3)
    flat_k, flat_v = k16.view(-1, 3, 64), v16.view(-1, 3, 64)
    for stored, rows in ((flat_k, k), (flat_v, v)):  # bfloat16 -> float32 is exact: the values compared
        torch.testing.assert_close(stored[meta.slot_mapping].float(), rows.bfloat16().float(), rtol=0, atol=0,
                                   equal_nan=True)
    assert flat_k[meta.slot_mapping][0].isnan().sum() == 2  # the NaN and its rotation partner


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 40), (3, 2 * 5)])
def test_silu_mul_matches_float64(kernel, shape):
    gen = torch.Generator().manual_seed(shape[0])
    gate_up = torch.randn(*shape, generator=gen) * 8
    gate_up[0, :5] = torch.tensor([-200.0, 200.0, 0.0, -0.0, float("inf")])  # past exp's range both ways
    out = kernel.silu_mul(gate_up)
    g, u = gate_up.double().chunk(2, dim=-1)
    expected = torch.nn.functional.silu(g) * u
    assert out.shape == (shape[0], shape[1] // 2)
    assert out[0, 0] == 0 and out[0, 1] == 200 * gate_up[0, shape[1] // 2 + 1]  # silu(-200) = -0, silu(200) = 200
    assert out[0, 4] == expected[0, 4] and out[0, 4].isinf()  # silu(inf) = inf
    finite = expected.isfinite()
    # exp within ~1 ulp, then a division and a product each rounded: a few ulp of the result
    error = (out.double() - expected)[finite].abs()
    assert bool((error <= 6 * U32 * expected[finite].abs() + 1e-36).all())


def test_rope_and_store_kv_refuses_a_slot_outside_the_cache(kernel):
    qkv, cos, sin, k_cache, v_cache, _ = rope_case(2)
    with pytest.raises(RuntimeError, match="out of the cache"):
        kernel.rope_store_kv(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 32]), 9, 3)
    assert not k_cache.any()  # checked before anything is written


def test_other_dtypes_are_refused(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16(), 1e-5)
    assert not layer_ops_cpu.supports(torch.randn(2, 8).bfloat16(), torch.randn(8))
    assert layer_ops_cpu.kernels_for(torch.randn(2, 8).bfloat16()) is None


def test_it_loads_without_a_warning(kernel, fresh_kernel_state, caplog):
    """As in a fresh process that finds it built."""
    from tandem.kernels import cpu_build

    with caplog.at_level("INFO", logger=cpu_build.__name__):
        assert layer_ops_cpu.load_extension() is not None
    assert [r.getMessage() for r in caplog.records] == [
        "CPU layer kernels (RMSNorm, RoPE, SwiGLU) loaded (portable code)"]


def test_a_float32_cpu_model_takes_them(kernel, loaded):
    from tandem.model.llama import LlamaModel

    assert LlamaModel(loaded.config, loaded.weights, 64).layer_kernels is kernel
