"""Turns a scheduled batch into tensors, runs the model over the KV cache, samples."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.decoding.draft_verify import sample_step
from tandem.engine.sampler import Sampler, StepOutput
from tandem.engine.scheduler import ScheduledBatch
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kvcache.swap_copier import KVSwapper
from tandem.model.llama import LlamaModel
from tandem.sampling_params import SamplingParams


KVAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""(shape, dtype) -> a zeroed, contiguous KV pool tensor."""


def private_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed pool in this process's own memory."""
    return torch.zeros(shape, dtype=dtype)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaModel, allocate_kv: KVAllocator = private_pool) -> None:
        """allocate_kv: where the KV pool lives (a decode worker's may be in shared memory)."""
        self.config = config
        self.model = model
        m = config.model
        # kv_cache: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim], the
        # model's own KV heads (a tensor-parallel rank's share)
        self.kv_cache = allocate_kv(
            (m.num_layers, 2, config.num_kv_blocks, config.block_size, model.num_kv_heads, m.head_dim), config.dtype)
        self.swapper = KVSwapper(self.kv_cache, config.num_swap_blocks)
        self.sampler = Sampler()

    def swap(self, batch: ScheduledBatch) -> None:
        """Copy the blocks the scheduler swaps out, then shared blocks the step writes
        (copy-on-write), then the blocks it swaps in; all before the step's forward.

        NOTE: in that order. A swap-out reads blocks its victim just gave up, which this very
        step may hand out again as a copy's destination or a swap-in's; a copy's source is
        still held by another sequence, so nothing before the forward writes it; and
        a step that preempts swaps nothing in."""
        self.swapper.swap_out(batch.swap_out)
        self.swapper.copy(batch.copies)
        self.swapper.swap_in(batch.swap_in)

    def run(self, batch: ScheduledBatch, on_layer_stored: Callable[[int], None] | None = None,
            send_slots: np.ndarray | None = None) -> StepOutput:
        """on_layer_stored: see LlamaModel.forward. send_slots: the cache slots whose KV
        on_layer_stored sends on (only a tensor-parallel runner, which must collect them from
        its ranks, uses them)."""
        logits = self.forward(batch, on_layer_stored, send_slots)
        return self.sample(batch, logits)

    def forward(self, batch: ScheduledBatch, on_layer_stored: Callable[[int], None] | None,
                send_slots: np.ndarray | None) -> torch.Tensor:
        """-> the logits of the batch's sampled rows (see prepare)."""
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        return self.model.forward(input_ids, positions, self.kv_cache, meta, logits_indices, on_layer_stored)

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepOutput:
        """Draw every sample target's tokens from the forward's logits."""
        # Each sample target draws from its entry's rows: a root's forks share the root's.
        rows: list[int] = []
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        drafts: list[list[int]] = []
        offset = 0
        for i in range(len(batch.seqs)):
            if not batch.samples(i):
                continue
            num_rows = 1 + batch.num_drafts(i)
            for target in batch.sample_targets(i):
                rows.extend(range(offset, offset + num_rows))
                params.append(target.params)
                generators.append(target.generator)
                drafts.append(batch.draft_token_ids[i] if batch.draft_token_ids else [])
            offset += num_rows
        return sample_step(self.sampler, logits[torch.tensor(rows, dtype=torch.long)], params, generators, drafts,
                           len(self.config.model.eos_token_ids))

    def prepare(self, batch: ScheduledBatch):
        """-> (input_ids [T], positions [T], AttentionMetadata, logits_indices [L]): one
        logits row per sampling entry, or 1 + its drafts for a speculative decode."""
        bs = self.config.block_size
        token_ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_indices: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        offset = 0
        num_decode = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_ids, dtype=np.int64)
            num_drafts = batch.num_drafts(i)
            token_ids.append(np.asarray(seq.token_ids[start:start + n - num_drafts] + batch.draft_token_ids[i]
                                        if num_drafts else seq.token_ids[start:start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            offset += n
            if batch.samples(i):
                # A speculative decode needs the target's logits after its last token and after each draft.
                logits_indices.extend(range(offset - 1 - num_drafts, offset))
            if n == 1 and not starts:  # decodes come first in the batch
                num_decode += 1
                decode_tables.append(seq.block_ids)
                decode_lens.append(start + 1)
            else:
                starts.append(offset - n - num_decode)
                query_lens.append(n)
                context_lens.append(start + n)
                prefill_tables.append(seq.block_ids)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)),
            num_decode_tokens=num_decode,
            decode_block_tables=padded_tables(decode_tables),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int64),
            max_decode_context_len=max(decode_lens, default=0),
            prefill_query_starts=tuple(starts),
            prefill_query_lens=tuple(query_lens),
            prefill_context_lens=tuple(context_lens),
            prefill_block_tables=padded_tables(prefill_tables),
            prefill_layout=torch.tensor(list(zip(starts, query_lens, context_lens)), dtype=torch.int64).view(-1, 3),
        )
        return (
            torch.from_numpy(np.concatenate(token_ids)),
            torch.from_numpy(np.concatenate(positions)),
            meta,
            torch.tensor(logits_indices, dtype=torch.int64),
        )


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """-> [len(tables), longest] int64, each table padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).view(len(tables), width)
