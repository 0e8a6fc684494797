"""The compiled CPU RMSNorm against a float64 RMSNorm from the definition, and the model's
choice of it (float32 CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import rms_norm_cpu
from tandem.model.llama import rms_norm

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def kernel():
    module = rms_norm_cpu.load_extension()
    assert module is not None, "make install builds it; a machine without a compiler runs torch's"
    return module


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (3, 5, 960), (2, 17), (4, 0)])
def test_matches_float64(kernel, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    out = rms_norm_cpu.rms_norm_cpu(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == torch.float32
    x64 = x.double()
    expected = weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))
    # A sum of H squares, a division, a square root and two products, each rounded in float32.
    bound = (shape[-1] + 8) * U32 * expected.abs() + 1e-30
    assert bool(((out.double() - expected).abs() <= bound).all())


def test_a_strided_input_and_the_model_path(kernel):
    x = torch.randn(4, 1152)[:, ::2]  # not contiguous
    weight = torch.randn(576)
    out = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (576,), weight, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, rms_norm_cpu.rms_norm_cpu(x, weight, 1e-6), rtol=0, atol=0)


def test_other_dtypes_are_refused(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        rms_norm_cpu.rms_norm_cpu(torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16(), 1e-5)
    assert not rms_norm_cpu.supports(torch.randn(2, 8).bfloat16(), torch.randn(8))


def test_it_loads_without_a_warning(kernel, fresh_kernel_state, caplog):
    """As in a fresh process that finds it built."""
    from tandem.kernels import cpu_build

    with caplog.at_level("INFO", logger=cpu_build.__name__):
        assert rms_norm_cpu.load_extension() is not None
    assert [r.getMessage() for r in caplog.records] == ["CPU RMSNorm kernel loaded (portable code)"]
