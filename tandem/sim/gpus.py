"""Spec-sheet numbers of the GPUs a simulation can put a pool on (see roofline.py).

Every figure is the vendor's datasheet's, as printed: dense (not 2:4-sparse) BF16 tensor
FLOP/s, memory bandwidth, memory size, and the GPU-to-GPU link. NVLink and PCIe figures on
these sheets are bidirectional totals; one direction carries half (roofline.py uses that).
What a step reaches of them is roofline.py's efficiency factors, not this table's business.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's peak numbers, from its datasheet."""

    name: str
    bf16_dense_tflops: float
    """Peak dense BF16 tensor-core TFLOP/s (the sheet's figure without sparsity)."""
    hbm_gb_s: float
    """Memory bandwidth in GB/s (10^9 bytes/s)."""
    memory_gib: float
    """Memory as the sheet names it (NVIDIA's "80GB" is 80 GiB of HBM)."""
    interconnect_gb_s: float
    """GPU-to-GPU bandwidth in GB/s, both directions together (NVLink, else PCIe)."""
    interconnect: str
    """What that link is: "NVLink 3", "PCIe Gen4 x16", ..."""

    @property
    def flops(self) -> float:
        """Peak dense BF16 FLOP/s."""
        return self.bf16_dense_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gb_s * 1e9

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def link_bytes_per_s(self) -> float:
        """One direction of the GPU-to-GPU link, in bytes/s (half the sheet's bidirectional figure)."""
        return self.interconnect_gb_s * 1e9 / 2


GPUS: dict[str, GpuSpec] = {g.name.lower(): g for g in (
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf),
    # column "A100 40GB SXM": BF16 Tensor Core 312 TFLOPS (624* with sparsity), HBM2 1,555 GB/s,
    # NVLink 600 GB/s.
    GpuSpec("A100-40GB", 312.0, 1555.0, 40.0, 600.0, "NVLink 3"),
    # Same datasheet, column "A100 80GB SXM": 312 TFLOPS BF16, HBM2e 2,039 GB/s, NVLink 600 GB/s.
    GpuSpec("A100-80GB", 312.0, 2039.0, 80.0, 600.0, "NVLink 3"),
    # NVIDIA H100 Tensor Core GPU datasheet, column "H100 SXM": BF16 Tensor Core 1,979 TFLOPS
    # with sparsity (989 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
    GpuSpec("H100", 989.0, 3350.0, 80.0, 900.0, "NVLink 4"),
    # NVIDIA H200 Tensor Core GPU datasheet, column "H200 SXM": BF16 Tensor Core 1,979 TFLOPS
    # with sparsity (989 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s. (nvidia-smi shows
    # 143,771 MiB, i.e. 140.4 GiB.)
    GpuSpec("H200", 989.0, 4800.0, 141.0, 900.0, "NVLink 4"),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 Tensor Core 242 TFLOPS with sparsity (121 dense),
    # 24 GB GDDR6 at 300 GB/s, no NVLink: PCIe Gen4 x16 64 GB/s.
    GpuSpec("L4", 121.0, 300.0, 24.0, 64.0, "PCIe Gen4 x16"),
    # NVIDIA L40S datasheet: BF16 Tensor Core 733 TFLOPS with sparsity (362 dense), 48 GB GDDR6
    # at 864 GB/s, no NVLink: PCIe Gen4 x16 64 GB/s.
    GpuSpec("L40S", 362.0, 864.0, 48.0, 64.0, "PCIe Gen4 x16"),
)}
"""The table, keyed by lower-case name."""


def gpu(name: str) -> GpuSpec:
    """The GPU named ``name`` (any case). ValueError names the known ones."""
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        known = ", ".join(g.name for g in GPUS.values())
        raise ValueError(f"unknown GPU {name!r}: one of {known}")
    return spec
