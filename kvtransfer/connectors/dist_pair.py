"""A torch.distributed pair: a group of two made in the handshake (dist_pairs.py), gloo or
NCCL; the header goes by ZMQ, then K and V by send/recv, matched in order on the pair.

NOTE: never between two pools that may share a GPU (NCCL allows one rank per device), and
never encrypted: with TANDEM_KV_SECRET set it is taken only when acknowledged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import zmq

from tandem.kvtransfer.connectors.base import (
    Answer,
    KVConnector,
    LayerJob,
    PathBroken,
    ReceivePath,
    ReceiverSide,
    SenderLink,
    SendPath,
    check_rows,
    not_negotiated,
)
from tandem.kvtransfer.dist_pairs import RECEIVER_RANK, SENDER_RANK, ReceiverPairs, can_host, join_pair
from tandem.kvtransfer.path_choice import ALLOW_UNENCRYPTED_FLAG
from tandem.kvtransfer.payload import TORCH_DTYPES, DistPayload, layer_rows
from tandem.kvtransfer.protocol import (
    KVLayout,
    LayerHeader,
    MessageKind,
    PairNotFormed,
    ProtocolError,
    encode,
)
from tandem.kvtransfer.slots import token_slots

logger = logging.getLogger(__name__)


class DistSend(SendPath):
    label = "dist"

    def __init__(self, pair: DistPayload) -> None:
        self.pair = pair

    def send_layer(self, link: SenderLink, job: LayerJob) -> bool:
        """The header by ZMQ, then K and V (blocking until handed over)."""
        job.header.update(frame_tokens=[], dist_rank=self.pair.rank)
        if not link.send_message(job.request_id, [encode(MessageKind.LAYER, job.request_id, **job.header)]):
            return False
        rows = job.rows
        if rows is None:
            slots = token_slots(job.out.src_block_ids, link.layout.block_size, job.start, job.end)
            index = torch.from_numpy(slots).to(link.kv_cache.device)
            k, v = (layer_rows(link.kv_cache, job.layer, kv).index_select(0, index) for kv in (0, 1))
            rows = (k, v)
        try:
            self.pair.send(RECEIVER_RANK, *rows)
        except RuntimeError as e:  # the receiver is gone (or stuck past the timeout)
            link.lose_peer(job.request_id, f"torch.distributed peer lost: {e}")
            return False
        link.count_sent(job.num_bytes)
        return True

    def close(self) -> None:
        self.pair.close()


class DistReceive(ReceivePath):
    label = "dist"

    def __init__(self, pairs: ReceiverPairs, sender: bytes) -> None:
        self._pairs, self._sender = pairs, sender

    def rows(self, h: LayerHeader, frames: list[zmq.Frame], msg: dict[str, Any], layout: KVLayout
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if h.in_place:
            raise not_negotiated(h, "torch.distributed")
        if not isinstance(msg.get("dist_rank"), int) or frames or h.dtype not in TORCH_DTYPES:
            raise ProtocolError("malformed", "a torch.distributed LAYER has dist_rank, a dtype and no frames")
        try:  # NOTE: drained before any other check, as the header claims it (see DistPayload)
            k, v = self._pairs.payload(self._sender).recv(SENDER_RANK, h.num_tokens, h.row_shape, h.dtype)
        except Exception as e:  # the peer died between header and tensors (or never joined its pair)
            raise PathBroken(f"torch.distributed peer lost: {e}") from None
        check_rows(h, layout)
        return [k], [v]

    def forget(self) -> None:
        self._pairs.forget(self._sender)


class DistPairConnector(KVConnector):
    """Registered as "gloo" and "nccl": the name is the pair's backend."""

    def hello(self) -> dict[str, Any]:
        return {"dist_pair": self.name, "dist_required": self.side.transport == self.name}

    def open(self, layout: KVLayout, reply: dict[str, Any]) -> SendPath | None:
        if "dist_pair" not in reply:  # declined, and not required: frames
            return None
        try:
            return DistSend(join_pair(self.side.address, reply["dist_pair"], self.side.timeout_s))
        except (RuntimeError, ValueError, OSError) as e:
            raise PairNotFormed(f"no torch.distributed pair with the KV receiver at {self.side.address}: {e}"
                                ) from None

    @classmethod
    def answer(cls, name: str, hello: dict[str, Any], side: ReceiverSide, sender: bytes) -> Answer | None:
        if hello.get("dist_pair") != name:
            return None
        cannot = (f"both pools on one GPU ({side.device}), where NCCL allows one rank per device"
                  if side.device and hello.get("device") == side.device
                  else "TANDEM_KV_SECRET is set and a torch.distributed pair is not encrypted "
                       f"({ALLOW_UNENCRYPTED_FLAG} allows it)" if side.unencrypted_pairs_refused
                  else can_host(name, side.pool_device))
        if cannot is not None:
            required = hello.get("dist_required")
            return Answer({}, None, f"KV by torch.distributed {name!r} was required: {cannot}") if required else None
        try:  # this side of the pair is built while the sender builds its own
            fields = side.pairs.offer(sender, name)
        except (OSError, RuntimeError) as e:
            logger.warning("kv receiver cannot host a torch.distributed pair: %s", e)
            return Answer({}, None, f"no pair here: {e}")
        return Answer({"dist_pair": fields}, DistReceive(side.pairs, sender))
