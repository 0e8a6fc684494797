"""Copies whole KV blocks between the device cache and a host cache of the same layout, and
inside the device cache (copy-on-write of a shared block).

Mechanism only: which blocks move, and where to, comes from the scheduler
(``ScheduledBatch.swap_out`` / ``swap_in``). On a CPU-only machine the "device" cache is
host memory too: the code path is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tandem.engine import step_inputs

# NOTE: the block dimension of the cache layout
# [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim] (see ModelRunner).
BLOCK_DIM = 2


class KVSwapper:
    """A host cache of ``num_host_blocks`` blocks beside ``device_cache``."""

    def __init__(self, device_cache: torch.Tensor, num_host_blocks: int) -> None:
        self.device_cache = device_cache
        shape = list(device_cache.shape)
        shape[BLOCK_DIM] = num_host_blocks
        # Uninitialised: a host block is only read after a swap-out wrote it, and untouched
        # pages cost no memory. Pinned on a GPU machine, so copies run at full PCIe speed.
        on_gpu = device_cache.is_cuda and torch.cuda.is_available()  # (not a fake CUDA tensor: tests/device)
        self.host_cache = torch.empty(shape, dtype=device_cache.dtype, pin_memory=on_gpu)
        self._pinned = on_gpu
        self._stream = torch.cuda.Stream(device_cache.device) if on_gpu else None
        """Where swap copies run on CUDA, beside the step's stream (None on the CPU)."""

    def swap_out(self, block_pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device block id, host block id).

        On CUDA the copy waits for the steps before it (they wrote the blocks) and ends before
        this returns: the host pool is written by the host (index_copy_), not the stream."""
        if not block_pairs:
            return
        device_ids, host_ids = zip(*block_pairs)
        with self._on_side_stream():
            blocks = self.device_cache.index_select(BLOCK_DIM, self._ids(device_ids, self.device_cache.device))
            blocks = step_inputs.to_host(blocks)
        self.host_cache.index_copy_(BLOCK_DIM, self._ids(host_ids, self.host_cache.device), blocks)

    def swap_in(self, block_pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: pairs of (host block id, device block id).

        One copy on the host: the blocks are gathered into a buffer (pinned on CUDA, so the
        transfer needs no copy of its own), followed by their destination ids; that buffer
        crosses in one transfer and the device writes its slots from it. On CUDA the copy runs
        on the side stream and the step's stream waits for it, so the forward that reads the
        blocks comes after it without blocking the host."""
        if not block_pairs:
            return
        host_ids, device_ids = zip(*block_pairs)
        shape = list(self.host_cache.shape)
        shape[BLOCK_DIM] = len(block_pairs)
        num_bytes = self.host_cache.element_size() * len(block_pairs) * self.host_cache[:, :, :1].numel()
        # [block bytes | padding to 8 | device ids as int64]: the ids aligned for their int64
        # view whatever the cache's element size (a bfloat16 block of odd head_dim: 2-byte rows).
        ids_at = -(-num_bytes // 8) * 8
        buffer = torch.empty(ids_at + 8 * len(device_ids), dtype=torch.uint8, pin_memory=self._pinned)
        blocks = buffer[:num_bytes].view(self.host_cache.dtype).view(shape)
        torch.index_select(self.host_cache, BLOCK_DIM, self._ids(host_ids, self.host_cache.device), out=blocks)
        buffer[ids_at:].view(torch.int64).copy_(torch.tensor(device_ids, dtype=torch.int64))
        with self._on_side_stream():
            on_device = step_inputs.to_device(buffer, self.device_cache.device)  # the one transfer
            ids = on_device[ids_at:].view(torch.int64)  # [num_pairs]
            self.device_cache.index_copy_(BLOCK_DIM, ids, on_device[:num_bytes].view(self.host_cache.dtype).view(shape))

    def copy(self, block_pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to other device blocks: pairs of (source, destination), whose
        ids cross in one transfer."""
        if not block_pairs:
            return
        ids = self._ids(tuple(b for pair in zip(*block_pairs) for b in pair), self.device_cache.device)
        src_ids, dst_ids = ids[:len(block_pairs)], ids[len(block_pairs):]  # each: [num_pairs]
        blocks = self.device_cache.index_select(BLOCK_DIM, src_ids)
        self.device_cache.index_copy_(BLOCK_DIM, dst_ids, blocks)

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        """Run the copies inside on the side stream, ordered after the step's stream's work
        so far, and the step's stream after them (a no-op on the CPU)."""
        if self._stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device_cache.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    @staticmethod
    def _ids(block_ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return step_inputs.to_device(torch.tensor(block_ids, dtype=torch.int64), device)
