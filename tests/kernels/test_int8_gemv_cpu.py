"""tandem's compiled CPU int8 kernel against float64 products with the dequantized weight, and
the int8 product's choice of it (float32 rows on the CPU, up to GEMV_MAX_TOKENS)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.kernels import int4_gemv_cpu
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


@pytest.mark.skipif(not int4_gemv_cpu.has_int8_dot(), reason="8-bit activations need AVX-512 VNNI")
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("out_features, in_features", [(48, 576), (960, 576), (32, 1536)])
def test_int8_activations_match_their_float64_definition(kernel, num_rows, out_features, in_features):
    """Each group of 32 activations rounded to d * round(x / d), d = max |x| / 127 (float32, as
    the kernel takes them), times the int8 weight, in float64; the kernel's integer sums are
    exact (its weights read as w + 128, that term taken off per row), float32 rounding aside."""
    gen = torch.Generator().manual_seed(num_rows * 100 + out_features)
    w = quantize_int8(torch.randn(out_features, in_features, generator=gen)
                      * torch.logspace(-3, 0, out_features)[:, None])
    x = torch.randn(num_rows, in_features, generator=gen) * torch.rand(in_features, generator=gen) * 4
    x[0, 64:96] = 0.0  # an all-zero group: scale 0
    out = dataclasses.replace(w.gemv_pack, int8_activations=True).matmul(x)
    groups = x.view(num_rows, -1, 32)
    d = groups.abs().amax(-1) / 127
    q = torch.round(groups * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))[..., None])
    rounded = (q.double() * d.double()[..., None]).view_as(x)
    weight = w.dequantize(torch.float64)
    expected = rounded @ weight.T
    # the w + 128 term and its removal: float32 rounding on sums ~256 times the weights' magnitude
    bound = 4 * in_features * U32 * (rounded.abs() @ (weight.abs() + 128 * w.scale.double()[:, None]).T) + 1e-6
    assert bool(((out.double() - expected).abs() <= bound).all())
    assert float((out.double() - x.double() @ weight.T).abs().max()) > 1e-4  # rounded: not the float32 product
    odd = quantize_int8(torch.randn(32, 100, generator=gen))  # 100 columns: not in groups of 32
    with pytest.raises(RuntimeError, match="groups of 32"):
        dataclasses.replace(odd.gemv_pack, int8_activations=True).matmul(torch.randn(1, 100))


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
