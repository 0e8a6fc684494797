"""What the first rank of a tensor-parallel worker tells the others each step, and how it
travels: torch.distributed broadcasts of plain tensors (a fixed-size int64 header, then
one int64 tensor of every index, then the KV rows that arrived from another worker).
Nothing is pickled: every field is a number or a tensor of numbers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tandem.kernels.attention_metadata import AttentionMetadata

Pairs = list[tuple[int, int]]


class StepOp(enum.IntEnum):
    STOP = 0
    """The worker shuts down: the other ranks leave their loop."""
    SWAP = 1
    """Only KV writes and block copies (a step's swaps, before its forward)."""
    FORWARD = 2
    """KV writes, then one forward pass."""


@dataclass(frozen=True)
class ForwardInputs:
    """One packed step, as ModelRunner.prepare builds it."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    gather_slots: torch.Tensor | None = None
    """[num_slots] int64: cache slots whose K and V (all heads) the first rank collects after
    each layer is stored, to send to another worker; None: nothing to send this step."""


@dataclass(frozen=True)
class KVWrites:
    """KV rows another worker sent, to be written into every rank's own heads."""

    index: torch.Tensor  # [num_rows] int64: (layer * 2 + kv) * num_slots + slot
    rows: torch.Tensor  # [num_rows, num_kv_heads (all of the model's), head_dim]


@dataclass(frozen=True)
class StepMessage:
    op: StepOp
    writes: KVWrites | None = None
    swap_out: Pairs = field(default_factory=list)
    copies: Pairs = field(default_factory=list)
    swap_in: Pairs = field(default_factory=list)
    forward: ForwardInputs | None = None


# header: op, swap_out, copies, swap_in, writes, tokens, decodes, max decode context,
# prefills, decode table width, prefill table width, gather slots
HEADER_LEN = 12


def broadcast_step(msg: StepMessage) -> None:
    """Send ``msg`` from rank 0 to every other rank of the default process group."""
    f = msg.forward
    meta = None if f is None else f.meta
    header = [int(msg.op), len(msg.swap_out), len(msg.copies), len(msg.swap_in),
              0 if msg.writes is None else len(msg.writes.index), 0, 0, 0, 0, 0, 0, -1]
    ints = [_pairs(msg.swap_out), _pairs(msg.copies), _pairs(msg.swap_in)]
    if msg.writes is not None:
        ints.append(msg.writes.index)
    if f is not None:
        header[5:11] = [len(f.input_ids), meta.num_decode_tokens, meta.max_decode_context_len, meta.num_prefills,
                        meta.decode_block_tables.shape[1], meta.prefill_block_tables.shape[1]]
        header[11] = -1 if f.gather_slots is None else len(f.gather_slots)
        ints += [f.input_ids, f.positions, meta.slot_mapping, meta.decode_block_tables.flatten(),
                 meta.decode_context_lens, meta.prefill_layout.flatten(), meta.prefill_block_tables.flatten()]
        if f.gather_slots is not None:
            ints.append(f.gather_slots)
    dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0)
    payload = torch.cat([t.to(torch.int64).flatten() for t in ints])
    if len(payload):
        dist.broadcast(payload, src=0)
    if msg.writes is not None and len(msg.writes.index):
        dist.broadcast(msg.writes.rows.contiguous(), src=0)


def receive_step(row_shape: tuple[int, int], dtype: torch.dtype) -> StepMessage:
    """The next message rank 0 broadcasts (on any other rank). row_shape: (all KV heads, head_dim)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0)
    (op, n_out, n_copies, n_in, n_writes, n_tokens, n_decode, max_decode_len, n_prefills, decode_width,
     prefill_width, n_gather) = header.tolist()
    sizes = [2 * n_out, 2 * n_copies, 2 * n_in, n_writes]
    if op == StepOp.FORWARD:
        sizes += [n_tokens, n_tokens, n_tokens, n_decode * decode_width, n_decode, n_prefills * 3,
                  n_prefills * prefill_width, max(n_gather, 0)]
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    if len(payload):
        dist.broadcast(payload, src=0)
    parts = list(torch.split(payload, sizes))
    swap_out, copies, swap_in = (_unpairs(parts[i]) for i in range(3))
    writes = None
    if n_writes:
        rows = torch.empty(n_writes, *row_shape, dtype=dtype)
        dist.broadcast(rows, src=0)
        writes = KVWrites(parts[3], rows)
    forward = None
    if op == StepOp.FORWARD:
        input_ids, positions, slots, decode_tables, decode_lens, layout, prefill_tables, gather = parts[4:]
        layout = layout.view(n_prefills, 3)
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=n_decode,
            decode_block_tables=decode_tables.view(n_decode, decode_width), decode_context_lens=decode_lens,
            max_decode_context_len=max_decode_len,
            prefill_query_starts=tuple(layout[:, 0].tolist()), prefill_query_lens=tuple(layout[:, 1].tolist()),
            prefill_context_lens=tuple(layout[:, 2].tolist()),
            prefill_block_tables=prefill_tables.view(n_prefills, prefill_width), prefill_layout=layout,
        )
        forward = ForwardInputs(input_ids, positions, meta, None if n_gather < 0 else gather)
    return StepMessage(StepOp(op), writes, swap_out, copies, swap_in, forward)


def _pairs(pairs: Pairs) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1)


def _unpairs(flat: torch.Tensor) -> Pairs:
    return [tuple(p) for p in flat.view(-1, 2).tolist()]
