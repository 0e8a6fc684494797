"""Weight-only int4 GEMV: the Triton kernel and the torch reference against float64.

The expected values are computed independently: the 0..15 values are drawn first and
packed here (column 2j in the low nibble), then dequantized from those values in float64
and multiplied in float64. The tolerance is the bound for a float32-accumulated dot
product, ``(K + c) * 2**-24 * sum_k |x_k| (q_k s + |o|)`` elementwise (``q s + |o|`` bounds
the dequantized weight before the cancellation of ``q s + o``), plus, where the kernel's
tl.dot path rounds the dequantized weight to float16/bfloat16 (M > FMA_MAX_M), that
dtype's unit roundoff.
"""

from __future__ import annotations

import pytest
import torch
from backends import TRITON_DEVICE, device_for

from tandem.kernels import ops
from tandem.kernels.int4_gemv import int4_gemv_torch
from tandem.kernels.int4_gemv_triton import int4_gemv_triton
from tandem.kernels.int8_gemv_triton import FMA_MAX_M

U32 = 2.0 ** -24  # float32 unit roundoff
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}

# (N, K, G): groups smaller than a step (several runs per step, K masked or even), a group
# that is not a power of two (padded runs), a group of whole steps, and one larger than a
# step but not a multiple of it.
SHAPES = [(72, 96, 32), (96, 160, 32), (40, 512, 64), (24, 144, 48), (24, 384, 128), (16, 384, 192)]
SHAPE_IDS = ["N72-K96-G32", "N96-K160-G32", "N40-K512-G64-even", "N24-K144-G48", "N24-K384-G128", "N16-K384-G192"]


def make_inputs(m: int, n: int, k: int, group_size: int, dtype: torch.dtype, device: str, seed: int = 0):
    """-> (x [M, K], q [N, K] int64 0..15, packed [N, K // 2] uint8, scale, offset [N, K // G] float16)."""
    gen = torch.Generator().manual_seed(seed + 1000 * m + 10 * n + k + group_size)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q = torch.randint(0, 16, (n, k), generator=gen)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    groups = k // group_size
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half()
    # Offsets near -7.5 * scale, as min/max quantization of centred weights gives.
    offset = (-7.5 * scale.float() * (1 + 0.2 * torch.randn(n, groups, generator=gen))).half()
    return x.to(device), q, packed.to(device), scale.to(device), offset.to(device)


def check_close(out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                group_size: int, weight_roundoff: float = 0.0) -> None:
    """out: [M, N] against the float64 product, within the float32-accumulation bound."""
    m, k = x.shape
    assert out.shape == (m, q.shape[0]) and out.dtype == torch.float32
    x64 = x.cpu().double()
    s64 = scale.cpu().double().repeat_interleave(group_size, dim=1)  # [N, K]
    o64 = offset.cpu().double().repeat_interleave(group_size, dim=1)  # [N, K]
    expected = x64 @ (q.double() * s64 + o64).t()
    magnitude = x64.abs() @ (q.double() * s64 + o64.abs()).t()
    # +8: the dequantizing FMA and the sum of split-K partials, a few roundings each.
    bound = magnitude * ((k + 8) * U32 + weight_roundoff) + 1e-30
    err = (out.cpu().double() - expected).abs()
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    assert (err <= bound).all(), f"max error {err.max():.3e}, worst error/bound {(err / bound).max():.2f}"


def run_triton(x, packed, scale, offset, group_size, split_k: int | None = None) -> torch.Tensor:
    # A NaN-filled output: an element the kernel does not write fails the check.
    out = torch.full((x.shape[0], packed.shape[0]), float("nan"), device=x.device)
    return int4_gemv_triton(x, packed, scale, offset, group_size, split_k=split_k, out=out)


def kernel_roundoff(m: int, dtype: torch.dtype) -> float:
    """The tl.dot path (M > FMA_MAX_M) rounds the dequantized weight to the activations' dtype."""
    return UNIT_ROUNDOFF[dtype] if m > FMA_MAX_M else 0.0


@pytest.mark.parametrize("m", [1, 3, 16], ids=lambda m: f"M{m}")  # FMA path (M <= 4) and tl.dot path
@pytest.mark.parametrize("n, k, group_size", SHAPES, ids=SHAPE_IDS)
def test_triton_matches_float64(m, n, k, group_size):
    x, q, packed, scale, offset = make_inputs(m, n, k, group_size, torch.float32, TRITON_DEVICE)
    check_close(run_triton(x, packed, scale, offset, group_size), x, q, scale, offset, group_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_triton_half_activations(dtype, m):
    x, q, packed, scale, offset = make_inputs(m, 96, 160, 32, dtype, TRITON_DEVICE)
    check_close(run_triton(x, packed, scale, offset, 32), x, q, scale, offset, 32, kernel_roundoff(m, dtype))


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_triton_split_k(split_k, m):
    """K = 1344 in 768 + 576 columns (split 2) or 512 + 512 + 320 (split 3): each last split masked."""
    x, q, packed, scale, offset = make_inputs(m, 40, 1344, 32, torch.float32, TRITON_DEVICE)
    check_close(run_triton(x, packed, scale, offset, 32, split_k=split_k), x, q, scale, offset, 32)


def test_triton_many_rows():
    """M = 70: two M tiles of the tl.dot path, the second one mostly masked."""
    x, q, packed, scale, offset = make_inputs(70, 40, 96, 32, torch.float16, TRITON_DEVICE)
    check_close(run_triton(x, packed, scale, offset, 32), x, q, scale, offset, 32,
                kernel_roundoff(70, torch.float16))


@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_triton_strided_inputs(m):
    """A column-major x, and weight, scale and offset that are column slices of wider ones."""
    x, q, packed, scale, offset = make_inputs(m, 72, 128, 32, torch.float32, TRITON_DEVICE)
    x_t = x.t().contiguous().t()  # [M, K] with stride (1, M)
    wide = torch.zeros(72, 128, dtype=torch.uint8, device=packed.device)
    wide[:, 32:96] = packed
    wide_scale = torch.zeros(72, 8, dtype=scale.dtype, device=scale.device)
    wide_offset = torch.zeros_like(wide_scale)
    wide_scale[:, 2:6], wide_offset[:, 2:6] = scale, offset
    out = run_triton(x_t, wide[:, 32:96], wide_scale[:, 2:6], wide_offset[:, 2:6], 32)
    check_close(out, x, q, scale, offset, 32)


def test_triton_empty():
    x, _, packed, scale, offset = make_inputs(0, 72, 96, 32, torch.float32, TRITON_DEVICE)
    assert int4_gemv_triton(x, packed, scale, offset, 32).shape == (0, 72)


def test_triton_rejects_bad_groups():
    x, _, packed, scale, offset = make_inputs(1, 72, 96, 32, torch.float32, TRITON_DEVICE)
    with pytest.raises(ValueError, match="group size"):
        int4_gemv_triton(x, packed, scale, offset, 64)  # 96 is not a multiple of 64
    with pytest.raises(ValueError, match="must be"):
        int4_gemv_triton(x, packed, scale, offset, 16)  # scale has 3 groups, not 6
    with pytest.raises(TypeError, match="uint8"):
        int4_gemv_triton(x, packed.to(torch.int8), scale, offset, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_torch_reference_matches_float64(dtype, m):
    x, q, packed, scale, offset = make_inputs(m, 96, 160, 32, dtype, "cpu")
    check_close(int4_gemv_torch(x, packed, scale, offset, 32), x, q, scale, offset, 32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ops_dispatch(backend, monkeypatch):
    """ops.int4_gemv runs the implementation that backend_for picks, and its result is right."""
    import tandem.kernels.int4_gemv_triton as triton_module

    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    calls: list[str] = []
    real_triton, real_torch = triton_module.int4_gemv_triton, ops.int4_gemv_torch

    def counted(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call

    monkeypatch.setattr(triton_module, "int4_gemv_triton", counted("triton", real_triton))
    monkeypatch.setattr(ops, "int4_gemv_torch", counted("torch", real_torch))
    x, q, packed, scale, offset = make_inputs(3, 72, 96, 32, torch.float32, device_for(backend))
    check_close(ops.int4_gemv(x, packed, scale, offset, 32), x, q, scale, offset, 32)
    assert calls == [backend]
