"""--kv-cache-dtype: one engine option from every source (flag, YAML, environment, LLM keyword,
a worker's config), resolved before the frozen EngineConfig is built (auto: the activations'
dtype, on every format for now), and the pool, the swap space and ``tandem plan`` sized by it."""

from __future__ import annotations

import pytest

from tandem import cli
from tandem.config import EngineConfig, WorkerConfig, gib_to_bytes
from tandem.config.names import auto_kv_cache_dtype_name, resolve_kv_cache_dtype
from tandem.kvcache.capacity import KVCapacity
from tandem.plan import make_plan, read_model_shape
from tandem.router import serve_command

PER_TOKEN = {"float32": 46080, "bfloat16": 23040, "float16": 23040}
"""SmolLM2-135M's KV bytes per token: 2 x 30 layers x 3 KV heads x 64 head dim x bytes per element."""


@pytest.fixture(scope="module")
def shape():
    return read_model_shape(None)


@pytest.fixture(autouse=True)
def no_tandem_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype", "resolved"), [
    ("float32", "auto", "float32"), ("bfloat16", "auto", "bfloat16"), ("float32", "bfloat16", "bfloat16"),
    ("float32", "float32", "float32"), ("bfloat16", "float32", "float32"), ("float32", "float16", "float16")])
def test_the_pool_is_sized_by_the_kv_dtype(shape, dtype, kv_cache_dtype, resolved):
    config = EngineConfig.build(shape, device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                kv_cache_memory_gib=0.5, swap_space_gib=0.25)
    assert (config.dtype_name, config.kv_cache_dtype_name) == (dtype, resolved)
    block_bytes = 16 * PER_TOKEN[resolved]
    assert config.kv_cache_dtype_bytes * 2 * 30 * 3 * 64 == PER_TOKEN[resolved]
    assert config.num_kv_blocks == gib_to_bytes(0.5) // block_bytes
    assert config.num_swap_blocks == gib_to_bytes(0.25) // block_bytes
    assert KVCapacity.of_engine_config(config).bytes_per_token == PER_TOKEN[resolved]


def test_bfloat16_kv_holds_twice_the_blocks_of_float32(shape):
    f32, bf16 = (EngineConfig.build(shape, device="cpu", kv_cache_dtype=kv, kv_cache_memory_gib=1.0)
                 for kv in ("auto", "bfloat16"))
    assert (f32.num_kv_blocks, bf16.num_kv_blocks) == (1456, 2912)  # 2**30 // (16 x 46080), // (16 x 23040)


def test_auto_is_the_activations_dtype():
    """auto keeps the activations' dtype for every format and device (bfloat16 is asked for by
    name: see auto_kv_cache_dtype_name)."""
    for quantization in ("int8", "int4", None):
        assert auto_kv_cache_dtype_name("float32", quantization, "cpu") == "float32"
        assert auto_kv_cache_dtype_name("float32", quantization, "cuda") == "float32"
        assert resolve_kv_cache_dtype("auto", "float16", quantization, "cpu") == "float16"
    assert resolve_kv_cache_dtype("float32", "float32", "int4", "cpu") == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of float32, bfloat16, float16, "
                                         "got 'fp8'"):
        resolve_kv_cache_dtype("fp8", "float32", None)


def test_a_bad_kv_dtype_is_refused_before_anything_is_built(shape):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of"):
        EngineConfig.build(shape, device="cpu", kv_cache_dtype="int8")


def test_the_flag_from_every_source(tmp_path, monkeypatch, capsys):
    assert cli.parse_args(["serve"]).kv_cache_dtype == "auto"
    args = cli.parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert serve_command.worker_config(args).engine == {"kv_cache_dtype": "bfloat16"}
    assert cli.parse_args(["chat", "--kv-cache-dtype", "float32"]).kv_cache_dtype == "float32"
    config = tmp_path / "serve.yaml"
    config.write_text("kv-cache-dtype: bfloat16\n")
    assert cli.parse_args(["serve", "--config", str(config)]).kv_cache_dtype == "bfloat16"
    monkeypatch.setenv("TANDEM_KV_CACHE_DTYPE", "float32")
    assert cli.parse_args(["serve", "--config", str(config)]).kv_cache_dtype == "float32"
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_a_worker_config_carries_it_to_the_engine():
    worker = WorkerConfig.build(kv_cache_dtype="bfloat16")
    assert worker.engine_args("cpu", "float32") == {"kv_cache_dtype": "bfloat16", "device": "cpu",
                                                     "dtype": "float32"}


def test_tandem_plan_counts_the_kv_dtype(shape):
    plan = make_plan(None, 1.0, kv_cache_dtype="bfloat16", shape=shape)
    assert (plan.dtype, plan.kv_cache_dtype, plan.capacity.bytes_per_token) == ("float32", "bfloat16", 23040)
    lines = plan.lines()
    assert "KV bytes per token: 23040 = 2 x 30 layers x 3 KV heads x 64 head dim x 2 bytes (a bfloat16 KV cache)" \
        in lines
    assert f"same pool: --kv-cache-memory-gib {plan.kv_cache_memory_gib!r} --kv-cache-dtype bfloat16" in lines
    # The same pool an engine builds from those flags.
    config = EngineConfig.build(shape, device="cpu", kv_cache_dtype="bfloat16",
                                kv_cache_memory_gib=plan.kv_cache_memory_gib)
    assert plan.capacity == KVCapacity.of_engine_config(config)
    args = cli.parse_args(["plan", "--memory", "1", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
