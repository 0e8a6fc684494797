"""Rank 1 of two-process gloo groups: for test_step_message it reports each message as plain
values (see plain); for test_rank_groups it executes them on a tiny model's second rank."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
import torch.distributed as dist

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.model_runner import ModelRunner
from tandem.model.llama import LayerWeights, ModelWeights
from tandem.model.loader import LoadedModel
from tandem.parallel.executor import RankExecutor, rank_model
from tandem.parallel.ranks import RankGroups, join_groups
from tandem.parallel.step_message import StepOp, receive_step


def plain(x: Any) -> Any:
    """``x`` with every tensor as (shape, dtype, values) and every dataclass as a dict of all
    its fields, recursively: a field the wire drops, or any value it changes, shows."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), str(x.dtype), x.tolist()
    if dataclasses.is_dataclass(x):
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return int(x.value)
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def receive_all(init_method: str, results) -> None:
    """Join as rank 1 (a second gloo group beside the default one, as ranks.join_groups does)
    and put each message received on that group into ``results``, until STOP."""
    dist.init_process_group("gloo", init_method=init_method, rank=1, world_size=2)
    step_group = dist.new_group(backend="gloo")
    try:
        while True:
            msg = receive_step(step_group)
            results.put(plain(msg))
            if msg.op is StepOp.STOP:
                return
    finally:
        dist.destroy_process_group()


TINY_TP = ModelConfig(
    name="tiny-tp", architecture="LlamaForCausalLM", num_layers=2, hidden_size=64, intermediate_size=128,
    num_heads=6, num_kv_heads=3, head_dim=16, vocab_size=128, rms_norm_eps=1e-5, attention_bias=False,
    tie_word_embeddings=True, max_position_embeddings=64, sliding_window=None, eos_token_ids=(2,),
)
"""3 KV heads over 2 ranks: 2 + 1, so the KV gather pads one rank's rows."""


def tiny_loaded() -> LoadedModel:
    """The same random weights in every process (seeded)."""
    g = torch.Generator().manual_seed(0)
    cfg = TINY_TP
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    layers = [LayerWeights(rand(q + 2 * kv, h), None, rand(h, q), rand(2 * cfg.intermediate_size, h),
                           rand(h, cfg.intermediate_size), 1 + rand(h), 1 + rand(h)) for _ in range(cfg.num_layers)]
    embed = rand(cfg.vocab_size, h)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    return LoadedModel(cfg, ModelWeights(embed, layers, 1 + rand(h), embed, inv_freq, 1.0), None)


def tiny_config(tp: int) -> EngineConfig:
    return EngineConfig.build(TINY_TP, device="cpu", dtype="float32", block_size=4, num_kv_blocks=16,
                              max_model_len=64, tensor_parallel_size=tp)


def tiny_rank(init_method: str, rank: int) -> tuple[RankExecutor, RankGroups]:
    """Rank ``rank`` of 2 over TINY_TP on the CPU, joined as ranks.join_groups joins."""
    groups = join_groups(init_method, rank, 2, torch.device("cpu"))
    config = tiny_config(2)
    part = rank_model(tiny_loaded(), 2, rank, config.max_model_len, groups.collectives)
    runner = ModelRunner(config, part)
    return RankExecutor(part, runner.kv_cache, runner.swapper, 2, rank, groups.collectives), groups


def serve_tiny_rank(init_method: str, results) -> None:
    """Rank 1: execute rank 0's messages until STOP, then report how many."""
    executor, groups = tiny_rank(init_method, 1)
    num_executed = 0
    try:
        while True:
            msg = receive_step(groups.step_group)
            if msg.op is StepOp.STOP:
                break
            executor.execute(msg)
            num_executed += 1
    finally:
        dist.destroy_process_group()
    results.put(num_executed)
