"""Turns a scheduled batch into tensors, runs the model over the KV cache, samples."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.decoding.draft_verify import sample_step
from tandem.decoding.grammar_mask import apply_grammar_masks
from tandem.engine import step_inputs
from tandem.engine.cuda_graphs import CudaGraphDevice, DecodeGraphs, GraphDevice, graphs_apply, padded_decode_size
from tandem.engine.device_random import draw_generator
from tandem.engine.logits_processors import apply_logits_processors
from tandem.engine.sampler import Sampler, StepOutput
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kernels import ops
from tandem.kernels.attention_metadata import AttentionMetadata, DecodeGroup
from tandem.kernels.paged_decode_attention import decode_group_plan
from tandem.kvcache.prefix_tier import PrefixTier
from tandem.kvcache.swap_copier import KVSwapper
from tandem.model.compiled_step import CompiledDecodeStep
from tandem.model.llama import LlamaModel
from tandem.model.quantization import pack_for_cpu_kernels

KVAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""(shape, dtype, device) -> a zeroed, contiguous KV pool tensor on device."""


def private_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool in this process's own memory on ``device``."""
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaModel, allocate_kv: KVAllocator = private_pool,
                 pad_decode: bool | None = None, graph_device: GraphDevice | None = None) -> None:
        """allocate_kv: where the KV pool lives (a decode worker's may be in shared memory).
        pad_decode: pad decode-only batches to a few static sizes (padded_decode_size), as
        CUDA graphs need; default: on CUDA only (on the CPU padding is work for nothing).
        graph_device: replay decode steps as graphs captured through it (default: on CUDA,
        CudaGraphDevice, unless config.enforce_eager; see cuda_graphs.py). Graphs need padding."""
        self.config = config
        self.model = model
        self.pad_decode = config.device.type == "cuda" if pad_decode is None else pad_decode
        m = config.model
        # NOTE: with padding, the pool has one block more than the block manager hands out:
        # the scratch block that padding rows write to.
        num_blocks = config.num_kv_blocks + (1 if self.pad_decode else 0)
        self.scratch_block_id = config.num_kv_blocks
        # kv_cache: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim], the
        # model's own KV heads (a tensor-parallel rank's share), in the KV dtype, which may differ
        # from the activations' (the store casts; attention reads it back in q's dtype)
        self.kv_cache = allocate_kv(
            (m.num_layers, 2, num_blocks, config.block_size, model.num_kv_heads, m.head_dim), config.kv_cache_dtype,
            config.device)
        self.swapper = KVSwapper(self.kv_cache, config.num_swap_blocks)
        self.sampler = Sampler()
        # The compiled CPU kernels loaded (built if missing) and their weight layouts made now,
        # before any request: never on a step.
        ops.prepare_cpu_kernels(config.device, config.dtype)
        pack_for_cpu_kernels(model.weights, config.device, config.dtype, config.activation_quantization)
        self.compiled_step = None if config.enforce_eager else CompiledDecodeStep.for_model(
            model, config.tensor_parallel_size)
        """Decode steps as one compiled call on the CPU (None: every step eager; see compiled_step.py)."""
        self.graphs: DecodeGraphs | None = None
        """The decode steps' captured graphs (None: every step eager)."""
        if graph_device is None and graphs_apply(config):
            graph_device = CudaGraphDevice(config.device)
        # NOTE: at tensor_parallel_size > 1 never: the ranks' all-reduces are not captured.
        if (graph_device is not None and self.pad_decode and not config.enforce_eager
                and config.tensor_parallel_size == 1):
            # At start, after the KV pool: the graphs capture its address.
            self.graphs = DecodeGraphs(self._model_forward, config, self.scratch_block_id, m.vocab_size, graph_device)
            self.graphs.capture()

    def tier_pool(self) -> torch.Tensor:
        """What KV tiers copy blocks out of and into (kv_tiers.py): the pool itself."""
        return self.kv_cache

    def attach_tier(self, first: PrefixTier, pool: torch.Tensor) -> PrefixTier:
        """The tier the block manager calls, given ``first``, the first tier of a chain built
        over ``pool`` (what tier_pool gave): that tier itself."""
        return first

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
        # A layer hook is host code between layers: a graph would skip it.
        if self.graphs is not None and on_layer_stored is None and self.graphs.can_replay(input_ids, meta):
            return self.graphs.replay(input_ids, positions, meta, logits_indices)
        if self.compiled_step is not None and on_layer_stored is None and self.compiled_step.can_run(input_ids, meta):
            return self.compiled_step.forward(input_ids, positions, self.kv_cache, meta, logits_indices)
        return self.model.forward(input_ids, positions, self.kv_cache, meta, logits_indices, on_layer_stored)

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       logits_indices: torch.Tensor) -> torch.Tensor:
        """The model over this runner's KV cache: what a graph captures."""
        return self.model.forward(input_ids, positions, self.kv_cache, meta, logits_indices)

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepOutput:
        """Draw every sample target's tokens from the forward's logits."""
        # Each sample target draws from its entry's rows: a root's forks share the root's.
        rows: list[int] = []
        targets: list[Sequence] = []
        generators: list[torch.Generator | None] = []
        drafts: list[list[int]] = []
        offset = 0
        for i in range(len(batch.seqs)):
            if not batch.samples(i):
                continue
            num_rows = 1 + batch.num_drafts(i)
            for target in batch.sample_targets(i):
                rows.extend(range(offset, offset + num_rows))
                targets.append(target)
                # A seeded target draws at its position from a generator made for it: the draw at
                # position p depends on the seed and p alone (device_random.py).
                seed = target.params.completion_seed(target.index)
                generators.append(None if seed is None else draw_generator(seed, target.num_tokens))
                drafts.append(batch.draft_token_ids[i] if batch.draft_token_ids else [])
            offset += num_rows
        if rows == list(range(logits.shape[0])):  # (the usual case: a row each, in order)
            raw = logits
        else:
            raw = logits[step_inputs.to_device(torch.tensor(rows, dtype=torch.long), logits.device)]
        # NOTE: a target whose logits are processed has no drafts (Speculation.propose).
        processed = apply_logits_processors(raw, targets, self.config.model.eos_token_ids)
        if any(t.grammar is not None for t in targets):
            processed = apply_grammar_masks(processed, [t.grammar for t in targets])
        return sample_step(self.sampler, processed, [t.params for t in targets], generators, drafts,
                           len(self.config.model.eos_token_ids), raw_logits=raw)

    def prepare(self, batch: ScheduledBatch, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """-> (input_ids [T], positions [T], AttentionMetadata, logits_indices [L]): one
        logits row per sampling entry, or 1 + its drafts for a speculative decode. All on
        ``device`` (default: the engine's), from one copy (step_inputs.py); a decode-only
        batch is padded to its bucket (see padded_decode_size). A tensor-parallel runner
        asks for them on the host, to broadcast them to its ranks."""
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
        decode_width = None
        if self.pad_decode and num_decode == len(batch.seqs) and offset == num_decode:
            # Padding rows write their KV into the scratch block and attend to it alone.
            num_padded = padded_decode_size(num_decode) - num_decode
            scratch = self.scratch_block_id
            token_ids.append(np.zeros(num_padded, dtype=np.int64))
            positions.append(np.zeros(num_padded, dtype=np.int64))
            slots.append(np.full(num_padded, scratch * bs, dtype=np.int64))
            decode_tables += [[scratch]] * num_padded
            decode_lens += [1] * num_padded
            num_decode += num_padded
            decode_width = -(-self.config.max_model_len // bs)
        inputs = step_inputs.StepInputs()
        num_tokens = num_decode + sum(query_lens)
        inputs.add("input_ids", np.concatenate(token_ids), (num_tokens,))
        inputs.add("positions", np.concatenate(positions), (num_tokens,))
        inputs.add("slot_mapping", np.concatenate(slots), (num_tokens,))
        inputs.add("logits_indices", logits_indices, (len(logits_indices),))
        decode_table = padded_tables(decode_tables, decode_width)
        inputs.add("decode_block_tables", decode_table, decode_table.shape)
        inputs.add("decode_context_lens", decode_lens, (num_decode,))
        prefill_table = padded_tables(prefill_tables)
        inputs.add("prefill_block_tables", prefill_table, prefill_table.shape)
        inputs.add("prefill_layout", list(zip(starts, query_lens, context_lens)), (len(starts), 3))
        plan = decode_group_plan(decode_lens, bs)
        for g, (rows, _) in enumerate(plan):
            inputs.add(f"decode_group_{g}", rows, (len(rows),))
        t = inputs.upload(self.config.device if device is None else device)
        meta = AttentionMetadata(
            slot_mapping=t["slot_mapping"],
            num_decode_tokens=num_decode,
            decode_block_tables=t["decode_block_tables"],
            decode_context_lens=t["decode_context_lens"],
            max_decode_context_len=max(decode_lens, default=0),
            prefill_query_starts=tuple(starts),
            prefill_query_lens=tuple(query_lens),
            prefill_context_lens=tuple(context_lens),
            prefill_block_tables=t["prefill_block_tables"],
            prefill_layout=t["prefill_layout"],
            decode_groups=tuple(DecodeGroup(t[f"decode_group_{g}"], num_blocks)
                                for g, (_, num_blocks) in enumerate(plan)),
        )
        return t["input_ids"], t["positions"], meta, t["logits_indices"]


def padded_tables(tables: list[list[int]], width: int | None = None) -> np.ndarray:
    """-> [len(tables), width (default: the longest)] int64, each table padded with block 0."""
    width = max((len(t) for t in tables), default=0) if width is None else width
    return np.asarray([t + [0] * (width - len(t)) for t in tables], dtype=np.int64).reshape(len(tables), width)
