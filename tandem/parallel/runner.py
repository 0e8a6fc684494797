"""The first rank's model runner: every step goes to all ranks as one message, then runs here too."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.kvcache.prefix_tier import PrefixTier
from tandem.kvtransfer.protocol import KVLayout
from tandem.model.llama import LlamaModel
from tandem.parallel.executor import DeviceCollectives, RankExecutor
from tandem.parallel.kv_writes import PendingKVWrites
from tandem.parallel.rank_tier import RankTier
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
        self.tier: RankTier | None = None
        """The KV tiers (see attach_tier), or None."""

    def tier_pool(self) -> torch.Tensor:
        """A one-block pool of every KV head on the host: the ranks' pools hold a share each."""
        m = self.config.model
        return torch.empty((m.num_layers, 2, 1, self.config.block_size, m.num_kv_heads, m.head_dim),
                           dtype=self.kv_cache.dtype, device=HOST)

    def attach_tier(self, first: PrefixTier, pool: torch.Tensor) -> PrefixTier:
        self.tier = RankTier(first, pool, self.kv_writes)
        return self.tier

    def swap(self, batch: ScheduledBatch) -> None:
        writes = self.kv_writes.take()
        if writes is not None or batch.swap_out or batch.copies or batch.swap_in or self._has_offloads:
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

    @property
    def _has_offloads(self) -> bool:
        return self.tier is not None and self.tier.has_offloads

    def _execute(self, msg: StepMessage, on_layer_stored: Callable[[int], None] | None = None) -> torch.Tensor | None:
        offloads = [] if self.tier is None else self.tier.take_offloads()
        if offloads:
            msg = dataclasses.replace(msg, gather_blocks=[block_id for block_id, _ in offloads])
        broadcast_step(msg, self.step_group)
        logits = self.executor.execute(msg, on_layer_stored)
        if offloads:
            assert self.tier is not None and self.executor.gathered_blocks is not None
            self.tier.store_gathered(offloads, self.executor.gathered_blocks)
            self.executor.gathered_blocks = None
        return logits
