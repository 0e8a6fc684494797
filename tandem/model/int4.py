"""Weight-only int4 in groups along the input dimension, with a scale and an offset per group.

``w[o, i] ~= q[o, i] * scale[o, i // G] + offset[o, i // G]`` with ``q`` in 0..15. This is
GGUF's Q4_1 exactly (``d`` is the scale and ``m`` the offset, both float16, G = 32), and
GPTQ/AWQ's ``(q - zero) * scale`` with ``offset = -zero * scale``, so each of those formats
is kept as it is rather than dequantized.

Two values share a byte: column ``2j`` in the low nibble, ``2j + 1`` in the high one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZE = 32
"""Group size of ``quantize_int4`` (GGUF Q4_1's block)."""


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
        """Bytes held: the packed values, the scales and the offsets."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    def unpacked(self) -> torch.Tensor:
        """-> [out, in] uint8 values 0..15."""
        low = self.qweight & 0x0F
        high = self.qweight >> 4
        # NOTE: stacking on a new last axis then flattening interleaves low/high per byte.
        return torch.stack((low, high), dim=-1).reshape(self.qweight.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [out, in] in ``dtype`` (computed in float32)."""
        q = self.unpacked().float()
        scale = self.scale.float().repeat_interleave(self.group_size, dim=1)
        offset = self.offset.float().repeat_interleave(self.group_size, dim=1)
        return (q * scale + offset).to(dtype)

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
    return Int4Weight(pack_int4(q.reshape(out_features, in_features)), scale.contiguous(), offset.contiguous(), group_size)
