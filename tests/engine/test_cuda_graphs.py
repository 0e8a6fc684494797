"""Decode steps replayed as CUDA graphs (tandem/engine/cuda_graphs.py), their bookkeeping run
on the CPU with a stand-in for the device's graphs (tests/fake_cuda_graphs.py): the buckets
captured, the static buffers refilled each step (padding rows writing the scratch block
alone), the replayed logits the eager forward's on the default model, every other step eager,
``--enforce-eager`` down to the runner, and the graphs' memory in the KV pool's plan. The real
capture and its timing: ``tandem bench gpu`` (tandem/bench/gpu/graphs.py)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from fake_cuda_graphs import FakeGraphDevice

from tandem import cli
from tandem.config import EngineConfig, ModelConfig
from tandem.config.engine_options import from_vllm_keywords
from tandem.engine.cuda_graphs import DecodeGraphs, capture_sizes, graphs_apply, planned_graph_bytes
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kvcache.memory_plan import DeviceMemoryPlan, estimated_graph_pool_bytes
from tandem.model.llama import LlamaModel, ModelWeights
from tandem.router import serve_command
from tandem.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256  # tables 16 blocks wide


def engine_config(shape: ModelConfig, **kwargs) -> EngineConfig:
    kwargs.setdefault("max_num_seqs", 4)
    return EngineConfig.build(shape, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                              num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, num_swap_blocks=0, **kwargs)


def graphed_runner(shape: ModelConfig, weights: ModelWeights) -> tuple[ModelRunner, FakeGraphDevice]:
    """Decode batches of up to 4 captured (buckets 1, 2, 4) through the stand-in, over a KV
    pool of random values (so that attention reads something)."""
    config = engine_config(shape)
    device = FakeGraphDevice()
    torch.manual_seed(0)
    runner = ModelRunner(config, LlamaModel(shape, weights, config.max_model_len), pad_decode=True,
                         graph_device=device)
    runner.kv_cache.normal_()
    return runner, device


@pytest.fixture(scope="module")
def graphed(loaded) -> tuple[ModelRunner, FakeGraphDevice]:
    """The default model (float32) on the CPU, its decode steps captured."""
    return graphed_runner(loaded.config, loaded.weights)


@pytest.fixture(scope="module")
def graphed_short(loaded) -> tuple[ModelRunner, FakeGraphDevice]:
    """The default model's first two layers alone, for the bookkeeping that needs no real output (quicker)."""
    shape = dataclasses.replace(loaded.config, num_layers=2)
    return graphed_runner(shape, dataclasses.replace(loaded.weights, layers=loaded.weights.layers[:2]))


def seq(i: int, num_tokens: int, num_computed: int, shift: int = 0) -> Sequence:
    s = Sequence(str(i), [(7 * i + t + shift) % 1000 for t in range(num_tokens)], SamplingParams(temperature=0), i,
                 None)
    s.block_ids = [(5 * i + b + shift) % NUM_BLOCKS for b in range(-(-num_tokens // BLOCK_SIZE))]
    s.num_computed_tokens = num_computed
    return s


def decodes(num_seqs: int, shift: int = 0) -> ScheduledBatch:
    """``num_seqs`` decodes of different lengths (``shift`` moves their tokens, lengths and blocks)."""
    seqs = [seq(i, 20 + 13 * i + shift, 19 + 13 * i + shift, shift) for i in range(num_seqs)]
    return ScheduledBatch(seqs, [1] * num_seqs)


def eager_logits(runner: ModelRunner, batch: ScheduledBatch) -> torch.Tensor:
    input_ids, positions, meta, logits_indices = runner.prepare(batch)
    return runner.model.forward(input_ids, positions, runner.kv_cache, meta, logits_indices)


def test_buckets_captured() -> None:
    assert capture_sizes(64, 512) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5, 512) == [1, 2, 4, 8]  # 5 decodes pad to 8
    assert capture_sizes(64, 20) == [1, 2, 4, 8, 16]  # past 20: eager
    assert capture_sizes(600, 512)[-3:] == [496, 504, 512]


def test_captured_largest_first_in_one_pool(graphed_short) -> None:
    runner, device = graphed_short
    assert runner.graphs is not None
    assert sorted(runner.graphs.graphs) == [1, 2, 4]
    assert [g.inputs[0][0].shape[0] for g in device.captures] == [4, 2, 1]
    assert device.warm_ups == 3 and len(device.pools) == 1 and all(g.pool is device.pools[0] for g in device.captures)
    assert runner.graphs.capture_bytes == 3 * device.bytes_per_capture


def test_replay_refills_the_buffers_and_gives_the_eager_logits(graphed) -> None:
    runner, device = graphed
    assert runner.graphs is not None
    inputs = runner.graphs.inputs[4]
    scratch = runner.scratch_block_id
    for shift in (0, 5):  # two different steps of one bucket: the second must not see the first's inputs
        batch = decodes(3, shift)
        kv_before = runner.kv_cache.clone()
        replays = len(device.replays)
        replayed = runner.forward(batch, None, None).clone()
        assert len(device.replays) == replays + 1 and device.replays[-1] is runner.graphs.graphs[4]
        # The buffers hold this step's inputs, the fourth row a padding row.
        seqs = batch.seqs
        assert inputs.input_ids.tolist() == [s.token_ids[-1] for s in seqs] + [0]
        assert inputs.positions.tolist() == [s.num_tokens - 1 for s in seqs] + [0]
        assert inputs.context_lens.tolist() == [s.num_tokens for s in seqs] + [1]
        real_slots = [s.block_ids[(s.num_tokens - 1) // BLOCK_SIZE] * BLOCK_SIZE + (s.num_tokens - 1) % BLOCK_SIZE
                      for s in seqs]
        assert inputs.slot_mapping.tolist() == real_slots + [scratch * BLOCK_SIZE]
        assert inputs.block_tables[3].tolist() == [scratch] + [0] * 15
        assert inputs.block_tables[0, :len(seqs[0].block_ids)].tolist() == seqs[0].block_ids
        # The step wrote its tokens' slots and the scratch block, nothing else.
        changed = (runner.kv_cache != kv_before).flatten(4).any(-1).any(0).any(0).flatten()  # [blocks * block_size]
        allowed = set(real_slots) | set(range(scratch * BLOCK_SIZE, (scratch + 1) * BLOCK_SIZE))
        assert set(changed.nonzero().flatten().tolist()) <= allowed
        eager = eager_logits(runner, batch)
        assert replayed.shape == eager.shape == (3, runner.model.config.vocab_size)
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
        assert replayed.argmax(-1).tolist() == eager.argmax(-1).tolist()


def test_other_steps_run_eagerly(graphed_short) -> None:
    runner, device = graphed_short
    replays = len(device.replays)
    batches = {
        "prefill": ScheduledBatch([seq(0, 40, 0)], [40]),
        "mixed": ScheduledBatch([seq(0, 40, 39), seq(1, 70, 32)], [1, 38]),
        "past the largest bucket": decodes(5),  # padded to 8; 4 is the largest captured
    }
    for name, batch in batches.items():
        torch.testing.assert_close(runner.forward(batch, None, None), eager_logits(runner, batch), msg=name)
    layers: list[int] = []  # a layer hook is host code in the step: never replayed
    runner.forward(decodes(2), layers.append, None)
    assert layers == list(range(runner.model.config.num_layers))
    assert len(device.replays) == replays


def test_capture_logs_time_and_memory(graphed_short, caplog) -> None:
    runner, _ = graphed_short
    device = FakeGraphDevice(bytes_per_capture=3 * 2**20)
    graphs = DecodeGraphs(runner._model_forward, engine_config(runner.model.config, max_cudagraph_capture_size=2),
                          runner.scratch_block_id, runner.model.config.vocab_size, device)
    with caplog.at_level(logging.INFO, logger="tandem.engine.cuda_graphs"):
        graphs.capture()
    assert "captured 2 decode graphs (batch sizes 1, 2) in" in caplog.text
    assert "6.0 MiB of device memory" in caplog.text and graphs.capture_seconds > 0


def test_enforce_eager_reaches_the_runner(loaded, monkeypatch) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    engine = serve_command.worker_config(cli.parse_args(["serve", "--enforce-eager"])).engine
    assert dict(engine) == {"enforce_eager": True}
    assert from_vllm_keywords({"enforce_eager": True}) == {"enforce_eager": True}  # LLM(enforce_eager=True)
    config = engine_config(loaded.config, max_cudagraph_capture_size=1, **engine)
    device = FakeGraphDevice()
    model = LlamaModel(loaded.config, loaded.weights, config.max_model_len)
    assert ModelRunner(config, model, pad_decode=True, graph_device=device).graphs is None
    assert device.captures == []
    on_cuda = dataclasses.replace(config, device_name="cuda")
    assert not graphs_apply(on_cuda) and planned_graph_bytes(on_cuda) == 0
    assert graphs_apply(dataclasses.replace(on_cuda, enforce_eager=False))
    assert not graphs_apply(dataclasses.replace(on_cuda, enforce_eager=False, tensor_parallel_size=2))
    assert not graphs_apply(dataclasses.replace(on_cuda, enforce_eager=False, reserve_whole_prompts=True))  # prefill
    assert not graphs_apply(dataclasses.replace(config, enforce_eager=False))  # the CPU: never


def test_the_memory_plan_leaves_the_graphs_room(loaded) -> None:
    on_cuda = dataclasses.replace(engine_config(loaded.config, max_num_seqs=64), device_name="cuda")
    graph_bytes = planned_graph_bytes(on_cuda)
    assert graph_bytes == estimated_graph_pool_bytes(loaded.config, capture_sizes(64, 512), 16, 4)
    # the largest bucket's float32 logits (and their copy out) at least, below a GiB for this small model
    assert 2 * 64 * loaded.config.vocab_size * 4 < graph_bytes < 2**30
    plain = DeviceMemoryPlan(2**34, 0.5, 2**30, 2**29, 2**20, measured=True)
    planned = dataclasses.replace(plain, graph_bytes=graph_bytes)
    assert planned.num_blocks == (plain.kv_bytes - graph_bytes) // 2**20
    assert any(line.startswith("decode CUDA graphs: ") for line in planned.lines())
    assert not any("graphs" in line for line in plain.lines())
