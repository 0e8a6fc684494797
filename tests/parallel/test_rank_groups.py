"""Two CPU ranks in real process groups (gloo device group, gloo step group beside it, as
ranks.join_groups makes them) run the steps of one: logits, the KV gathered for sending,
arrived KV writes and block copies, against the whole model in this process."""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket

import torch
import torch.distributed as dist
from step_peer import TINY_TP, serve_tiny_rank, tiny_config, tiny_loaded, tiny_rank

from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.model.llama import LlamaModel
from tandem.parallel.step_message import ForwardInputs, KVWrites, StepMessage, StepOp, broadcast_step
from tandem.sampling_params import SamplingParams

BLOCK = 4
NUM_SLOTS = 16 * BLOCK  # slots per layer and kv of the pools


def seq(i: int, num_tokens: int, num_computed: int, blocks: list[int]) -> Sequence:
    s = Sequence(str(i), [(11 * i + 5 * t) % TINY_TP.vocab_size for t in range(num_tokens)],
                 SamplingParams(temperature=0), i, None)
    s.block_ids = blocks
    s.num_computed_tokens = num_computed
    return s


def forward_message(runner: ModelRunner, batch: ScheduledBatch, gather: list[int] | None) -> StepMessage:
    input_ids, positions, meta, logits_indices = runner.prepare(batch)  # on the CPU: host tensors
    slots = None if gather is None else torch.tensor(gather, dtype=torch.int64)
    return StepMessage(StepOp.FORWARD, forward=ForwardInputs(input_ids, positions, meta, slots, logits_indices))


def test_two_cpu_ranks_run_the_steps_of_one():
    ref = ModelRunner(tiny_config(1), LlamaModel(TINY_TP, tiny_loaded().weights, 64))
    g = torch.Generator().manual_seed(1)
    # KV that arrived for sequence 2's first 3 tokens (block 10), every layer, K and V
    index = torch.cat([(lk * NUM_SLOTS + 40 + torch.arange(3)) for lk in range(TINY_TP.num_layers * 2)])
    rows = torch.randn(len(index), TINY_TP.num_kv_heads, TINY_TP.head_dim, generator=g)
    prefill = ScheduledBatch([seq(0, 5, 0, [0, 1]), seq(1, 7, 0, [2, 3])], [5, 7])
    gather = [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14]
    # decodes: sequence 0, sequence 2 over the arrived KV, sequence 3 over a copy of block 0
    decodes = ScheduledBatch([seq(0, 6, 5, [0, 1]), seq(2, 4, 3, [10]), seq(3, 5, 4, [5, 7])], [1, 1, 1])
    messages = [
        StepMessage(StepOp.SWAP, KVWrites(index, rows)),
        forward_message(ref, prefill, gather),
        StepMessage(StepOp.SWAP, copies=[(0, 5)]),
        # blocks 5 (the copy, before the forward writes its last slot) and 10 gathered first
        dataclasses.replace(forward_message(ref, decodes, None), gather_blocks=[5, 10]),
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    peer = context.Process(target=serve_tiny_rank, args=(init_method, results))
    peer.start()
    logits, gathered = [], []
    try:
        executor, groups = tiny_rank(init_method, 0)
        for msg in messages:
            broadcast_step(msg, groups.step_group)
            sends = msg.forward is not None and msg.forward.gather_slots is not None

            def hook(layer: int) -> None:
                assert executor.gathered is not None
                gathered.append(tuple(t.clone() for t in executor.gathered))

            logits.append(executor.execute(msg, hook if sends else None))
            if msg.gather_blocks:
                assert executor.gathered_blocks is not None
                gathered_blocks = executor.gathered_blocks.clone()
        broadcast_step(StepMessage(StepOp.STOP), groups.step_group)
        assert results.get(timeout=60) == len(messages)
    finally:
        dist.destroy_process_group()
        peer.join(timeout=60)
    assert peer.exitcode == 0

    # The whole model, the same steps, in this process.
    ref.kv_cache.view(-1, TINY_TP.num_kv_heads, TINY_TP.head_dim).index_copy_(0, index, rows)
    f = messages[1].forward
    assert f is not None
    want_prefill = ref.model.forward(f.input_ids, f.positions, ref.kv_cache, f.meta, f.logits_indices)
    for layer, (k, v) in enumerate(gathered):
        assert torch.allclose(k, ref.kv_cache[layer, 0].flatten(0, 1)[f.gather_slots], atol=1e-5)
        assert torch.allclose(v, ref.kv_cache[layer, 1].flatten(0, 1)[f.gather_slots], atol=1e-5)
    ref.swapper.copy([(0, 5)])
    # [num_layers, 2, 2 blocks, block_size, every KV head, head_dim], as the pool held them
    # (block 10's arrived rows exactly; block 5's computed by the ranks' shards)
    assert torch.equal(gathered_blocks[:, :, 1, :3], ref.kv_cache[:, :, 10, :3])
    assert torch.allclose(gathered_blocks, ref.kv_cache[:, :, [5, 10]], atol=1e-5)
    f = messages[3].forward
    assert f is not None
    want_decode = ref.model.forward(f.input_ids, f.positions, ref.kv_cache, f.meta, f.logits_indices)
    assert len(gathered) == TINY_TP.num_layers
    assert logits[0] is None and logits[2] is None
    torch.testing.assert_close(logits[1], want_prefill, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[3], want_decode, atol=1e-4, rtol=1e-4)
