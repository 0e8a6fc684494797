"""Step messages cross a real gloo group (two processes, on the step group beside the
default one, as the ranks use them) intact, KV rows left to the device group, with no
pickle on the way; and on_device puts exactly those values where the step reads them."""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket
import types
from typing import cast

import torch
import torch.distributed as dist
from step_peer import plain, receive_all

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.model.llama import LlamaModel
from tandem.parallel.step_message import HOST, ForwardInputs, KVWrites, StepMessage, StepOp, broadcast_step, on_device
from tandem.sampling_params import SamplingParams

TINY = ModelConfig(
    name="tiny", architecture="LlamaForCausalLM", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=3,
    num_kv_heads=3, head_dim=2, vocab_size=200, rms_norm_eps=1e-5, attention_bias=False, tie_word_embeddings=True,
    max_position_embeddings=64, sliding_window=None, eos_token_ids=(2,),
)


def host_runner(pad_decode: bool = False) -> ModelRunner:
    """A runner whose prepare() builds host inputs (its model is never run: a stub)."""
    config = EngineConfig.build(TINY, device="cpu", dtype="float32", block_size=4, num_kv_blocks=16,
                                max_model_len=64)
    weights = types.SimpleNamespace(layers=[], lm_head=None)  # nothing for the CPU kernels to pack
    model = cast(LlamaModel, types.SimpleNamespace(num_kv_heads=TINY.num_kv_heads, weights=weights))
    return ModelRunner(config, model, pad_decode=pad_decode)


def batch_of(specs: list[tuple[int, int, list[int]]], num_new: list[int]) -> ScheduledBatch:
    """Sequences of (tokens, computed tokens, block ids), scheduled for num_new tokens each."""
    seqs = []
    for i, (n, computed, blocks) in enumerate(specs):
        seq = Sequence(str(i), list(range(100, 100 + n)), SamplingParams(temperature=0), i, None)
        seq.block_ids = blocks
        seq.num_computed_tokens = computed
        seqs.append(seq)
    return ScheduledBatch(seqs, num_new)


def mixed_batch() -> ScheduledBatch:
    """Two decodes and a chunked prefill after a cached prefix."""
    return batch_of([(6, 5, [3, 1]), (9, 8, [0, 2, 7]), (11, 4, [5, 6, 4])], [1, 1, 5])


def many_decodes() -> ScheduledBatch:
    """Ten decodes: two decode groups, padded to 16 rows on a padding runner."""
    lens = [5 + 3 * i for i in range(10)]
    return batch_of([(n, n - 1, [(i + j) % 16 for j in range(n // 4 + 1)]) for i, n in enumerate(lens)], [1] * 10)


def forward_message(runner: ModelRunner, batch: ScheduledBatch, gather: torch.Tensor | None) -> StepMessage:
    input_ids, positions, meta, logits_indices = runner.prepare(batch)
    return StepMessage(StepOp.FORWARD, None, forward=ForwardInputs(input_ids, positions, meta, gather, logits_indices))


def test_messages_arrive_field_for_field():
    writes = KVWrites(torch.tensor([5, 40]), torch.arange(12, dtype=torch.float32).view(2, 3, 2))
    mixed = forward_message(host_runner(), mixed_batch(), torch.tensor([9, 2, 9]))
    padded = forward_message(host_runner(pad_decode=True), many_decodes(), None)
    assert padded.forward is not None and mixed.forward is not None
    assert len(padded.forward.meta.decode_groups) == 2 and len(padded.forward.input_ids) == 16
    messages = [
        StepMessage(StepOp.SWAP, writes, swap_out=[(3, 0)], copies=[(1, 2), (4, 6)], swap_in=[], gather_blocks=[7, 1]),
        mixed,
        StepMessage(StepOp.FORWARD, writes, swap_in=[(0, 5)], forward=ForwardInputs(
            mixed.forward.input_ids, mixed.forward.positions, mixed.forward.meta)),
        padded,
        dataclasses.replace(padded, gather_blocks=[4]),
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
        step_group = dist.new_group(backend="gloo")
        for msg in messages:
            broadcast_step(msg, step_group)
        got = [results.get(timeout=60) for _ in messages]
    finally:
        dist.destroy_process_group()
        peer.join(timeout=60)
    assert peer.exitcode == 0
    # KV rows do not travel on the step group (the device group carries them: test_rank_groups)
    assert got == [plain(m if m.writes is None else dataclasses.replace(m, writes=KVWrites(m.writes.index, None)))
                   for m in messages]
    # The mixed batch's values, independently: slot = block_ids[position // 4] * 4 + position % 4
    f = got[1]["forward"]
    assert f["input_ids"][2] == [105, 108, 104, 105, 106, 107, 108]
    assert f["positions"][2] == [5, 8, 4, 5, 6, 7, 8]
    m = f["meta"]
    assert m["slot_mapping"][2] == [5, 28, 24, 25, 26, 27, 16]
    assert (m["num_decode_tokens"], m["max_decode_context_len"]) == (2, 9)
    assert m["decode_block_tables"][2] == [[3, 1, 0], [0, 2, 7]] and m["decode_context_lens"][2] == [6, 9]
    assert (m["prefill_query_starts"], m["prefill_query_lens"], m["prefill_context_lens"]) == ([0], [5], [9])
    assert m["prefill_block_tables"][2] == [[5, 6, 4]] and m["prefill_layout"][2] == [[0, 5, 9]]
    assert f["gather_slots"][2] == [9, 2, 9] and f["logits_indices"][2] == [0, 1]  # the chunk is not the prompt's last
    assert got[2]["forward"]["gather_slots"] is None and got[2]["forward"]["logits_indices"] is None
    assert [g["gather_blocks"] for g in got] == [[7, 1], [], [], [], [4], []]


def test_on_device_keeps_every_value():
    """On the CPU the device copy is a concatenation: every field as it was."""
    writes = KVWrites(torch.tensor([5, 40]), torch.arange(12, dtype=torch.float32).view(2, 3, 2))
    for msg in [forward_message(host_runner(), mixed_batch(), torch.tensor([9, 2, 9])),
                forward_message(host_runner(pad_decode=True), many_decodes(), None),
                StepMessage(StepOp.SWAP, writes, copies=[(1, 2)])]:
        assert plain(on_device(msg, HOST)) == plain(msg)
