"""`tandem plan`: the model's shape from its config alone, and the KV numbers a worker logs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from tandem.config import SUPPORTED_ARCHITECTURES, EngineConfig, ModelConfig
from tandem.kvcache.capacity import KVCapacity
from tandem.model.loader import weights_from_hf_model
from tandem.model.source import resolve_model_source
from tandem.plan import ARCHITECTURE_OF_MODEL_TYPE, make_plan, read_hf_shape, read_model_shape

# A plan reads no tokenizer, so it leaves eos_token_ids empty: every other field is compared.
SHAPE_FIELDS = [f for f in ModelConfig.__dataclass_fields__ if f not in ("name", "eos_token_ids")]


@pytest.fixture(scope="module")
def default_shape() -> ModelConfig:
    return read_model_shape(None)


def distinct_parameters(weights) -> int:
    tensors = [weights.embed_tokens, weights.lm_head, weights.norm] + [
        t for layer in weights.layers for t in vars(layer).values() if t is not None]
    return sum({t.data_ptr(): t.numel() for t in tensors}.values())


def test_architectures_are_the_supported_ones() -> None:
    assert sorted(ARCHITECTURE_OF_MODEL_TYPE.values()) == sorted(SUPPORTED_ARCHITECTURES)


def test_default_shape_from_gguf_metadata_is_the_loaded_config(default_shape, loaded) -> None:
    for field in SHAPE_FIELDS:
        assert getattr(default_shape, field) == getattr(loaded.config, field), field
    assert default_shape.num_parameters == distinct_parameters(loaded.weights)
    from gguf import GGUFReader

    source = resolve_model_source(None)
    assert source.gguf_file is not None
    tensors = GGUFReader(os.path.join(source.path, source.gguf_file)).tensors
    assert default_shape.num_parameters == sum(int(t.n_elements) for t in tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_has_the_kv_numbers_the_worker_logs(default_shape, loaded, dtype: str) -> None:
    for memory in (0.6, 1.0, 3.5):
        for block_size in (16, 32):
            for max_model_len in (None, 1000):
                plan = make_plan(None, memory, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
                                 shape=default_shape)
                assert plan.weight_bytes == default_shape.num_parameters * {"float32": 4, "bfloat16": 2}[dtype]
                assert plan.kv_memory_bytes == int(memory * 2**30) - plan.weight_bytes
                config = EngineConfig.build(loaded.config, dtype=dtype, block_size=block_size,
                                            max_model_len=max_model_len, kv_cache_memory_gib=plan.kv_cache_memory_gib)
                assert plan.capacity == KVCapacity.of_engine_config(config)
                assert plan.capacity.num_blocks == config.num_kv_blocks
                assert plan.capacity.max_model_len == config.max_model_len
                assert plan.lines()[-1] == f"KV pool: {KVCapacity.of_engine_config(config).describe()}"


def test_plan_line_is_the_engine_log_line(default_shape, make_llm, caplog) -> None:
    plan = make_plan(None, 0.6, shape=default_shape, max_model_len=2048)
    with caplog.at_level(logging.INFO, logger="tandem.engine.engine"):
        make_llm(kv_cache_memory_gib=plan.kv_cache_memory_gib, max_model_len=2048)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool: ")]
    assert logged == [plan.lines()[-1]]


def test_plan_with_tensor_parallel_ranks(default_shape) -> None:
    one, two, four = (make_plan(None, 1.0, tp=tp, shape=default_shape) for tp in (1, 2, 4))
    assert two.weight_bytes == one.weight_bytes // 2 and four.weight_bytes == one.weight_bytes // 4
    # 3 KV heads: 3, then 2 (the busiest rank of an uneven split), then 1 (replicated) per rank.
    assert [p.capacity.bytes_per_token for p in (one, two, four)] == [46080, 30720, 15360]
    assert one.capacity.num_blocks < two.capacity.num_blocks < four.capacity.num_blocks


def test_plan_refuses_memory_the_weights_fill(default_shape) -> None:
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        make_plan(None, 0.25, shape=default_shape)
    with pytest.raises(ValueError, match="too small after the weights"):
        make_plan(None, 0.1, shape=default_shape, weights_memory_gib=0.1 - 2**-20)
    given = make_plan(None, 1.0, shape=default_shape, weights_memory_gib=0.5)
    assert given.kv_memory_bytes == 2**29 and not given.weights_estimated


HF_CONFIGS = {
    "llama-no-kv-heads": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
                          "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 128,
                          "max_position_embeddings": 512, "rms_norm_eps": 1e-5},
    "llama-bias-head-dim": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 3,
                            "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True, "vocab_size": 100,
                            "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    "qwen2-no-window": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2,
                        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                        "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 1024,
                        "sliding_window": 256, "use_sliding_window": False, "tie_word_embeddings": True,
                        "rms_norm_eps": 1e-6},
    "mistral-default-window": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                               "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
                               "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 128,
                               "rms_norm_eps": 1e-5},
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_config_json_reads_as_transformers_does(tmp_path, name: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    shape = read_hf_shape(str(tmp_path), name)
    hf_config = AutoConfig.from_pretrained(str(tmp_path))
    expected = ModelConfig.from_hf_config(hf_config, name, ())
    for field in SHAPE_FIELDS:
        assert getattr(shape, field) == getattr(expected, field), field
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    # What a worker holds: tandem's layout of the checkpoint's weights (tied ones once).
    assert shape.num_parameters == distinct_parameters(weights_from_hf_model(hf_model, expected, torch.float32))
    hf_parameters = sum(p.numel() for p in hf_model.parameters())
    if expected.architecture == "LlamaForCausalLM" and expected.attention_bias:
        hf_parameters -= expected.num_layers * expected.hidden_size  # o_proj's bias: not taken by the loader
    assert shape.num_parameters == hf_parameters
    plan = make_plan(str(tmp_path), 0.01, block_size=8)
    config = EngineConfig.build(expected, block_size=8, kv_cache_memory_gib=plan.kv_cache_memory_gib)
    assert plan.capacity == KVCapacity.of_engine_config(config)


def test_unsupported_architecture_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIGS["llama-no-kv-heads"],
                                                      "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        read_model_shape(str(tmp_path))


def tandem_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "tandem")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "tandem"]


def run_plan(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([*tandem_command(), "plan", *args], capture_output=True, text=True, timeout=60)
    return done, time.perf_counter() - start


@pytest.mark.parametrize("tp", [1, 2])
def test_tandem_plan_command(default_shape, tp: int) -> None:
    done, seconds = run_plan("--memory", "1", "--tp", str(tp))
    assert done.returncode == 0, done.stderr
    assert seconds < 20  # the GGUF's metadata only: no weights, no torch
    lines = done.stdout.splitlines()
    assert lines == make_plan(None, 1.0, tp=tp, shape=default_shape).lines()
    assert lines[0] == "model: SmolLM2-135M-Instruct (LlamaForCausalLM)"
    per_token = {1: 46080, 2: 30720}[tp]
    kv_heads = 3 if tp == 1 else 2
    assert f"KV bytes per token: {per_token} = 2 x 30 layers x {kv_heads} KV heads x 64 head dim x 4 bytes" in lines
    assert any(line.startswith("max concurrency: ") and "at max_model_len 8192" in line for line in lines)
    assert ("same pool: --kv-cache-memory-gib" in done.stdout) == (tp == 1)


def test_tandem_plan_refuses_too_little_memory() -> None:
    done, seconds = run_plan("--memory", "0.25")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("tandem: error: --memory 0.25 GiB per rank leaves no room for the KV cache")
    assert seconds < 20
    done, _ = run_plan("--memory", "1", "--model", "/no/such/model")
    assert done.returncode == 2 and "tandem: error: model '/no/such/model'" in done.stderr


def test_tandem_plan_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys; from tandem.cli import main; rc = main(['plan', '--memory', '1']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'loaded a model library'; "
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "KV pool: 726 blocks of 16 tokens" in done.stdout


def test_config_and_the_engine_options_import_no_torch() -> None:
    """tandem/config/ is beneath the model layer, the engine and kvcache: importing it (and the
    names and options it checks against) loads none of them, nor torch."""
    code = ("import sys, tandem.config, tandem.config.names, tandem.config.engine_options, tandem.kvcache.capacity; "
            "loaded = sorted(m for m in sys.modules if m in ('torch', 'transformers', 'tandem.model', 'tandem.engine') "
            "or m.startswith(('tandem.model.', 'tandem.engine.'))); assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
