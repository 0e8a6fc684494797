"""One rank's part of a tensor-parallel step: write arrived KV, copy blocks, run the forward."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tandem.kvcache.swap_copier import KVSwapper
from tandem.model.llama import LlamaModel
from tandem.model.loader import LoadedModel
from tandem.model.placement import weights_on
from tandem.parallel.shard import rank_shards, shard_weights
from tandem.parallel.step_message import HOST, KVWrites, StepMessage, on_device


class DeviceCollectives:
    """The collectives of a step's forward, on the ranks' device group: NCCL between GPUs,
    gloo between CPUs. Every tensor they get is on the rank's device (the step messages
    travel on a separate gloo group: see step_message)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        """group: the device group (None: the default group)."""
        self.group = group

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' partial sums of a row-parallel projection, added up (in place)."""
        dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor) -> None:
        """The first rank's ``t`` into ``t`` on every other rank (in place)."""
        dist.broadcast(t, src=0, group=self.group)

    def gather(self, t: torch.Tensor, parts: list[torch.Tensor] | None) -> None:
        """Every rank's ``t`` into ``parts`` (one per rank) on the first rank; parts is None
        on the others."""
        dist.gather(t, parts, dst=0, group=self.group)


def rank_model(loaded: LoadedModel, tp: int, rank: int, max_model_len: int, collectives: DeviceCollectives,
               device: torch.device = HOST) -> LlamaModel:
    """Rank ``rank``'s part of ``loaded`` on ``device``: cut where ``loaded`` is (the host, so
    that no device holds the whole model), then moved (on the host: views or copies)."""
    shard = rank_shards(loaded.config, tp)[rank]
    weights = weights_on(shard_weights(loaded.weights, loaded.config, shard), device)
    return LlamaModel(loaded.config, weights, max_model_len, shard.num_heads, shard.num_kv_heads,
                      collectives.all_reduce_sum)


class RankExecutor:
    """A rank's model (its shard of the weights), KV cache (its heads, on its device) and host
    swap space.

    Every rank executes the same messages in the same order, so their caches hold the same
    blocks at all times, each with its own heads.
    """

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, swapper: KVSwapper, tp: int, rank: int,
                 collectives: DeviceCollectives) -> None:
        """kv_cache: [num_layers, 2, num_blocks, block_size, the rank's KV heads, head_dim], on
        the rank's device (where every tensor of its step lives)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.swapper = swapper
        self.collectives = collectives
        self.shards = rank_shards(model.config, tp)
        self.shard = self.shards[rank]
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        """On the first rank, after a layer is stored: the K and V rows ([num_slots, all KV
        heads, head_dim], on the device) of that step's gather_slots."""
        self.gathered_blocks: torch.Tensor | None = None
        """On the first rank, after a message with gather_blocks: those blocks' KV, every head
        ([num_layers, 2, num_blocks, block_size, all KV heads, head_dim], on the device)."""

    def execute(self, msg: StepMessage, on_layer_stored: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Apply ``msg`` (host tensors, as broadcast): its indices and KV rows go onto this
        rank's device first; then the blocks to gather (before anything writes them), KV
        writes, swaps out, copies, swaps in (see ModelRunner.swap for why in that order), then
        the forward. -> logits on the first rank, None elsewhere."""
        msg = on_device(msg, self.device)
        if msg.gather_blocks:
            self.gathered_blocks = self._gather_blocks(msg.gather_blocks)
        if msg.writes is not None:
            rows = self._arrived_rows(msg.writes)
            heads = self.shard.kv_heads
            # cache rows: [num_layers * 2 * num_slots, num_kv_heads (this rank's), head_dim]
            flat = self.kv_cache.view(-1, self.shard.num_kv_heads, self.kv_cache.shape[-1])
            flat.index_copy_(0, msg.writes.index, rows[:, heads.start:heads.stop])
        self.swapper.swap_out(msg.swap_out)
        self.swapper.copy(msg.copies)
        self.swapper.swap_in(msg.swap_in)
        f = msg.forward
        if f is None:
            return None

        slots = f.gather_slots
        hook = on_layer_stored
        if slots is not None:
            def gather_then_hook(layer: int) -> None:
                self._gather(layer, slots)
                if on_layer_stored is not None:
                    on_layer_stored(layer)

            hook = gather_then_hook
        logits_indices = f.logits_indices if self.shard.rank == 0 else None
        return self.model.forward(f.input_ids, f.positions, self.kv_cache, f.meta, logits_indices, hook)

    def _arrived_rows(self, writes: KVWrites) -> torch.Tensor:
        """The first rank's arrived KV rows (every head) on this rank's device: broadcast on
        the device group, so rows that arrived on the device (an NCCL pair's) go device to
        device, never through the host (the step message carries only their index)."""
        rows = writes.rows
        if self.shard.rank != 0:
            rows = torch.empty(len(writes.index), self.model.config.num_kv_heads, self.kv_cache.shape[-1],
                               dtype=self.kv_cache.dtype, device=self.device)
        elif rows is None:
            raise ValueError("the first rank's KV writes must carry their rows")
        self.collectives.broadcast(rows)
        return rows

    def _gather(self, layer: int, slots: torch.Tensor) -> None:
        """Collect every head of ``slots``' K and V at ``layer`` on the first rank (slots and
        every buffer on the device: the gather runs on the device group)."""
        head_dim = self.kv_cache.shape[-1]
        max_heads = max(s.num_kv_heads for s in self.shards)
        dtype, device = self.kv_cache.dtype, self.device
        # mine: [2, num_slots, max_heads, head_dim], padded: gather wants one shape from every rank
        mine = torch.zeros(2, len(slots), max_heads, head_dim, dtype=dtype, device=device)
        for kv in range(2):
            mine[kv, :, :self.shard.num_kv_heads] = self.kv_cache[layer, kv].flatten(0, 1).index_select(0, slots)
        if self.shard.rank != 0:
            self.collectives.gather(mine, None)
            return
        parts = [torch.empty_like(mine) for _ in self.shards]
        self.collectives.gather(mine, parts)
        num_kv_heads = max(s.kv_head_start + s.num_kv_heads for s in self.shards)
        full = torch.empty(2, len(slots), num_kv_heads, head_dim, dtype=dtype, device=device)
        for shard, part in zip(self.shards, parts):  # a replicated head: any holder's copy
            full[:, :, shard.kv_heads.start:shard.kv_heads.stop] = part[:, :, :shard.num_kv_heads]
        self.gathered = (full[0], full[1])

    def _gather_blocks(self, block_ids: list[int]) -> torch.Tensor | None:
        """Every head of ``block_ids``' KV, all layers, on the first rank (None elsewhere)."""
        block_size = self.kv_cache.shape[3]
        # slots: [num_blocks * block_size], block by block
        slots = (torch.tensor(block_ids, dtype=torch.int64, device=self.device)[:, None] * block_size
                 + torch.arange(block_size, device=self.device)).flatten()
        layers = []
        for layer in range(self.kv_cache.shape[0]):
            self._gather(layer, slots)
            if self.shard.rank == 0:
                assert self.gathered is not None
                layers.append(torch.stack(self.gathered))
        self.gathered = None
        if self.shard.rank != 0:
            return None
        # [num_layers, 2, num_blocks * block_size, heads, head_dim] -> blocks apart
        full = torch.stack(layers)
        return full.view(*full.shape[:2], len(block_ids), block_size, *full.shape[3:])
