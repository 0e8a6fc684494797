"""tandem's compiled CPU int4 kernel against float64 products with the dequantized weight, and
the int4 product's choice of it (float32 decode-sized products only, torch's kernel otherwise)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.kernels import int4_gemv_cpu as cpu_int4
from tandem.model import int4_matmul as int4_paths
from tandem.model.int4 import quantize_int4

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def kernel():
    module = cpu_int4.load_extension()
    assert module is not None, "make install builds it; a machine without a compiler runs torch's kernel"
    return module


@pytest.mark.parametrize("num_rows", [1, 2, 7, 8, 9, 17])  # one block of up to 8 rows, and several
@pytest.mark.parametrize("out_features, in_features, group_size", [(48, 576, 32), (960, 576, 32), (32, 1536, 32)])
def test_matches_float64(kernel, num_rows, out_features, in_features, group_size):
    gen = torch.Generator().manual_seed(num_rows * 100 + out_features)
    w = quantize_int4(torch.randn(out_features, in_features, generator=gen), group_size)
    x = torch.randn(num_rows, in_features, generator=gen)
    out = w.gemv_pack.matmul(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, out_features)
    expected = x.double() @ w.dequantize(torch.float64).T
    scale = w.scale.double().repeat_interleave(group_size, dim=1)
    offset = w.offset.double().repeat_interleave(group_size, dim=1)
    bound = (in_features + 4) * U32 * (x.double().abs() @ (w.unpacked().double() * scale + offset.abs()).T)
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())


def q8_reference(x: torch.Tensor, w) -> torch.Tensor:
    """The product with 8-bit activations as int4_q8_gemv_cpu.h defines it, in float64: each
    group of 32 activations rounded to d * round(x / d), d = max |x| / 127 (both in float32, as
    the kernel takes them), times the weight's scaled values; plus each group's offset times the
    float32 activations' exact sum."""
    groups = x.view(x.shape[0], -1, 32)
    d = groups.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    rounded = (torch.round(groups * inv[..., None]).double() * d.double()[..., None]).view_as(x)
    scale = w.scale.double().repeat_interleave(32, dim=1)
    offset = w.offset.double().repeat_interleave(32, dim=1)
    return rounded @ (w.unpacked().double() * scale).T + x.double() @ offset.T


int8_dot = pytest.mark.skipif(not cpu_int4.has_int8_dot(), reason="8-bit activations need AVX-512 VNNI")


@int8_dot
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("out_features, in_features", [(48, 576), (960, 576), (32, 1536)])
def test_int8_activations_match_their_float64_definition(kernel, num_rows, out_features, in_features):
    gen = torch.Generator().manual_seed(num_rows * 100 + out_features)
    w = quantize_int4(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(num_rows, in_features, generator=gen) * torch.rand(in_features, generator=gen) * 4
    x[0, 64:96] = 0.0  # an all-zero group: scale 0, nothing divided by it
    out = dataclasses.replace(w.gemv_pack, int8_activations=True).matmul(x)
    expected = q8_reference(x, w)
    # The integer dot products are exact; what is left is float32 rounding of a few terms a group.
    scale = w.scale.double().repeat_interleave(32, dim=1)
    offset = w.offset.double().repeat_interleave(32, dim=1)
    bound = 64 * U32 * (x.double().abs() @ (w.unpacked().double() * scale + offset.abs()).T) + 1e-6
    assert bool(((out.double() - expected).abs() <= bound).all())
    # And the rounding's cost against the exact product: each activation off by at most d / 2.
    d = x.view(num_rows, -1, 32).abs().amax(-1).double().repeat_interleave(32, dim=1) / 127
    rounding = (d / 2) @ (w.unpacked().double() * scale).abs().T
    exact = x.double() @ w.dequantize(torch.float64).T
    assert bool(((out.double() - exact).abs() <= rounding + bound).all())
    assert float((out.double() - exact).abs().max()) > 1e-3  # rounded indeed: not the float32 product


def test_int8_activations_are_refused_without_vnni_or_taken_with_it(kernel):
    w = quantize_int4(torch.randn(64, 128))
    pack = dataclasses.replace(w.gemv_pack, int8_activations=True)
    if cpu_int4.has_int8_dot():
        assert pack.matmul(torch.randn(2, 128)).shape == (2, 64)
    else:
        with pytest.raises(RuntimeError, match="no 8-bit dot products"):
            pack.matmul(torch.randn(2, 128))


def test_a_strided_activation_is_taken(kernel):
    w = quantize_int4(torch.randn(64, 128))
    x = torch.randn(3, 256)[:, ::2]  # not contiguous
    torch.testing.assert_close(w.gemv_pack.matmul(x),
                               x @ w.dequantize().T, rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused(kernel):
    w = quantize_int4(torch.randn(64, 128))
    with pytest.raises(RuntimeError, match="float32"):
        w.gemv_pack.matmul(torch.randn(2, 128).bfloat16())
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 128"):
        w.gemv_pack.matmul(torch.randn(2, 64))


def test_the_product_picks_it_for_float32_decode_rows_only(kernel):
    w = quantize_int4(torch.randn(64, 128))
    assert int4_paths.choose_path(1, w, torch.float32) == int4_paths.GEMV_F32
    assert int4_paths.choose_path(int4_paths.GEMV_MAX_TOKENS, w, torch.float32) == int4_paths.GEMV_F32
    assert int4_paths.choose_path(int4_paths.GEMV_MAX_TOKENS + 1, w, torch.float32) != int4_paths.GEMV_F32
    assert int4_paths.choose_path(1, w, torch.bfloat16) == int4_paths.KERNEL
    assert int4_paths.choose_path(1, quantize_int4(torch.randn(64, 128), 64), torch.float32) == int4_paths.KERNEL
    assert int4_paths.choose_path(1, quantize_int4(torch.randn(40, 96)), torch.float32) != int4_paths.GEMV_F32


def test_without_the_kernel_torchs_runs(no_compiler, caplog):
    """As on a machine where it cannot be built: one warning, torch's kernel, same values."""
    w = quantize_int4(torch.randn(64, 128))
    x = torch.randn(2, 128)
    assert int4_paths.choose_path(1, w, torch.float32) == int4_paths.KERNEL
    torch.testing.assert_close(int4_paths.int4_matmul(x, w), x @ w.dequantize().T, rtol=0.05, atol=0.3)
    assert any("CPU int4 kernel unavailable" in r.getMessage() for r in caplog.records)
