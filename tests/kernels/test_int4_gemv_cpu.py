"""tandem's compiled CPU int4 kernel against float64 products with the dequantized weight, and
the int4 product's choice of it (float32 decode-sized products only, torch's kernel otherwise)."""

from __future__ import annotations

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
