"""ZMQ frames: a layer's rows travel in the LAYER message itself, K frames then V frames.

In host memory the frames are views of the pool (where the rows run side by side), handed to
ZMQ without a copy; a pool on a GPU stages them through pinned host memory (staging.py), and
the message goes out from a later `flush` once its copy is done. Every pair can take this
path: a receiver answers by it when no other path was asked for, or it declined that one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from tandem.kvtransfer.connectors.base import (
    Answer,
    CorruptPayload,
    KVConnector,
    LayerJob,
    ReceivePath,
    ReceiverSide,
    SenderLink,
    SendPath,
    check_rows,
    not_negotiated,
)
from tandem.kvtransfer.payload import frame_of, layer_rows, rows_of
from tandem.kvtransfer.protocol import KVLayout, LayerHeader, MessageKind, ProtocolError, encode, payload_crc32
from tandem.kvtransfer.slots import contiguous_runs, token_slots
from tandem.kvtransfer.staging import StagedLayer

MAX_VIEW_FRAMES = 8  # more runs than this per layer and the rows are gathered into one frame


@dataclass
class StagedMessage:
    """A LAYER message waiting for its rows to reach the host (staging.py)."""

    job: LayerJob
    rows: StagedLayer


def host_frames(kv_cache: torch.Tensor, layer: int, src_slots: np.ndarray,
                rows: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[list[int], list[memoryview]]:
    """-> (frame_tokens, the K frames then the V frames) of a layer's rows: `rows` when given,
    else cache slots `src_slots` of a pool in host memory (views of it where they run side by side)."""
    if rows is not None:
        return [len(rows[0])], [frame_of(r) for r in rows]
    k_rows, v_rows = layer_rows(kv_cache, layer, 0), layer_rows(kv_cache, layer, 1)
    runs = contiguous_runs(src_slots)
    if len(runs) <= MAX_VIEW_FRAMES:  # a few long runs: frames are views of the pool itself
        return [n for _, n in runs], [frame_of(r[first:first + n]) for r in (k_rows, v_rows) for first, n in runs]
    # Scattered blocks: one gathered frame each for K and V beats many small ones.
    index = torch.from_numpy(src_slots).to(kv_cache.device)
    return [len(src_slots)], [frame_of(r.index_select(0, index)) for r in (k_rows, v_rows)]


class FramesSend(SendPath):
    label = "zmq"

    def __init__(self) -> None:
        self._staged: collections.deque[StagedMessage] = collections.deque()
        """Messages whose rows are on their way to the host, in the order they go out."""

    def send_layer(self, link: SenderLink, job: LayerJob) -> bool:
        src_slots = token_slots(job.out.src_block_ids, link.layout.block_size, job.start, job.end)
        if link.staging is not None and job.rows is None:  # sent by flush once on the host
            job.header["frame_tokens"] = [len(src_slots)]
            self._staged.append(StagedMessage(job, link.staging.stage(link.kv_cache, job.layer, src_slots)))
            job.out.num_staged += 1
            self.flush(link)
            return True
        job.header["frame_tokens"], frames = host_frames(link.kv_cache, job.layer, src_slots, job.rows)
        return self._send(link, job, frames)

    def flush(self, link: SenderLink) -> None:
        """Send the staged messages whose rows are on the host, in order (never blocks)."""
        while self._staged and self._staged[0].rows.ready():
            s = self._staged.popleft()
            s.job.out.num_staged -= 1
            if s.job.out.ended is None:  # (aborted or failed meanwhile: nothing more goes out)
                self._send(link, s.job, [frame_of(s.rows.host[0]), frame_of(s.rows.host[1])])

    def busy(self) -> bool:
        return bool(self._staged)

    @staticmethod
    def _send(link: SenderLink, job: LayerJob, frames: list[memoryview]) -> bool:
        if link.checksum:
            job.header["crc32"] = payload_crc32(frames)
        sent = link.send_message(job.request_id, [encode(MessageKind.LAYER, job.request_id, **job.header), *frames])
        if sent:
            link.count_sent(job.num_bytes)
        return sent


class FramesReceive(ReceivePath):
    label = "zmq"

    def rows(self, h: LayerHeader, frames: list[zmq.Frame], msg: dict[str, Any], layout: KVLayout
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if h.in_place:
            raise not_negotiated(h, self.label)
        check_rows(h, layout)
        if len(frames) != 2 * len(h.frame_tokens) or sum(h.frame_tokens) != h.num_tokens \
                or min(h.frame_tokens, default=0) < 1:
            raise ProtocolError("truncated", f"{h.request_id}: {len(frames)} frames for {h.frame_tokens}")
        parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, (frame, n) in enumerate(zip(frames, h.frame_tokens * 2)):
            if len(frame.buffer) != n * layout.row_bytes:
                raise ProtocolError("truncated", f"{h.request_id}: {len(frame.buffer)} bytes for {n} rows")
            parts[i // len(h.frame_tokens)].append(rows_of(frame.buffer, h.dtype, h.row_shape))
        if h.crc32 is not None and payload_crc32(f.buffer for f in frames) != h.crc32:
            raise CorruptPayload(f"{h.request_id}: layer {h.layer}")
        return parts


FRAMES = FramesReceive()
"""How the rows of a sender come in when it asked for no other path (it keeps no state)."""


class ZmqFramesConnector(KVConnector):
    def open(self, layout: KVLayout, reply: dict[str, Any]) -> SendPath:
        return FramesSend()

    @classmethod
    def answer(cls, name: str, hello: dict[str, Any], side: ReceiverSide, sender: bytes) -> Answer:
        return Answer({}, FRAMES)
