"""The first rank's model runner: every step goes to all ranks as one message, then runs here too."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.kvtransfer.protocol import KVLayout
from tandem.model.llama import LlamaModel
from tandem.parallel.executor import RankExecutor
from tandem.parallel.kv_writes import PendingKVWrites
from tandem.parallel.step_message import ForwardInputs, StepMessage, StepOp, broadcast_step


class TensorParallelRunner(ModelRunner):
    """Schedules and samples like ModelRunner; the forward (and every KV copy) runs on all
    ranks, each over its heads, with this rank's logits sampled."""

    def __init__(self, config: EngineConfig, model: LlamaModel) -> None:
        """model: rank 0's part (see executor.rank_model); the other ranks run theirs."""
        super().__init__(config, model)
        self.executor = RankExecutor(model, self.kv_cache, self.swapper, config.tensor_parallel_size, 0)
        m = config.model
        self.layout = KVLayout(m.num_layers, config.num_kv_blocks, config.block_size, m.num_kv_heads, m.head_dim,
                               config.dtype_name)
        """The pool as other workers see it: every KV head."""
        self.kv_writes = PendingKVWrites(self.layout)
        """KV that other workers sent (a KVReceiver's sink), for the next message."""

    def swap(self, batch: ScheduledBatch) -> None:
        writes = self.kv_writes.take()
        if writes is not None or batch.swap_out or batch.copies or batch.swap_in:
            self._execute(StepMessage(StepOp.SWAP, writes, batch.swap_out, batch.copies, batch.swap_in))

    def forward(self, batch: ScheduledBatch, on_layer_stored: Callable[[int], None] | None,
                send_slots: np.ndarray | None) -> torch.Tensor:
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        gather = None if send_slots is None else torch.from_numpy(np.asarray(send_slots, dtype=np.int64))
        msg = StepMessage(StepOp.FORWARD, self.kv_writes.take(),
                          forward=ForwardInputs(input_ids, positions, meta, gather))
        return self._execute(msg, logits_indices, on_layer_stored)

    def gathered_rows(self, start: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([num_rows, every KV head, head_dim]) of send_slots[start:start + num_rows]
        at the layer just stored (call from on_layer_stored)."""
        k, v = self.executor.gathered
        return k[start:start + num_rows], v[start:start + num_rows]

    def _execute(self, msg: StepMessage, logits_indices: torch.Tensor | None = None,
                 on_layer_stored: Callable[[int], None] | None = None) -> torch.Tensor | None:
        broadcast_step(msg)
        return self.executor.execute(msg, logits_indices, on_layer_stored)
