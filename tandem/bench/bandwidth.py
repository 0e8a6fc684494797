"""Memory bandwidth measured with a large tensor copy, for the decode-step floor."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger(__name__)

DEFINITION = "bandwidth = 2 * size / time of dst.copy_(src) (bytes read + bytes written), best of N"


@dataclass(frozen=True)
class Bandwidth:
    """Result of :func:`measure_copy_bandwidth`."""

    bytes_per_s: float
    size_bytes: int
    best_s: float
    repeats: int
    num_threads: int
    definition: str = DEFINITION

    def as_dict(self) -> dict:
        return asdict(self)


def measure_copy_bandwidth(size_mib: int = 1024, repeats: int = 5, device: str = "cpu") -> Bandwidth:
    """Best-of-``repeats`` bandwidth of copying a ``size_mib`` MiB float32 tensor.

    The tensor is far larger than any cache, so the copy streams from and to DRAM, as a
    decode step streams the weights. Both buffers are written once first so that page
    faults are not timed. Uses the current torch thread count (copy_ is parallel).
    """
    if size_mib < 1 or repeats < 1:
        raise ValueError(f"size_mib and repeats must be >= 1, got {size_mib}, {repeats}")
    numel = size_mib * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.zeros(numel, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)
    dst.copy_(src)  # warm-up: fault every page in, outside the timing
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    best = min(times)
    size = numel * 4
    result = Bandwidth(2 * size / best, size, best, repeats, torch.get_num_threads())
    logger.info("copy bandwidth on %s: %.2f GB/s (%d MiB, best of %d: %.2f ms)",
                device, result.bytes_per_s / 1e9, size_mib, repeats, best * 1e3)
    return result
