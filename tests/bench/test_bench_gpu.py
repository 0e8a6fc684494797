"""``tandem bench gpu``: without CUDA it says so and exits 0; its parts run on the CPU too
(the device is a parameter), so their logic is checked here before a GPU times them."""

from __future__ import annotations

import math

import pytest
import torch

from tandem import cli
from tandem.bench import gpu
from tandem.bench.gpu import attention, decode, parity, sampling, serve_check
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


def test_the_serve_burst_mixes_long_and_short_ordinary_prompts(cpu_setup):
    prompts = serve_check.mixed_prompts(cpu_setup, 8, seed=3)
    lens = [len(p) for p in prompts]
    assert all(800 <= n <= 1500 for n in lens[3::4]) and all(16 <= n <= 200 for i, n in enumerate(lens) if i % 4 != 3)
    eos = set(cpu_setup.config.eos_token_ids)
    assert not any(t in eos for p in prompts for t in p)
    assert prompts == serve_check.mixed_prompts(cpu_setup, 8, seed=3)  # the same burst for the same seed


def test_the_serve_rows_read_the_kv_paths_off_the_routers_metrics_and_say_pass_fail_or_skip():
    text = ('# HELP tandem_kv_transfer_paths_total KV transfers begun, by data path.\n'
            'tandem_kv_transfer_paths_total{pool="prefill",worker="prefill-0",path="cuda_ipc"} 31.0\n'
            'tandem_kv_transfer_paths_total{pool="prefill",worker="prefill-1",path="cuda_ipc"} 1.0\n'
            'tandem_kv_transfer_paths_total{pool="prefill",worker="prefill-0",path="zmq"} 0.0\n')
    assert serve_check.paths_of(text) == {"cuda_ipc": 32.0}
    rows: list[dict] = [
        {"name": "default, one GPU", "exact": True, "num_exact": 32, "num_requests": 32, "num_tokens": 32,
         "serve_s": 2.5, "start_s": 40.0, "paths": {"cuda_ipc": 32.0}},
        {"name": "KV pair over NCCL", "skipped": "needs 2 GPUs, this machine has 1"},
        {"name": "x", "exact": False, "error": "RuntimeError: tandem serve exited with 1 before it served"}]
    lines = gpu.serve_lines(rows)
    assert lines[0].startswith("PASS tandem serve, default, one GPU: 32/32") and "cuda_ipc 32" in lines[0]
    assert lines[1] == "SKIP tandem serve, KV pair over NCCL: needs 2 GPUs, this machine has 1"
    assert lines[2].startswith("FAIL tandem serve, x: RuntimeError")


@pytest.mark.slow
def test_the_sampling_checks_pass_where_the_device_is_the_cpu(cpu_setup):
    lines = sampling.check(cpu_setup)
    assert len(lines) == 3 and all(line.startswith("PASS sampling:") for line in lines), lines
    assert "differ in 0 of" in lines[0]  # the same device on both sides
