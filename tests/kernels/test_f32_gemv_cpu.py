"""tandem's compiled CPU float32 product kernel against float64 products, and ``linear``'s choice
of it (a few float32 CPU rows, a weight of 16-multiple sides; F.linear everywhere else)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import f32_gemv_cpu
from tandem.model.quantization import linear

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def kernel():
    module = f32_gemv_cpu.load_extension()
    assert module is not None, "make install builds it; a machine without a compiler runs F.linear"
    return module


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8])  # each row group's number of channels at a time
@pytest.mark.parametrize("out_features, in_features", [(48, 576), (960, 576), (32, 1536)])
def test_matches_float64(kernel, num_rows, out_features, in_features):
    gen = torch.Generator().manual_seed(num_rows * 100 + out_features)
    w = torch.randn(out_features, in_features, generator=gen) * torch.logspace(-3, 0, out_features)[:, None]
    x = torch.randn(num_rows, in_features, generator=gen)
    out = f32_gemv_cpu.matmul(x, w)
    assert out.dtype == torch.float32 and out.shape == (num_rows, out_features)
    expected = x.double() @ w.double().T
    bound = (in_features + 1) * U32 * (x.double().abs() @ w.double().abs().T)  # K float32 roundings
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    assert float((error / bound).max()) > 1e-4, "not vacuous: float32 rounding shows somewhere"


def test_bad_shapes_are_refused(kernel):
    with pytest.raises(RuntimeError, match="x has 48 columns, the weight 64"):
        f32_gemv_cpu.matmul(torch.randn(2, 48), torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="multiples of 16"):
        f32_gemv_cpu.matmul(torch.randn(2, 64), torch.randn(40, 64))


def test_linear_takes_it_for_a_few_float32_cpu_rows_only(kernel):
    w, bias = torch.randn(32, 64), torch.randn(32)
    x = torch.randn(3, 64)
    assert f32_gemv_cpu.uses_kernel(x, w)
    assert not f32_gemv_cpu.uses_kernel(torch.randn(f32_gemv_cpu.MAX_TOKENS + 1, 64), w)  # sgemm reads it once
    assert not f32_gemv_cpu.uses_kernel(x.bfloat16(), w.bfloat16())
    assert not f32_gemv_cpu.uses_kernel(x, torch.randn(40, 64))  # not 16 channels a block
    torch.testing.assert_close(linear(x, w, bias), f32_gemv_cpu.matmul(x, w) + bias, rtol=0, atol=0)
    x3 = torch.randn(1, 3, 64)  # [batch, tokens, in]: the rows of all
    torch.testing.assert_close(linear(x3, w), f32_gemv_cpu.matmul(x3[0], w)[None], rtol=0, atol=0)


def test_without_the_kernel_f_linear_runs(no_compiler, caplog):
    w, x = torch.randn(32, 64), torch.randn(2, 64)
    assert not f32_gemv_cpu.uses_kernel(x, w)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=0, atol=0)
    assert any("CPU float32 product kernel unavailable" in r.getMessage() for r in caplog.records)
