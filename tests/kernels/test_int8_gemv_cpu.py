"""tandem's compiled CPU int8 kernel against float64 products with the dequantized weight, and
the int8 product's choice of it (float32 rows on the CPU, up to GEMV_MAX_TOKENS)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import int8_gemv_cpu as cpu_int8
from tandem.model import quantization
from tandem.model.quantization import int8_matmul, quantize_int8

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def kernel():
    module = cpu_int8.load_extension()
    assert module is not None, "make install builds it; a machine without a compiler runs torch's kernel"
    return module


@pytest.mark.parametrize("num_rows", [1, 2, 7, 8, 9, 17])  # one pass of up to 8 rows, and several
@pytest.mark.parametrize("out_features, in_features", [(48, 576), (960, 576), (32, 1540)])
def test_matches_float64(kernel, num_rows, out_features, in_features):
    gen = torch.Generator().manual_seed(num_rows * 100 + out_features)
    w = quantize_int8(torch.randn(out_features, in_features, generator=gen)
                      * torch.logspace(-3, 0, out_features)[:, None])
    x = torch.randn(num_rows, in_features, generator=gen)
    out = w.gemv_pack.matmul(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, out_features)
    weight = w.dequantize(torch.float64)
    expected = x.double() @ weight.T
    bound = (in_features + 2) * U32 * (x.double().abs() @ weight.abs().T)  # K float32 roundings, then the scale
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    assert float((error / bound).max()) > 1e-4, "not vacuous: float32 rounding shows somewhere"


def test_bad_shapes_are_refused(kernel):
    w = quantize_int8(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="float32"):
        w.gemv_pack.matmul(torch.randn(2, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x has 60 columns, the weight 64"):
        w.gemv_pack.matmul(torch.randn(2, 60))


def test_the_product_takes_it_for_float32_cpu_rows_only(kernel):
    w = quantize_int8(torch.randn(32, 64))
    x = torch.randn(3, 64)
    assert quantization.uses_gemv(x, w)
    assert not quantization.uses_gemv(x.bfloat16(), w)
    assert not quantization.uses_gemv(torch.randn(quantization.GEMV_MAX_TOKENS + 1, 64), w)
    assert not quantization.uses_gemv(x, quantize_int8(torch.randn(40, 64)))  # not 16 channels a block
    torch.testing.assert_close(int8_matmul(x, w), w.gemv_pack.matmul(x), rtol=0, atol=0)


def test_without_the_kernel_torchs_runs(no_compiler, caplog):
    w = quantize_int8(torch.randn(32, 64))
    x = torch.randn(2, 64)
    assert not quantization.uses_gemv(x, w)
    torch.testing.assert_close(int8_matmul(x, w), x @ w.dequantize().T, rtol=0.02, atol=0.05)
    assert any("CPU int8 kernel unavailable" in r.getMessage() for r in caplog.records)
