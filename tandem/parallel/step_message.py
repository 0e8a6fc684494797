"""What the first rank of a tensor-parallel worker tells the others each step, and how it
travels: torch.distributed broadcasts of host tensors on the ranks' CPU (gloo) group, as
vLLM sends its metadata. Nothing is pickled: every field is a number or a tensor of numbers.

On the wire: a fixed header, then one int64 tensor (the host ints: op-specific counts,
shapes, block pairs and the prefill tuples; then the device ints: every index the step
reads on the device). Each rank, the first included, then puts the device ints on its
device in one transfer (``on_device``). The KV rows that arrived from another worker do not
travel here: the first rank holds them on its device (NCCL pairs deliver them there) and
broadcasts them on the device group (executor.RankExecutor), device to device.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tandem.engine import step_inputs
from tandem.kernels.attention_metadata import AttentionMetadata, DecodeGroup

Pairs = list[tuple[int, int]]

HOST = torch.device("cpu")
"""Where a step message is built and travels."""


class StepOp(enum.IntEnum):
    STOP = 0
    """The worker shuts down: the other ranks leave their loop."""
    SWAP = 1
    """Only KV writes and block copies (a step's swaps, before its forward)."""
    FORWARD = 2
    """KV writes, then one forward pass."""


@dataclass(frozen=True)
class ForwardInputs:
    """One packed step, as ModelRunner.prepare builds it (on the host to travel, then on a
    rank's device to run)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    gather_slots: torch.Tensor | None = None
    """[num_slots] int64: cache slots whose K and V (all heads) the first rank collects after
    each layer is stored, to send to another worker; None: nothing to send this step."""
    logits_indices: torch.Tensor | None = None
    """[num_logits] int64: the rows the first rank computes logits for (the others ignore it);
    it travels with the rest so that the first rank's step takes the same one transfer."""


@dataclass(frozen=True)
class KVWrites:
    """KV rows another worker sent, to be written into every rank's own heads."""

    index: torch.Tensor  # [num_rows] int64: (layer * 2 + kv) * (slots per layer of the pools) + slot
    rows: torch.Tensor | None
    """[num_rows, num_kv_heads (all of the model's), head_dim] on the first rank; None in a
    message as the other ranks receive it (the rows follow on the device group)."""


@dataclass(frozen=True)
class StepMessage:
    """One step of every rank: blocks gathered for the KV tiers, KV writes, swaps (host block
    ids), then maybe a forward."""

    op: StepOp
    writes: KVWrites | None = None
    swap_out: Pairs = field(default_factory=list)
    copies: Pairs = field(default_factory=list)
    swap_in: Pairs = field(default_factory=list)
    forward: ForwardInputs | None = None
    gather_blocks: list[int] = field(default_factory=list)
    """Pool blocks the first rank collects every KV head of, before anything else in the
    message writes them: blocks its KV tiers took since the last message (rank_tier.py)."""


HEADER_LEN = 4
"""header: op, number of host ints, number of device ints, number of KV rows."""


def device_parts(msg: StepMessage) -> dict[str, torch.Tensor]:
    """The tensors of ``msg`` that the step reads on the device, by name, in wire order."""
    parts: dict[str, torch.Tensor] = {}
    if msg.writes is not None:
        parts["writes_index"] = msg.writes.index
    f = msg.forward
    if f is not None:
        m = f.meta
        parts.update(input_ids=f.input_ids, positions=f.positions, slot_mapping=m.slot_mapping,
                     decode_block_tables=m.decode_block_tables, decode_context_lens=m.decode_context_lens,
                     prefill_block_tables=m.prefill_block_tables, prefill_layout=m.prefill_layout)
        for g, group in enumerate(m.decode_groups):
            parts[f"decode_group_{g}"] = group.seq_indices
        if f.gather_slots is not None:
            parts["gather_slots"] = f.gather_slots
        if f.logits_indices is not None:
            parts["logits_indices"] = f.logits_indices
    return parts


def with_parts(msg: StepMessage, parts: dict[str, torch.Tensor], rows: torch.Tensor | None) -> StepMessage:
    """``msg`` with its device parts (see device_parts) and KV rows replaced; the host fields kept."""
    writes = None if msg.writes is None else KVWrites(parts["writes_index"], rows)
    f = msg.forward
    forward = None
    if f is not None:
        groups = tuple(DecodeGroup(parts[f"decode_group_{g}"], group.num_blocks)
                       for g, group in enumerate(f.meta.decode_groups))
        meta = dataclasses.replace(
            f.meta, slot_mapping=parts["slot_mapping"], decode_block_tables=parts["decode_block_tables"],
            decode_context_lens=parts["decode_context_lens"], prefill_block_tables=parts["prefill_block_tables"],
            prefill_layout=parts["prefill_layout"], decode_groups=groups)
        forward = ForwardInputs(parts["input_ids"], parts["positions"], meta, parts.get("gather_slots"),
                                parts.get("logits_indices"))
    return dataclasses.replace(msg, writes=writes, forward=forward)


def on_device(msg: StepMessage, device: torch.device) -> StepMessage:
    """``msg`` (host tensors) with what the step reads on ``device``: every index in one
    transfer (step_inputs.to_device, which tests replace under FakeTensorMode), the KV rows
    in a second when there are any on the host (rows already on the device stay as they are;
    on the CPU: one concatenation, the rows themselves)."""
    parts = device_parts(msg)
    flat = torch.cat([torch.zeros(0, dtype=torch.int64), *(t.to(torch.int64).reshape(-1) for t in parts.values())])
    on = step_inputs.to_device(flat, device).split([t.numel() for t in parts.values()])
    moved = {name: t.view(part.shape) for (name, part), t in zip(parts.items(), on)}
    rows = None if msg.writes is None or msg.writes.rows is None else step_inputs.to_device(msg.writes.rows, device)
    return with_parts(msg, moved, rows)


def encode(msg: StepMessage) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (header [HEADER_LEN], ints [host ints + device ints]): host tensors (no KV rows)."""
    host: list[int] = [len(msg.gather_blocks), *msg.gather_blocks]
    for pairs in (msg.swap_out, msg.copies, msg.swap_in):
        host.append(len(pairs))
        host.extend(x for pair in pairs for x in pair)
    f = msg.forward
    if f is not None:
        m = f.meta
        host += [len(f.input_ids), m.num_decode_tokens, m.max_decode_context_len, m.decode_block_tables.shape[1],
                 m.num_prefills, m.prefill_block_tables.shape[1]]
        host += [*m.prefill_query_starts, *m.prefill_query_lens, *m.prefill_context_lens, len(m.decode_groups)]
        for group in m.decode_groups:
            host += [len(group.seq_indices), group.num_blocks]
        host += [-1 if t is None else len(t) for t in (f.gather_slots, f.logits_indices)]
    parts = [t.to(torch.int64).reshape(-1) for t in device_parts(msg).values()]
    ints = torch.cat([torch.tensor(host, dtype=torch.int64), *parts])
    num_rows = 0 if msg.writes is None else len(msg.writes.index)
    header = torch.tensor([int(msg.op), len(host), len(ints) - len(host), num_rows])
    return header, ints


def decode(header: list[int], ints: torch.Tensor) -> StepMessage:
    """The message ``encode`` made (header as ints; ints as received): host tensors, views of
    ``ints``; its KV writes (if any) without their rows."""
    op, num_host, _, num_rows = header
    host = iter(ints[:num_host].tolist())
    take = lambda n: [next(host) for _ in range(n)]  # noqa: E731
    gather_blocks = take(next(host))
    swap_out, copies, swap_in = ([tuple(take(2)) for _ in range(next(host))] for _ in range(3))
    shapes: dict[str, tuple[int, ...]] = {}
    if num_rows:
        shapes["writes_index"] = (num_rows,)
    if op == StepOp.FORWARD:
        num_tokens, num_decode, max_decode_len, decode_width, num_prefills, prefill_width = take(6)
        starts, query_lens, context_lens = (tuple(take(num_prefills)) for _ in range(3))
        groups = [take(2) for _ in range(next(host))]  # (number of rows, blocks of the longest)
        num_gather, num_logits = take(2)
        shapes.update(input_ids=(num_tokens,), positions=(num_tokens,), slot_mapping=(num_tokens,),
                      decode_block_tables=(num_decode, decode_width), decode_context_lens=(num_decode,),
                      prefill_block_tables=(num_prefills, prefill_width), prefill_layout=(num_prefills, 3))
        shapes.update({f"decode_group_{g}": (n,) for g, (n, _) in enumerate(groups)})
        if num_gather >= 0:
            shapes["gather_slots"] = (num_gather,)
        if num_logits >= 0:
            shapes["logits_indices"] = (num_logits,)
    flat = ints[num_host:].split([_numel(s) for s in shapes.values()])
    parts = {name: t.view(shape) for (name, shape), t in zip(shapes.items(), flat)}
    writes = KVWrites(parts["writes_index"], None) if num_rows else None
    forward = None
    if op == StepOp.FORWARD:
        meta = AttentionMetadata(
            slot_mapping=parts["slot_mapping"], num_decode_tokens=num_decode,
            decode_block_tables=parts["decode_block_tables"], decode_context_lens=parts["decode_context_lens"],
            max_decode_context_len=max_decode_len, prefill_query_starts=starts, prefill_query_lens=query_lens,
            prefill_context_lens=context_lens, prefill_block_tables=parts["prefill_block_tables"],
            prefill_layout=parts["prefill_layout"],
            decode_groups=tuple(DecodeGroup(parts[f"decode_group_{g}"], num_blocks)
                                for g, (_, num_blocks) in enumerate(groups)),
        )
        forward = ForwardInputs(parts["input_ids"], parts["positions"], meta, parts.get("gather_slots"),
                                parts.get("logits_indices"))
    return StepMessage(StepOp(op), writes, swap_out, copies, swap_in, forward, gather_blocks)


def broadcast_step(msg: StepMessage, group: dist.ProcessGroup | None = None) -> None:
    """Send ``msg`` (host tensors) from rank 0 to every other rank of ``group`` (a gloo group;
    None: the default group). NOTE: not its KV rows: they follow on the device group, in
    RankExecutor.execute (never through the host when they arrived on the device)."""
    header, ints = encode(msg)
    dist.broadcast(header, src=0, group=group)
    if len(ints):
        dist.broadcast(ints, src=0, group=group)


def receive_step(group: dist.ProcessGroup | None = None) -> StepMessage:
    """The next message rank 0 broadcasts on ``group`` (on any other rank), as host tensors;
    its KV writes come without rows (RankExecutor.execute receives them)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    fields = header.tolist()
    _, num_host, num_device, _ = fields
    ints = torch.empty(num_host + num_device, dtype=torch.int64)
    if len(ints):
        dist.broadcast(ints, src=0, group=group)
    return decode(fields, ints)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
