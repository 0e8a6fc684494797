"""Weight-only int8 GEMV: the Triton kernel and the torch reference against float64.

The expected values are computed independently: the weight dequantized in float64 and a
float64 matmul. The tolerance is the classic bound for a float32-accumulated dot product,
``|error| <= (K + c) * 2**-24 * sum_k |x_k| |w_k|`` elementwise (int8 values are exact in
every operand type, so nothing else is rounded): tight enough that a wrong mask, offset or
scale shows by orders of magnitude, loose enough never to flake on summation order.
"""

from __future__ import annotations

import pytest
import torch
from backends import TRITON_DEVICE, device_for

from tandem.kernels import ops
from tandem.kernels.int8_gemv import int8_gemv_torch
from tandem.kernels.int8_gemv_triton import int8_gemv_triton

U32 = 2.0 ** -24  # float32 unit roundoff


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    """-> x: [M, K] in dtype, qweight: [N, K] int8, scale: [N] float32."""
    gen = torch.Generator().manual_seed(seed + 1000 * m + 10 * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    return x.to(device), qweight.to(device), scale.to(device)


def check_close(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """out: [M, N] against the float64 product, within the float32-accumulation bound."""
    m, k = x.shape
    assert out.shape == (m, qweight.shape[0]) and out.dtype == torch.float32
    x64 = x.cpu().double()
    w64 = qweight.cpu().double() * scale.cpu().double()[:, None]  # [N, K]
    expected = x64 @ w64.t()
    # +8: the scale multiply and the sum of split-K partials, a few roundings each.
    bound = (x64.abs() @ w64.abs().t()) * ((k + 8) * U32) + 1e-30
    err = (out.cpu().double() - expected).abs()
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    assert (err <= bound).all(), f"max error {err.max():.3e}, worst error/bound {(err / bound).max():.2f}"


def run_triton(x, qweight, scale, split_k: int | None = None) -> torch.Tensor:
    # A NaN-filled output: an element the kernel does not write fails the check.
    out = torch.full((x.shape[0], qweight.shape[0]), float("nan"), device=x.device)
    return int8_gemv_triton(x, qweight, scale, split_k=split_k, out=out)


@pytest.mark.parametrize("m", [1, 3, 16], ids=lambda m: f"M{m}")  # FMA path (M <= 4) and tl.dot path
@pytest.mark.parametrize("n, k", [(72, 96), (96, 160), (40, 256)], ids=["N72-K96", "N96-K160", "N40-K256-even"])
def test_triton_matches_float64(m, n, k):
    x, qweight, scale = make_inputs(m, n, k, torch.float32, TRITON_DEVICE)
    check_close(run_triton(x, qweight, scale), x, qweight, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_triton_half_activations(dtype, m):
    x, qweight, scale = make_inputs(m, 96, 160, dtype, TRITON_DEVICE)
    check_close(run_triton(x, qweight, scale), x, qweight, scale)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_triton_split_k(split_k, m):
    """K = 700 in 384 + 316 columns (split 2) or 256 + 256 + 188 (split 3): each last split masked."""
    x, qweight, scale = make_inputs(m, 72, 700, torch.float32, TRITON_DEVICE)
    check_close(run_triton(x, qweight, scale, split_k=split_k), x, qweight, scale)


def test_triton_many_rows():
    """M = 70: two M tiles of the tl.dot path, the second one mostly masked."""
    x, qweight, scale = make_inputs(70, 40, 96, torch.float16, TRITON_DEVICE)
    check_close(run_triton(x, qweight, scale), x, qweight, scale)


@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_triton_strided_inputs(m):
    """A column-major x and a weight that is a column slice of a wider one."""
    x, qweight, scale = make_inputs(m, 72, 192, torch.float32, TRITON_DEVICE)
    x_t = x.t().contiguous().t()  # [M, K] with stride (1, M)
    wide = torch.zeros(72, 256, dtype=torch.int8, device=qweight.device)
    wide[:, 32:224] = qweight
    q_view = wide[:, 32:224]  # [N, K] with row stride 256
    check_close(run_triton(x_t, q_view, scale), x, qweight, scale)


def test_triton_empty():
    x, qweight, scale = make_inputs(0, 72, 96, torch.float32, TRITON_DEVICE)
    assert int8_gemv_triton(x, qweight, scale).shape == (0, 72)
    x, qweight, scale = make_inputs(3, 72, 0, torch.float32, TRITON_DEVICE)
    assert (int8_gemv_triton(x, qweight, scale) == 0).all()


def test_triton_rejects_mismatched_shapes():
    x, qweight, scale = make_inputs(1, 72, 96, torch.float32, TRITON_DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        int8_gemv_triton(x[:, :64], qweight, scale)
    with pytest.raises(TypeError, match="int8"):
        int8_gemv_triton(x, qweight.to(torch.uint8), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_torch_reference_matches_float64(dtype, m):
    x, qweight, scale = make_inputs(m, 96, 160, dtype, "cpu")
    check_close(int8_gemv_torch(x, qweight, scale), x, qweight, scale)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ops_dispatch(backend, monkeypatch):
    """ops.int8_gemv runs the implementation that backend_for picks, and its result is right."""
    import tandem.kernels.int8_gemv_triton as triton_module

    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    calls: list[str] = []
    real_triton, real_torch = triton_module.int8_gemv_triton, ops.int8_gemv_torch

    def counted(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call

    monkeypatch.setattr(triton_module, "int8_gemv_triton", counted("triton", real_triton))
    monkeypatch.setattr(ops, "int8_gemv_torch", counted("torch", real_torch))
    x, qweight, scale = make_inputs(3, 72, 96, torch.float32, device_for(backend))
    check_close(ops.int8_gemv(x, qweight, scale), x, qweight, scale)
    assert calls == [backend]
