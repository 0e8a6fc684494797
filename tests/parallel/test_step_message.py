"""Step messages cross a real gloo group (two processes) intact, with no pickle on the way."""

from __future__ import annotations

import multiprocessing
import socket

import torch
import torch.distributed as dist

from step_peer import receive_all
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.parallel.step_message import ForwardInputs, KVWrites, StepMessage, StepOp, broadcast_step
from tandem.sampling_params import SamplingParams


def mixed_batch(block_size: int = 4) -> ScheduledBatch:
    """Two decodes and a chunked prefill after a cached prefix."""
    seqs = []
    for i, (n, computed, blocks) in enumerate([(6, 5, [3, 1]), (9, 8, [0, 2, 7]), (11, 4, [5, 6, 4])]):
        seq = Sequence(str(i), list(range(100, 100 + n)), SamplingParams(temperature=0), i, None)
        seq.block_ids = blocks
        seq.num_computed_tokens = computed
        seqs.append(seq)
    return ScheduledBatch(seqs, [1, 1, 5])


def test_messages_arrive_field_for_field():
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs only the block size
    runner.config = type("C", (), {"block_size": 4})()
    input_ids, positions, meta, _ = runner.prepare(mixed_batch())
    writes = KVWrites(torch.tensor([5, 40]), torch.arange(12, dtype=torch.float32).view(2, 3, 2))
    messages = [
        StepMessage(StepOp.SWAP, writes, swap_out=[(3, 0)], copies=[(1, 2), (4, 6)], swap_in=[]),
        StepMessage(StepOp.FORWARD, None, forward=ForwardInputs(input_ids, positions, meta, torch.tensor([9, 2, 9]))),
        StepMessage(StepOp.FORWARD, None, forward=ForwardInputs(input_ids, positions, meta)),
        StepMessage(StepOp.STOP),
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    peer = context.Process(target=receive_all, args=(init_method, results))
    peer.start()
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=2)
    try:
        for msg in messages:
            broadcast_step(msg)
        got = [results.get(timeout=60) for _ in messages]
    finally:
        dist.destroy_process_group()
        peer.join(timeout=60)
    assert peer.exitcode == 0
    assert got[0] == dict(op=1, swap_out=[(3, 0)], copies=[(1, 2), (4, 6)], swap_in=[],
                          writes=([5, 40], writes.rows.tolist()))
    forward = dict(op=2, swap_out=[], copies=[], swap_in=[], writes=None,
                   input_ids=[105, 108, 104, 105, 106, 107, 108], positions=[5, 8, 4, 5, 6, 7, 8],
                   # slot = block_ids[position // 4] * 4 + position % 4
                   slots=[5, 28, 24, 25, 26, 27, 16], num_decode=2, decode_tables=[[3, 1, 0], [0, 2, 7]],
                   decode_lens=[6, 9], max_decode=9, starts=(0,), query_lens=(5,), context_lens=(9,),
                   prefill_tables=[[5, 6, 4]], layout=[[0, 5, 9]])
    assert got[1] == {**forward, "gather": [9, 2, 9]}
    assert got[2] == {**forward, "gather": None}
    assert got[3]["op"] == 0
