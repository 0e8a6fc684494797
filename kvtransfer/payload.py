"""KV rows as they travel: as frames of the ZMQ message itself (a pool's layout, rows as
bytes and back), or by torch.distributed point-to-point in a pair (NCCL between GPUs, gloo on
CPUs) beside the same ZMQ headers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from tandem.config.names import DTYPE_BYTES
from tandem.kvtransfer.protocol import KVLayout

logger = logging.getLogger(__name__)

# Derived from the one dtype table (each name is torch's): kvtransfer imports no model code.
TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({name: getattr(torch, name) for name in DTYPE_BYTES})
_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({v: k for k, v in TORCH_DTYPES.items()})


def layout_of(kv_cache: torch.Tensor) -> KVLayout:
    """kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [layers, 2, blocks, block_size, heads, dim], "
                         f"got {tuple(kv_cache.shape)}")
    return layout_for(tuple(kv_cache.shape), kv_cache.dtype)


def layout_for(shape: tuple[int, ...], dtype: torch.dtype) -> KVLayout:
    """The layout of a pool of `shape` [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    and `dtype`."""
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
    # numpy's stubs give ndarray __buffer__ only for Python 3.12+ (the buffer protocol is older).
    return memoryview(host.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def rows_of(frame: memoryview, dtype: str, row_shape: tuple[int, int]) -> torch.Tensor:
    """-> [n, *row_shape] over the frame's bytes (no copy)."""
    return torch.frombuffer(frame, dtype=TORCH_DTYPES[dtype]).view(-1, *row_shape)


class PeerLost(RuntimeError):
    """A torch.distributed peer did not complete an operation within the payload's deadline
    (dead or hung): the pair was aborted, nothing more goes by it. A RuntimeError, as what
    gloo raises when its peer is gone, so callers handle both alike."""


POLL_FIRST_S, POLL_MAX_S = 50e-6, 2e-3
"""How often an operation's completion is polled: at once, then backing off to POLL_MAX_S."""


class DistPayload:
    """KV rows sent with torch.distributed send/recv to a peer rank of `group`.

    NOTE: tensors on one pair of ranks are matched in order, so the sender sends them in
    the order of its headers and the receiver, which reads the headers in the same order,
    receives them before checking the header (a message it drops is still drained).

    NOTE: completion is polled (`Work.is_completed`) against the payload's own deadline, never
    left to `Work.wait`: NCCL's wait neither blocks the host nor raises when the peer is dead
    (it only orders the current stream), and NCCL's watchdog ends the process once a work
    outlives the group's timeout. So the deadline is shorter than that timeout, and on expiry
    the pair's group is aborted first (the watchdog then has nothing to time out).
    """

    def __init__(self, group: Any, rank: int, backend: str, device: torch.device, timeout_s: float,
                 empty: Callable[..., torch.Tensor] = torch.empty, polled: bool = True) -> None:
        """group: a group of two built outside the default world (dist_pairs.py), whose own
        send/recv are called (torch.distributed's functions know only the world's groups);
        rank: this side's in it. device: where the backend's tensors live; timeout_s: the
        group's (its watchdog's) timeout; empty: how a tensor is allocated on `device`
        (torch.empty); polled: whether completion is polled (NCCL) or left to a blocking
        wait() that raises (gloo)."""
        self._own: Any = group
        self.rank, self.backend, self.device, self._empty = rank, backend, device, empty
        self.deadline_s = timeout_s / 2  # NOTE: well inside the watchdog's timeout
        self.polled = polled
        self.lost = ""
        self.on_close: Callable[[], None] | None = None
        """Called (on a thread of its own, errors ignored) when a pair still in step is closed."""

    def send(self, peer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Returns once both tensors are handed over (unlike the ZMQ path's send_layer).
        Raises RuntimeError (PeerLost past the deadline) when the peer is gone or does not
        take them in time; the pair is aborted then."""
        for t in (k, v):
            t = t if t.device == self.device else t.to(self.device)  # (rows of a pool on the device: as they are)
            t = t if t.is_contiguous() else t.contiguous()
            work = self._group().send([t], peer, 0)
            self._finish(work, f"send to rank {peer}")

    def recv(self, peer: int, num_tokens: int, row_shape: tuple[int, int], dtype: str
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> K and V rows [num_tokens, *row_shape] from `peer`, on this payload's device.
        Raises RuntimeError (PeerLost past the deadline) when it is gone."""
        out = []
        for _ in range(2):
            t = self._empty(num_tokens, *row_shape, dtype=TORCH_DTYPES[dtype], device=self.device)
            work = self._group().recv([t], peer, 0)
            self._finish(work, f"recv from rank {peer}")
            out.append(t)
        return out[0], out[1]

    def _group(self) -> Any:
        """The pair's group (PeerLost once it is closed or aborted)."""
        if self._own is None:
            raise PeerLost(self.lost or "closed")
        return self._own

    def _finish(self, work: Any, what: str) -> None:
        """Poll `work` until it completes (then its wait() raises what the backend saw) or the
        deadline passes (then the pair is aborted and PeerLost raised)."""
        if self.lost:
            raise PeerLost(self.lost)
        if not self.polled:  # gloo: its wait blocks, and raises when the peer is gone or past its timeout
            work.wait()
            return
        deadline = time.monotonic() + self.deadline_s
        pause = POLL_FIRST_S
        while not work.is_completed():
            if time.monotonic() >= deadline:
                self.lost = f"{what} did not complete within {self.deadline_s:.1f} s (peer dead or hung): pair aborted"
                self.close()
                raise PeerLost(self.lost)
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        work.wait()

    def close(self) -> None:
        """Abort the pair's group (never blocks: a dead peer cannot hold it up). Idempotent."""
        group, self._own = self._own, None
        if group is None:
            return
        if not self.lost and self.on_close is not None:  # (a lost peer may be hung: not waited for)
            threading.Thread(target=_quietly, args=(self.on_close,), daemon=True).start()
        self.lost = self.lost or "closed"
        try:
            group.abort()
        except RuntimeError as e:  # already torn down by the backend
            logger.debug("aborting a torch.distributed pair: %s", e)


def _quietly(f: Callable[[], None]) -> None:
    try:
        f()
    except Exception as e:  # NOTE: a courtesy to the peer: it may be gone
        logger.debug("telling a torch.distributed peer the pair is closed: %s", e)
