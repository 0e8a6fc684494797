"""``tandem bench gpu``: without CUDA it says so and exits 0; its parts run on the CPU too
(the device is a parameter), so their logic is checked here before a GPU times them."""

from __future__ import annotations

import math

import pytest
import torch

from tandem import cli
from tandem.bench import gpu
from tandem.bench.gpu import attention, decode, parity
from tandem.bench.gpu.setup import GpuSetup, load_for_gpu

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@no_cuda
def test_without_cuda_it_says_so_and_exits_0(capsys):
    assert cli.main(["bench", "gpu"]) == 0
    out = capsys.readouterr().out
    assert "tandem bench gpu: no CUDA device here" in out and "run it on a machine with a GPU" in out


@no_cuda
def test_a_device_that_is_not_cuda_is_refused():
    with pytest.raises(ValueError, match="cuda or cuda:N"):
        load_for_gpu(None, "cpu", "auto")


@pytest.fixture(scope="module")
def cpu_setup(hf_model_and_tokenizer, loaded) -> GpuSetup:
    hf_model, tokenizer = hf_model_and_tokenizer
    return GpuSetup(loaded.config.name, torch.device("cpu"), "float32", hf_model, tokenizer, loaded, loaded)


@pytest.mark.slow
def test_parity_decode_and_kernels_run_on_the_cpu(cpu_setup, monkeypatch):
    result = parity.check(cpu_setup, num_tokens=8)
    assert result["exact"] and result["num_exact"] == len(parity.PROMPTS), result  # float32 on the CPU: exact
    assert all(len(t) > 0 for t in result["tandem"])

    rows = decode.bench(cpu_setup, [1, 2], prompt_len=16, output_len=5, seed=0, bandwidth=1e10)
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["num_steps"] == 4 and r["step_s"] > 0 and 0 < r["floor_fraction"] for r in rows)
    assert rows[1]["kv_bytes"] == 2 * rows[0]["kv_bytes"]

    monkeypatch.setattr(attention, "DECODE_SHAPES", ((2, 64),))
    monkeypatch.setattr(attention, "PREFILL_SHAPES", ((1, 32),))
    monkeypatch.setattr(attention, "STORE_TOKENS", (16,))
    kernels = attention.bench(cpu_setup, 1e10)
    assert [r["kernel"] for r in kernels] == ["decode", "prefill", "store_kv"]
    assert all(math.isfinite(r["tandem_s"]) for r in kernels)

    staging = [{"direction": "device->host", "tokens": 16, "bytes": 2**20, "bytes_per_s": 2e10,
                "device_fraction": 0.02, "link_fraction": 0.8}]
    results = {"model": cpu_setup.name, "device": "cpu", "torch": torch.__version__, "cuda": None,
               "dtype": "float32", "parity": result, "bandwidth": {"bytes_per_s": 2e10}, "decode": rows,
               "kernels": kernels, "staging": staging}
    lines = gpu.report(results)
    assert "greedy parity with transformers, float32: 4/4 prompts token-exact over 8 tokens" in lines[1]
    assert any(line.startswith("decode batch   2:") for line in lines)
    assert any("SDPA" in line for line in lines) and any("KV staging device->host" in line for line in lines)
