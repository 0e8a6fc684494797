"""Decode steps replayed as CUDA graphs, one captured per batch-size bucket (as vLLM's
CUDAGraphRunner and SGLang's CudaGraphRunner do): a decode step is a few hundred small kernel
launches, and a replay launches them all at once.

A graph replays the kernels it captured on the addresses it captured, with the host values
(shapes, grid sizes, Python ints) it saw then. So each bucket owns static input buffers, and
a step's inputs are copied into them before the replay; and the attention metadata's host
integers are fixed per bucket, not per step:

- the block tables are ``max_model_len / block_size`` blocks wide (ModelRunner.prepare pads a
  decode-only batch's tables to that width already);
- ``max_decode_context_len`` is ``max_model_len``: the Triton kernel sizes its splits by it,
  and a split past a sequence's context attends to nothing (costs a launch, no reads);
- one decode group of every row, as wide as the table (the torch path's grouping by length
  is a host decision per step; masking by ``decode_context_lens`` keeps it exact).

Anything else (a prefill or mixed step, speculative decodes, a bucket past the largest
captured, a step with a layer hook) runs eagerly. All device-specific calls go through
``CudaGraphDevice``, so that the CPU tests run this bookkeeping with a stand-in.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from tandem.config import EngineConfig
from tandem.kernels.attention_metadata import AttentionMetadata, DecodeGroup
from tandem.kvcache.memory_plan import estimated_graph_pool_bytes

logger = logging.getLogger(__name__)

StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
"""(input_ids [B], positions [B], meta, logits_indices [L]) -> logits [L, vocab] float32: the
model's forward over the engine's KV cache."""


def padded_decode_size(num_seqs: int) -> int:
    """The bucket a decode-only batch of ``num_seqs`` is padded to: 1, 2, 4, 8, then
    multiples of 8, so that a step's shapes come from a few sizes (CUDA graphs capture one
    per size)."""
    if num_seqs <= 8:
        return 1 << max(0, num_seqs - 1).bit_length()
    return -(-num_seqs // 8) * 8


def capture_sizes(max_num_seqs: int, max_capture_size: int) -> list[int]:
    """The buckets captured, ascending: every bucket a decode-only batch of at most
    ``max_num_seqs`` pads to, up to ``max_capture_size`` (larger batches run eagerly)."""
    limit = min(padded_decode_size(max_num_seqs), max_capture_size)
    sizes: list[int] = []
    n = 1
    while (size := padded_decode_size(n)) <= limit:
        sizes.append(size)
        n = size + 1
    return sizes


def graphs_apply(config: EngineConfig) -> bool:
    """Whether an engine with ``config`` captures its decode steps: on CUDA, one rank, unless
    enforce_eager (a tensor-parallel step's all-reduces would need capturing on every rank);
    never a prefill worker's (reserve_whole_prompts: its requests end at their first token, so
    it never runs a decode step)."""
    return (config.device.type == "cuda" and not config.enforce_eager and config.tensor_parallel_size == 1
            and not config.reserve_whole_prompts)


def planned_graph_bytes(config: EngineConfig) -> int:
    """Device memory the graphs will hold, estimated from the shapes, for the memory plan (the
    pool is measured only at capture, after the KV pool it depends on is allocated)."""
    if not graphs_apply(config):
        return 0
    sizes = capture_sizes(config.max_num_seqs, config.max_cudagraph_capture_size)
    return estimated_graph_pool_bytes(config.model, sizes, -(-config.max_model_len // config.block_size),
                                      config.dtype_bytes)


class GraphDevice(Protocol):
    """The device calls of capture and replay (CudaGraphDevice; a stand-in in the CPU tests)."""

    def graph_pool(self) -> Any:
        """A memory pool handle for captures to share."""

    def warm_up(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once before its capture (compiles kernels, settles the allocator)."""

    def capture(self, fn: Callable[[], None], static_inputs: Sequence[torch.Tensor], pool: Any) -> Any:
        """Capture ``fn`` (which reads ``static_inputs``) as a graph in ``pool`` -> the graph."""

    def replay(self, graph: Any) -> None:
        """Launch a captured graph (on the current stream)."""

    def free_bytes(self) -> int:
        """Free device memory now."""

    def synchronize(self) -> None:
        """Wait for the device's work."""


class CudaGraphDevice:
    """GraphDevice on a real CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], None]) -> None:
        # On a side stream, as torch.cuda.graph's documentation asks: the warm-up's
        # allocations then belong to no stream a capture will use.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capture(self, fn: Callable[[], None], static_inputs: Sequence[torch.Tensor], pool: Any) -> Any:
        assert all(t.device.type == "cuda" for t in static_inputs), "a graph reads device memory only"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # captures on a side stream of its own
            fn()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class BucketInputs:
    """One bucket's static inputs: a replay reads these addresses, so a step refills them."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int64, W = max_model_len / block_size
    context_lens: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [B] int64: a step's L rows first, the rest stale (their logits unread)
    meta: AttentionMetadata
    """Over the tensors above, its host integers fixed for the bucket (see the module's docstring)."""

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.context_lens,
                self.logits_indices)


class DecodeGraphs:
    """The captured decode graphs of one model runner, by bucket."""

    def __init__(self, forward: StepForward, config: EngineConfig, scratch_block_id: int, vocab_size: int,
                 device: GraphDevice) -> None:
        """scratch_block_id: the pool's block that padding rows write (ModelRunner's)."""
        self.forward = forward
        self.device = device
        self.sizes = capture_sizes(config.max_num_seqs, config.max_cudagraph_capture_size)
        self.width = -(-config.max_model_len // config.block_size)
        self.max_model_len = config.max_model_len
        self.planned_bytes = estimated_graph_pool_bytes(config.model, self.sizes, self.width, config.dtype_bytes)
        self._scratch_slot = scratch_block_id * config.block_size
        self._scratch_block = scratch_block_id
        self._torch_device = config.device
        largest = self.sizes[-1] if self.sizes else 0
        # out: [largest, vocab] float32, outside the graphs' pool: every graph copies its logits
        # into its first B rows, so no graph keeps an output of its own alive.
        self.out = torch.empty(largest, vocab_size, dtype=torch.float32, device=config.device)
        self.inputs: dict[int, BucketInputs] = {}
        self.graphs: dict[int, Any] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.num_replays = 0
        """Steps replayed so far (benchmarks check that the graphs ran)."""

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones then fit in the memory the
        largest took from the shared pool); logs each one's time and memory."""
        pool = self.device.graph_pool()
        start = time.perf_counter()
        for size in reversed(self.sizes):
            inputs = self._bucket_inputs(size)
            # NOTE: the arguments bound now: a replay must never see other tensors than the captured ones.
            fn = functools.partial(self._step, inputs, size)
            self.device.warm_up(fn)
            self.device.synchronize()
            free, t0 = self.device.free_bytes(), time.perf_counter()
            self.graphs[size] = self.device.capture(fn, (*inputs.tensors, self.out), pool)
            self.device.synchronize()
            self.inputs[size] = inputs
            # Only the capture's own memory counts: the warm-up's stays in the caching
            # allocator, for the eager steps, which the memory plan's step peak covers.
            taken = free - self.device.free_bytes()
            self.capture_bytes += taken
            logger.debug("captured the decode graph of bucket %d in %.3f s, %.1f MiB", size,
                         time.perf_counter() - t0, taken / 2**20)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode graphs (batch sizes %s) in %.1f s: %.1f MiB of device memory "
                    "(%.1f MiB planned)", len(self.sizes), ", ".join(map(str, self.sizes)), self.capture_seconds,
                    self.capture_bytes / 2**20, self.planned_bytes / 2**20)
        if self.capture_bytes > self.planned_bytes:
            logger.warning("the decode graphs took %.1f MiB more than the memory plan left them; "
                           "lower gpu_memory_utilization or run with enforce_eager if the device runs out",
                           (self.capture_bytes - self.planned_bytes) / 2**20)

    def can_replay(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step with these prepared inputs replays a graph: decode-only, padded to a
        captured bucket, its tables at the captured width."""
        size = input_ids.shape[0]
        return (meta.num_prefills == 0 and meta.num_decode_tokens == size and size in self.graphs
                and meta.decode_block_tables.shape == (size, self.width))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               logits_indices: torch.Tensor) -> torch.Tensor:
        """The step's logits [L, vocab] float32 from its bucket's graph (see can_replay).

        NOTE: a view of the shared output, valid until the next replay (the sampler's first
        read copies its rows)."""
        size = input_ids.shape[0]
        inputs = self.inputs[size]
        # The step's inputs (padding rows included: ModelRunner.prepare points them at the
        # scratch block) into the captured addresses, in stream order before the replay.
        inputs.input_ids.copy_(input_ids, non_blocking=True)
        inputs.positions.copy_(positions, non_blocking=True)
        inputs.slot_mapping.copy_(meta.slot_mapping, non_blocking=True)
        inputs.block_tables.copy_(meta.decode_block_tables, non_blocking=True)
        inputs.context_lens.copy_(meta.decode_context_lens, non_blocking=True)
        num_logits = logits_indices.shape[0]
        inputs.logits_indices[:num_logits].copy_(logits_indices, non_blocking=True)
        self.device.replay(self.graphs[size])
        self.num_replays += 1
        return self.out[:num_logits]

    def _step(self, inputs: BucketInputs, size: int) -> None:
        self.out[:size].copy_(self.forward(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices))

    def _bucket_inputs(self, size: int) -> BucketInputs:
        """Static inputs of ``size`` rows, each a padding row (scratch block, one token) until a step fills them."""
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=self._torch_device)

        block_tables = zeros(size, self.width)
        block_tables[:, 0] = self._scratch_block
        context_lens = zeros(size) + 1
        slot_mapping = zeros(size) + self._scratch_slot
        rows = torch.arange(size, dtype=torch.int64, device=self._torch_device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_decode_tokens=size, decode_block_tables=block_tables,
            decode_context_lens=context_lens, max_decode_context_len=self.max_model_len,
            prefill_query_starts=(), prefill_query_lens=(), prefill_context_lens=(),
            prefill_block_tables=zeros(0, 0), prefill_layout=zeros(0, 3),
            decode_groups=(DecodeGroup(rows, self.width),))
        return BucketInputs(zeros(size), zeros(size), slot_mapping, block_tables, context_lens, rows.clone(), meta)
