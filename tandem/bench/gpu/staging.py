"""The KV staging copy: one layer's K and V for a prompt, from the device into a pinned host
buffer and back, each on a side stream with an asynchronous copy, as the KV transfer stages
a layer on CUDA. Compared with the device's own copy rate and with a large pinned copy
(what the host link gives at best): a layer is small, so per-copy overhead shows here.

Every rate here is bytes copied per second (each byte read once and written once): the
device copy bandwidth of bench engine counts read + write, so its copy rate is half of it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from tandem.bench.gpu.setup import GpuSetup

REPEATS = 20
LINK_PROBE_MIB = 256
"""A pinned copy this large runs at the host link's full rate (PCIe or NVLink-C2C)."""
LAYER_TOKENS = (4096,)
"""Prompt lengths staged besides --prompt-len."""


def bench(setup: GpuSetup, prompt_len: int, device_bandwidth: float) -> list[dict]:
    """-> one row per direction (device->host, host->device) and layer size."""
    device = setup.device
    cfg = setup.config
    stream = torch.cuda.Stream(device)
    device_rate = device_bandwidth / 2
    link = {direction: _rate(*_buffers(LINK_PROBE_MIB * 2**20 // setup.dtype.itemsize, setup.dtype, device),
                             direction, stream) for direction in ("device->host", "host->device")}
    rows = []
    for tokens in sorted({prompt_len, *LAYER_TOKENS}):
        shape = (2, tokens, cfg.num_kv_heads, cfg.head_dim)  # one layer's K and V
        on_device, pinned = _buffers(shape, setup.dtype, device)
        for direction in ("device->host", "host->device"):
            rate = _rate(on_device, pinned, direction, stream)
            num_bytes = on_device.numel() * on_device.element_size()
            rows.append({"direction": direction, "tokens": tokens, "bytes": num_bytes, "bytes_per_s": rate,
                         "device_fraction": rate / device_rate, "link_bytes_per_s": link[direction],
                         "link_fraction": rate / link[direction]})
    return rows


def _buffers(shape: tuple[int, ...] | int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A device tensor and a pinned host tensor of ``shape``, both written once (no page
    faults or lazy allocation timed)."""
    on_device = torch.randn(shape, device=device).to(dtype)
    pinned = torch.empty(on_device.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(on_device)
    return on_device, pinned


def _rate(on_device: torch.Tensor, pinned: torch.Tensor, direction: str, stream: torch.cuda.Stream) -> float:
    """Median bytes per second of one asynchronous copy on ``stream``, waited for."""
    copy: Callable[[], object] = ((lambda: pinned.copy_(on_device, non_blocking=True)) if direction == "device->host"
                                  else (lambda: on_device.copy_(pinned, non_blocking=True)))
    torch.cuda.synchronize(on_device.device)
    times = []
    for i in range(REPEATS + 2):
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            copy()
        stream.synchronize()
        if i >= 2:  # two warm-up copies
            times.append(time.perf_counter() - start)
    return on_device.numel() * on_device.element_size() / statistics.median(times)
