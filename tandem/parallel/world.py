"""The backend of a tensor-parallel worker's device group, by the device its ranks run on:
NCCL between GPUs, gloo between CPUs. The one place that choice is made (ranks.join_groups)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorldBackend:
    """How the ranks' device group is made with one torch.distributed backend."""

    name: str
    """What init_process_group is given (a registered torch.distributed backend)."""
    bind: Callable[[torch.device], None]
    """Binds the calling process to its rank's device before it joins (NCCL binds each
    rank to the current device)."""


def _no_binding(device: torch.device) -> None:
    """gloo ranks are bound to nothing."""


WORLD_BACKENDS: dict[str, WorldBackend] = {
    "nccl": WorldBackend("nccl", torch.cuda.set_device),
    "gloo": WorldBackend("gloo", _no_binding),
}
"""By the name device_backend gives. NOTE: the one place the device group's backend is
named; a test puts a stand-in here under a real name (tests/device), as with KV pairs."""


def device_backend(device: torch.device) -> str:
    """The backend of the device group: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def world_backend(device: torch.device) -> WorldBackend:
    """The WORLD_BACKENDS entry for ranks on `device`."""
    return WORLD_BACKENDS[device_backend(device)]
