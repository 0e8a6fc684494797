"""``tandem serve`` and ``tandem chat`` flags that become engine options: one definition of them
(tandem.config.engine_options) for both and for LLM(...), --num-speculative-tokens, swap and preemption."""

from __future__ import annotations

import argparse
import inspect

import pytest

from tandem import LLM
from tandem.cli import add_engine_args, engine_kwargs
from tandem.config import EngineConfig, KVTransferConfig, WorkerConfig
from tandem.config.engine_options import ENGINE_DEFAULTS, engine_options_from_args
from tandem.router import serve_command
from tandem.router.autoscale import PoolBounds
from tandem.worker.api import Role


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    return parser.parse_args(list(argv))


def test_speculation_is_off_unless_asked():
    args = _serve_args()
    assert args.num_speculative_tokens == 0
    assert "num_speculative_tokens" not in serve_command.worker_config(args).engine


def test_num_speculative_tokens_reaches_every_worker():
    args = _serve_args("--num-speculative-tokens", "4", "--colocated", "2")
    assert serve_command.worker_config(args).engine["num_speculative_tokens"] == 4


def test_negative_num_speculative_tokens_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="--num-speculative-tokens must be >= 0, got -1"):
        serve_command.worker_config(_serve_args("--num-speculative-tokens", "-1"))


def test_chat_passes_num_speculative_tokens_to_its_engine():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["num_speculative_tokens"] == 0
    assert engine_kwargs(parser.parse_args(["--num-speculative-tokens", "3"]))["num_speculative_tokens"] == 3


def _chat_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_serve_chat_and_llm_share_one_definition_of_the_engine_options():
    assert engine_options_from_args(_serve_args()) == dict(ENGINE_DEFAULTS)
    assert engine_options_from_args(_chat_args()) == dict(ENGINE_DEFAULTS)
    build = inspect.signature(EngineConfig.build).parameters
    # gpu_memory_utilization is worked out into num_kv_blocks before the build (engine/setup.py).
    built = {name: default for name, default in ENGINE_DEFAULTS.items() if name != "gpu_memory_utilization"}
    assert {name: build[name].default for name in built} == built
    assert ENGINE_DEFAULTS["gpu_memory_utilization"] is None
    for name in ("device", "dtype"):
        assert inspect.signature(LLM.__init__).parameters[name].default == ENGINE_DEFAULTS[name]
    assert ENGINE_DEFAULTS["kv_cache_memory_gib"] == 1.0  # serve's was 0.5: now the one default


def test_serve_passes_only_what_differs_from_the_defaults():
    assert serve_command.worker_config(_serve_args()) == WorkerConfig()
    args = _serve_args("--dtype", "bfloat16", "--kv-cache-memory-gib", "0.25", "--max-model-len", "512")
    assert serve_command.worker_config(args) == WorkerConfig.build(dtype="bfloat16", kv_cache_memory_gib=0.25,
                                                                   max_model_len=512)


def test_serve_gives_every_worker_its_kv_transfer_settings():
    args = _serve_args("--kv-transport", "zmq", "--kv-checksum", "--kv-transfer-host", "node-ip",
                       "--num-threads", "2")
    worker = serve_command.worker_config(args)
    assert worker.num_threads == 2
    assert worker.kv_transfer == KVTransferConfig(transport="zmq", checksum=True, receiver_host="node-ip")


def test_swap_space_and_preemption_mode_reach_every_worker():
    args = _serve_args("--swap-space-gib", "2", "--preemption-mode", "recompute", "--colocated", "2")
    engine = serve_command.worker_config(args).engine
    assert (engine["swap_space_gib"], engine["preemption_mode"]) == (2.0, "recompute")
    with pytest.raises(SystemExit):  # argparse's error, before any worker starts
        _serve_args("--preemption-mode", "sometimes")


def test_autoscale_bounds_are_checked_against_the_cluster_before_any_worker_starts():
    assert serve_command.autoscale_config_of(_serve_args()) is None
    config = serve_command.autoscale_config_of(_serve_args("--autoscale", "decode=1:4", "--autoscale", "prefill=2:3"))
    assert config is not None and dict(config.bounds) == {Role.DECODE: PoolBounds(1, 4),
                                                          Role.PREFILL: PoolBounds(2, 3)}
    with pytest.raises(ValueError, match="this cluster has no colocated pool"):
        serve_command.autoscale_config_of(_serve_args("--autoscale", "colocated=1:2"))
    with pytest.raises(ValueError, match="this cluster has no decode pool"):
        serve_command.autoscale_config_of(_serve_args("--colocated", "1", "--autoscale", "decode=1:2"))
    with pytest.raises(ValueError, match="min <= max"):
        serve_command.autoscale_config_of(_serve_args("--autoscale", "decode=3:2"))
