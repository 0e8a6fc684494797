"""Rank 1 of a two-process gloo group for test_step_message: receives messages and reports
each one's fields as plain lists."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.parallel.step_message import StepOp, receive_step


def receive_all(init_method: str, results) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=1, world_size=2)
    try:
        while True:
            msg = receive_step((3, 2), torch.float32)
            f = msg.forward
            fields = dict(op=int(msg.op), swap_out=msg.swap_out, copies=msg.copies, swap_in=msg.swap_in,
                          writes=None if msg.writes is None else (msg.writes.index.tolist(), msg.writes.rows.tolist()))
            if f is not None:
                m = f.meta
                fields.update(input_ids=f.input_ids.tolist(), positions=f.positions.tolist(),
                              gather=None if f.gather_slots is None else f.gather_slots.tolist(),
                              slots=m.slot_mapping.tolist(), num_decode=m.num_decode_tokens,
                              decode_tables=m.decode_block_tables.tolist(), decode_lens=m.decode_context_lens.tolist(),
                              max_decode=m.max_decode_context_len, starts=m.prefill_query_starts,
                              query_lens=m.prefill_query_lens, context_lens=m.prefill_context_lens,
                              prefill_tables=m.prefill_block_tables.tolist(), layout=m.prefill_layout.tolist())
            results.put(fields)
            if msg.op is StepOp.STOP:
                return
    finally:
        dist.destroy_process_group()
