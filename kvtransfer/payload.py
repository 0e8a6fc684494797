"""The two data paths for KV rows: frames of the ZMQ message itself, or torch.distributed
point-to-point (NCCL between GPUs, gloo on CPUs) beside the same ZMQ headers."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist

from tandem.config_names import DTYPE_BYTES
from tandem.kvtransfer.protocol import KVLayout

# Derived from the one dtype table (each name is torch's): kvtransfer imports no model code.
TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({name: getattr(torch, name) for name in DTYPE_BYTES})
_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({v: k for k, v in TORCH_DTYPES.items()})


def layout_of(kv_cache: torch.Tensor) -> KVLayout:
    """kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"""
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [layers, 2, blocks, block_size, heads, dim], got {tuple(kv_cache.shape)}")
    return layout_for(tuple(kv_cache.shape), kv_cache.dtype)


def layout_for(shape: tuple[int, ...], dtype: torch.dtype) -> KVLayout:
    """The layout of a pool of `shape` [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] and `dtype`."""
    num_layers, two, num_blocks, block_size, num_kv_heads, head_dim = shape
    if two != 2:
        raise ValueError(f"kv_cache must be a contiguous [layers, 2, blocks, block_size, heads, dim], got {shape}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"kv_cache dtype must be one of {list(TORCH_DTYPES)}, got {dtype}")
    return KVLayout(num_layers, num_blocks, block_size, num_kv_heads, head_dim, _DTYPE_NAMES[dtype])


def layer_rows(kv_cache: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
    """-> [num_blocks * block_size, num_kv_heads, head_dim], a view: row i is slot i's K (kv=0) or V (kv=1)."""
    return kv_cache.select(0, layer).select(0, kv).flatten(0, 1)  # (select: no host index, see staging.py)


def frame_of(rows: torch.Tensor) -> memoryview:
    """Raw bytes of contiguous rows, without a copy when they are in host memory."""
    host = rows if rows.device.type == "cpu" else rows.cpu()  # the one copy a socket needs
    return memoryview(host.contiguous().view(torch.uint8).numpy()).cast("B")


def rows_of(frame: memoryview, dtype: str, row_shape: tuple[int, int]) -> torch.Tensor:
    """-> [n, *row_shape] over the frame's bytes (no copy)."""
    return torch.frombuffer(frame, dtype=TORCH_DTYPES[dtype]).view(-1, *row_shape)


class DistPayload:
    """KV rows sent with torch.distributed send/recv to a peer rank of `group`.

    NOTE: tensors on one pair of ranks are matched in order, so the sender sends them in
    the order of its headers and the receiver, which reads the headers in the same order,
    receives them before checking the header (a message it drops is still drained).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        """group: a group of the default world (None: the world itself); see `over` for a
        group made outside it."""
        if not dist.is_initialized():
            raise RuntimeError("DistPayload needs torch.distributed.init_process_group first")
        self.group = group
        self._own: dist.ProcessGroup | None = None
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.device = _device_of(self.backend)

    @classmethod
    def over(cls, group: dist.ProcessGroup, rank: int, backend: str) -> DistPayload:
        """A payload over a group built outside the default world (dist_pairs.py): its own
        send/recv are called, since torch.distributed's functions know only the world's groups."""
        payload = cls.__new__(cls)
        payload.group, payload._own, payload.rank, payload.backend = None, group, rank, backend
        payload.device = _device_of(backend)
        return payload

    def send(self, peer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Blocks until both tensors are handed over (unlike the ZMQ path's send_layer).
        Raises RuntimeError when the peer is gone or does not take them within the timeout."""
        for t in (k, v):
            t = t.to(self.device).contiguous()
            if self._own is not None:
                self._own.send([t], peer, 0).wait()
            else:
                dist.send(t, dst=peer, group=self.group)

    def recv(self, peer: int, num_tokens: int, row_shape: tuple[int, int], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
        """-> K and V rows [num_tokens, *row_shape] from `peer`. Raises RuntimeError when it is gone."""
        out = []
        for _ in range(2):
            t = torch.empty(num_tokens, *row_shape, dtype=TORCH_DTYPES[dtype], device=self.device)
            if self._own is not None:
                self._own.recv([t], peer, 0).wait()
            else:
                dist.recv(t, src=peer, group=self.group)
            out.append(t)
        return out[0], out[1]


def _device_of(backend: str) -> torch.device:
    """Where a backend's tensors live: NCCL sends from the GPU, gloo from host memory."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
