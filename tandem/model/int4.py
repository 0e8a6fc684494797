"""Weight-only int4 in groups along the input dimension, with a scale and an offset per group.

``w[o, i] ~= q[o, i] * scale[o, i // G] + offset[o, i // G]`` with ``q`` in 0..15. This is
GGUF's Q4_1 exactly (``d`` is the scale and ``m`` the offset, both float16, G = 32), and
GPTQ/AWQ's ``(q - zero) * scale`` with ``offset = -zero * scale``, so each of those formats
is kept as it is rather than dequantized.

Two values share a byte: column ``2j`` in the low nibble, ``2j + 1`` in the high one.

On CPU a weight also has ``cpu_pack`` and ``gemv_pack``: the same values in the layouts of
torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) and of tandem's (kernels/int4_gemv_cpu.py),
built on first use and cached on the instance, so that a shard, a stacked weight or a
``dataclasses.replace`` copy (new instances) never reuses a pack made for other values. See
int4_matmul.py for which product runs when.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tandem.kernels import int4_gemv_cpu
from tandem.kernels.int4_gemv_cpu import Int4GemvPack

INT4_GROUP_SIZE = 32
"""Group size of ``quantize_int4`` (GGUF Q4_1's block)."""
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes torch's CPU int4 kernel takes."""
KERNEL_ROW_MULTIPLE = 16
"""torch's CPU int4 packing needs the output size to be a multiple of this."""
_DEQUANTIZE_CHUNK_ROWS = 512
"""Rows dequantized at a time: the float32 temporaries stay in cache (measured 1.5-2x faster)."""


@dataclass(frozen=True)
class CpuPack:
    """An int4 weight in the layout of ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

    The kernel computes ``w = (q - 8) * scale + zero`` per group; Int4Weight's
    ``q * scale + offset`` is that with ``zero = offset + 8 * scale``.
    """

    values: torch.Tensor  # [out, in // 2] uint8, torch's blocked layout (64 rows interleaved per block)
    scale_zeros: torch.Tensor  # [in // group_size, out, 2] bfloat16: (scale, zero) per group

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scale_zeros))


@dataclass(frozen=True)
class Int4Weight:
    """A linear layer's weight in int4 groups: ``w ~= q * scale + offset`` per group of columns."""

    qweight: torch.Tensor  # [out, in // 2] uint8, two 4-bit values per byte (low nibble first)
    scale: torch.Tensor  # [out, in // group_size] float16
    offset: torch.Tensor  # [out, in // group_size] float16
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], self.qweight.shape[1] * 2))

    @property
    def num_bytes(self) -> int:
        """Bytes of the weight: the packed values, the scales and the offsets (what a product reads)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    @property
    def held_bytes(self) -> int:
        """Bytes held: num_bytes, plus the CPU kernels' copies once they are built."""
        packs = (self.__dict__.get(name) for name in ("cpu_pack", "gemv_pack"))  # functools.cached_property's
        return self.num_bytes + sum(p.num_bytes for p in packs if p is not None)

    def unpacked(self) -> torch.Tensor:
        """-> [out, in] uint8 values 0..15."""
        low = self.qweight & 0x0F
        high = self.qweight >> 4
        # NOTE: stacking on a new last axis then flattening interleaves low/high per byte.
        return torch.stack((low, high), dim=-1).reshape(self.qweight.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [out, in] in ``dtype``: ``q * scale + offset`` in float32, then rounded to ``dtype``.

        ``q * scale`` is exact in float32 (4 bits times float16's 11), so the one rounding
        is that of the sum, whichever way it is computed (fused or not): the result is
        bit-identical to GGUF's own ``d * q + m`` in float32.
        """
        out_features, g = self.qweight.shape[0], self.group_size
        result = torch.empty(out_features, self.qweight.shape[1] * 2, dtype=dtype, device=self.qweight.device)
        grouped = result.view(out_features, -1, g)  # [out, in // G, G]
        for start in range(0, out_features, _DEQUANTIZE_CHUNK_ROWS):
            end = min(start + _DEQUANTIZE_CHUNK_ROWS, out_features)
            packed = self.qweight[start:end]
            # q: [rows, in // G, G]; stacking low/high on a new last axis interleaves them per byte.
            q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(end - start, -1, g)
            grouped[start:end] = torch.addcmul(self.offset[start:end].float()[..., None], q.float(),
                                               self.scale[start:end].float()[..., None])
        return result

    @property
    def has_cpu_kernel(self) -> bool:
        """Whether torch's CPU int4 kernel takes this weight (CPU tensors, a supported shape)."""
        return (self.qweight.device.type == "cpu" and self.group_size in KERNEL_GROUP_SIZES
                and self.qweight.shape[0] % KERNEL_ROW_MULTIPLE == 0)

    @functools.cached_property
    def cpu_pack(self) -> CpuPack:
        """torch's CPU kernel layout of this weight (built once per instance; see has_cpu_kernel).

        Its scales and zeros are bfloat16 (the kernel wants the activations' dtype, and it
        runs in bf16): ``scale`` loses 3 of float16's bits and ``zero`` is rounded once.
        """
        if not self.has_cpu_kernel:
            raise ValueError(f"torch's CPU int4 kernel does not take a {tuple(self.shape)} weight in groups of "
                             f"{self.group_size} on {self.qweight.device}")
        values = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.unpacked().to(torch.int32), 1)
        scale = self.scale.float()
        zero = self.offset.float() + 8 * scale
        # [out, in // G, 2] -> [in // G, out, 2]: the kernel reads a group's pair as one word.
        scale_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
        return CpuPack(values, scale_zeros)

    @functools.cached_property
    def gemv_pack(self) -> Int4GemvPack:
        """tandem's CPU kernel layout of this weight (kernels/int4_gemv_cpu.py), built once per instance."""
        return int4_gemv_cpu.pack(self.qweight, self.scale, self.offset)

    def rows(self, start: int, end: int) -> "Int4Weight":
        """Output channels ``start:end`` (a column-parallel shard)."""
        return Int4Weight(self.qweight[start:end].contiguous(), self.scale[start:end].contiguous(),
                          self.offset[start:end].contiguous(), self.group_size)

    def cols(self, start: int, end: int) -> "Int4Weight":
        """Input channels ``start:end`` (a row-parallel shard); both must fall on group edges."""
        if start % self.group_size or end % self.group_size:
            raise ValueError(f"int4 columns {start}:{end} do not fall on groups of {self.group_size}")
        g0, g1 = start // self.group_size, end // self.group_size
        return Int4Weight(self.qweight[:, start // 2:end // 2].contiguous(), self.scale[:, g0:g1].contiguous(),
                          self.offset[:, g0:g1].contiguous(), self.group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [out, in] integers 0..15 (in even) -> [out, in // 2] uint8, low nibble first."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Asymmetric min/max int4 of ``w: [out, in]`` per group of ``group_size`` columns (as Q4_1).

    scale = (max - min) / 15 and offset = min, both rounded to float16 first so that the
    values are chosen against the scale that is stored.
    """
    out_features, in_features = w.shape
    if in_features % group_size or group_size % 2:
        raise ValueError(f"int4 needs the input size {in_features} to be a multiple of an even group size {group_size}")
    groups = w.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).half()
    offset = low.half()
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(low))
    q = torch.round((groups - offset.float()[..., None]) / safe[..., None]).clamp_(0, 15)
    return Int4Weight(pack_int4(q.reshape(out_features, in_features)), scale.contiguous(), offset.contiguous(),
                      group_size)
