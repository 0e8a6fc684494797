"""Which device and dtype an engine runs on, and the KV pool sized from a GPU's memory: what
can be checked on this CPU-only machine (the GPU side is in the other tests here, on fake
CUDA tensors)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tandem.config import EngineConfig
from tandem.config.device import resolve_device, resolve_dtype
from tandem.config.names import auto_dtype_name, check_device_name
from tandem.engine.setup import engine_config_and_weights
from tandem.kvcache.memory_plan import DeviceMemoryPlan
from tandem.plan import make_plan


def test_auto_is_the_cpu_here_and_float32_on_it() -> None:
    assert resolve_device("auto") == "cpu"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert (auto_dtype_name("cuda"), auto_dtype_name("cuda:1", bfloat16_supported=False)) == ("bfloat16", "float16")
    assert resolve_dtype("float16", "cpu") == "float16"  # a named dtype is kept


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_a_machine_without_one_is_refused_saying_so(name: str) -> None:
    with pytest.raises(ValueError, match=f"device {name}: this process sees no CUDA device"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", ""])
def test_a_device_name_outside_the_choices_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        check_device_name(name)


def test_the_config_holds_resolved_names(loaded) -> None:
    config = EngineConfig.build(loaded.config, num_kv_blocks=8)
    assert (config.device_name, config.dtype_name, str(config.device)) == ("cpu", "float32", "cpu")
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        EngineConfig.build(loaded.config, num_kv_blocks=8, dtype="float64")


def test_gpu_memory_utilization_is_refused_on_the_cpu(loaded) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization sizes a GPU's KV pool; the engine runs on cpu"):
        engine_config_and_weights(loaded, dict(gpu_memory_utilization=0.5))


def test_tandem_chat_with_device_cuda_fails_in_seconds_before_loading() -> None:
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "tandem", "chat", "--device", "cuda"], input="", capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0
    assert "device cuda: this process sees no CUDA device" in run.stderr
    assert "Traceback" not in run.stderr
    assert time.monotonic() - start < 10


def test_the_device_plan_gives_the_rest_of_the_share_to_the_pool() -> None:
    plan = DeviceMemoryPlan(device_bytes=80 * 2**30, utilization=0.5, weight_bytes=2**30, step_peak_bytes=2**29,
                            block_bytes=2**20, measured=True)
    assert plan.budget_bytes == 40 * 2**30
    assert plan.kv_bytes == 40 * 2**30 - 2**30 - 2**29
    assert plan.num_blocks == 39424  # (40 - 1 - 0.5) GiB in MiB blocks
    assert "KV pool: 38.50 GiB = budget - weights - step peak: 39424 blocks" in "\n".join(plan.lines())
    with pytest.raises(ValueError, match="leaves no room for a KV block"):
        DeviceMemoryPlan(2**30, 0.5, 2**29, 1, 2**20, measured=False).num_blocks
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        DeviceMemoryPlan(2**30, 1.5, 0, 0, 1, measured=False)


def test_tandem_plan_prints_the_device_share() -> None:
    plan = make_plan(None, 80.0, gpu_memory_utilization=0.45)
    assert plan.dtype == "bfloat16"  # auto, on a GPU
    d = plan.device_plan
    assert d is not None and not d.measured
    assert plan.memory_bytes == int(80 * 2**30 * 0.45)
    assert plan.kv_memory_bytes == plan.memory_bytes - plan.weight_bytes - d.step_peak_bytes > 0
    assert plan.capacity.num_blocks == d.num_blocks
    assert any(line.startswith("device memory: 80.00 GiB x gpu_memory_utilization 0.45") for line in plan.lines())
