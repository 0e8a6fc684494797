"""The first rank's model runner: every step goes to all ranks as one message, then runs here too."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.kvtransfer.protocol import KVLayout
from tandem.model.llama import LlamaModel
from tandem.parallel.executor import DeviceCollectives, RankExecutor
from tandem.parallel.kv_writes import PendingKVWrites
from tandem.parallel.step_message import HOST, ForwardInputs, StepMessage, StepOp, broadcast_step


class TensorParallelRunner(ModelRunner):
    """Schedules and samples like ModelRunner; the forward (and every KV copy) runs on all
    ranks, each over its heads, with this rank's logits sampled."""

    def __init__(self, config: EngineConfig, model: LlamaModel, collectives: DeviceCollectives,
                 step_group: dist.ProcessGroup | None) -> None:
        """model: rank 0's part (see executor.rank_model); the other ranks run theirs.
        collectives, step_group: the ranks' device and step groups (see ranks.RankGroups)."""
        super().__init__(config, model)
        self.executor = RankExecutor(model, self.kv_cache, self.swapper, config.tensor_parallel_size, 0, collectives)
        self.step_group = step_group
        m = config.model
        self.layout = KVLayout(m.num_layers, config.num_kv_blocks, config.block_size, m.num_kv_heads, m.head_dim,
                               config.kv_cache_dtype_name)
        """The pool as other workers see it: every KV head."""
        self.kv_writes = PendingKVWrites(self.layout, self.kv_cache.shape[2])
        """KV that other workers sent (a KVReceiver's sink), for the next message."""

    def swap(self, batch: ScheduledBatch) -> None:
        writes = self.kv_writes.take()
        if writes is not None or batch.swap_out or batch.copies or batch.swap_in:
            self._execute(StepMessage(StepOp.SWAP, writes, batch.swap_out, batch.copies, batch.swap_in))

    def forward(self, batch: ScheduledBatch, on_layer_stored: Callable[[int], None] | None,
                send_slots: np.ndarray | None) -> torch.Tensor:
        # On the host: the message travels on the gloo group, then every rank (this one too)
        # copies what its forward reads onto its device in one transfer.
        input_ids, positions, meta, logits_indices = self.prepare(batch, device=HOST)
        gather = None if send_slots is None else torch.from_numpy(np.asarray(send_slots, dtype=np.int64))
        msg = StepMessage(StepOp.FORWARD, self.kv_writes.take(),
                          forward=ForwardInputs(input_ids, positions, meta, gather, logits_indices))
        logits = self._execute(msg, on_layer_stored)
        assert logits is not None  # this (the first) rank's forward returns the logits
        return logits

    def gathered_rows(self, start: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([num_rows, every KV head, head_dim], on the device) of
        send_slots[start:start + num_rows] at the layer just stored (call from on_layer_stored)."""
        assert self.executor.gathered is not None, "call from on_layer_stored, with send_slots"
        k, v = self.executor.gathered
        return k[start:start + num_rows], v[start:start + num_rows]

    def _execute(self, msg: StepMessage, on_layer_stored: Callable[[int], None] | None = None) -> torch.Tensor | None:
        broadcast_step(msg, self.step_group)
        return self.executor.execute(msg, on_layer_stored)
