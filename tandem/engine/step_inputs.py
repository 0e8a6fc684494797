"""A step's integer inputs, built on the host and copied to the device in one transfer.

Every index a step needs (token ids, positions, cache slots, block tables, logits rows,
attention's decode groups) is laid out in one int64 host buffer; one copy puts it on the
engine's device and each tensor is a view of the copy. So a step pays one host-to-device
transfer, whatever its batch, and nothing inside the forward reads a device value back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: itself when it is there already (on the CPU; rows that arrived on
    the device by NCCL); from host memory through pinned memory, so that the copy is
    asynchronous (the stream orders it before the forward that reads it); from another
    device, one device-to-device copy.

    NOTE: the one place a step's inputs cross to the device (tests/device replaces it under
    FakeTensorMode, where torch without CUDA cannot copy)."""
    if is_on(t, device):
        return t
    if t.device.type != "cpu" or device.type == "cpu":  # NOTE: never pinned: only dense CPU tensors can be
        return t.to(device, non_blocking=device.type != "cpu")
    return t.pin_memory().to(device, non_blocking=True)


def is_on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device`` (``cuda`` without an index: the current one, taken as any)."""
    return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (itself on the CPU): pinned on CUDA, copied before this returns,
    since the host reads it next."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


class StepInputs:
    """Named int64 arrays of one step, shaped as the forward wants them."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, values: np.ndarray | Sequence[int] | Sequence[Sequence[int]],
            shape: tuple[int, ...]) -> None:
        """Lay out ``values`` (any int sequence) as ``shape``."""
        self._arrays[name] = np.asarray(values, dtype=np.int64).reshape(shape)

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """-> each array by name as a tensor on ``device``, all views of one copied buffer."""
        return upload_arrays(self._arrays, np.int64, device)


def upload_arrays(arrays: dict[str, np.ndarray], dtype: type, device: torch.device) -> dict[str, torch.Tensor]:
    """``arrays`` (all of ``dtype``) on ``device`` in one transfer: -> each by name, a view of
    the one copied buffer, shaped as it was."""
    flat = np.concatenate([a.reshape(-1) for a in arrays.values()]) if arrays else np.zeros(0, dtype)
    buffer = to_device(torch.from_numpy(flat), device)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for name, a in arrays.items():
        tensors[name] = buffer[offset:offset + a.size].view(a.shape)
        offset += a.size
    return tensors
