"""``tandem bench engine``: the workload generator, the report, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from tandem.bench import decode_steps, plots
from tandem.bench import engine as bench_engine
from tandem.bench.bandwidth import measure_copy_bandwidth
from tandem.bench.workload import allowed_token_ids, excluded_token_ids, make_workload
from tandem.model.loader import LoadedModel

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_workload_lengths_in_range_and_seeded():
    token_ids = allowed_token_ids(1000, excluded={0, 1, 2, 999})
    requests = make_workload(200, token_ids, (32, 1024), (16, 256), seed=7)
    assert len(requests) == 200
    assert all(32 <= r.prompt_len <= 1024 and 16 <= r.output_len <= 256 for r in requests)
    # Uniform over the range: both ends of it are reached roughly, not just the middle.
    assert min(r.prompt_len for r in requests) < 100 and max(r.prompt_len for r in requests) > 950
    assert all(t not in {0, 1, 2, 999} and 0 <= t < 1000 for r in requests for t in r.prompt_token_ids)
    assert make_workload(200, token_ids, (32, 1024), (16, 256), seed=7) == requests
    # A shorter workload with the same seed is the start of the longer one.
    assert make_workload(8, token_ids, (32, 1024), (16, 256), seed=7) == requests[:8]
    assert make_workload(8, token_ids, (32, 1024), (16, 256), seed=8) != requests[:8]


def test_workload_fixed_lengths_and_bad_ranges():
    token_ids = allowed_token_ids(10, excluded=[])
    (r,) = make_workload(1, token_ids, (5, 5), (3, 3), seed=0)
    assert r.prompt_len == 5 and r.output_len == 3
    with pytest.raises(ValueError):
        make_workload(1, token_ids, (10, 5), (3, 3), seed=0)
    with pytest.raises(ValueError):
        allowed_token_ids(3, excluded=[0, 1, 2])


def test_excluded_token_ids_covers_special_added_and_eos():
    class Tok:
        all_special_ids = [0, 1]
        added_tokens_decoder = {5: "<x>"}

    assert excluded_token_ids(Tok(), eos_token_ids=(2,)) == {0, 1, 2, 5}


def test_quick_settings_and_overrides():
    parser = argparse.ArgumentParser()
    bench_engine.add_args(parser)
    assert bench_engine.settings_from_args(parser.parse_args([])) == bench_engine.FULL
    quick = bench_engine.settings_from_args(parser.parse_args(["--quick", "--concurrency", "1", "3"]))
    assert quick.concurrency == [1, 3] and quick.prompt_len == bench_engine.QUICK.prompt_len
    with pytest.raises(ValueError):
        bench_engine.settings_from_args(parser.parse_args(["--copy-mib", "64"]))


def test_decode_step_settings_and_formats():
    parser = argparse.ArgumentParser()
    bench_engine.add_args(parser)
    assert decode_steps.settings_from_args(parser.parse_args([])) == decode_steps.FULL
    assert decode_steps.FULL.batch_sizes == [1, 8, 32]
    assert decode_steps.FULL.formats == ["float32", "int4", "int4-eager"]
    quick = decode_steps.settings_from_args(parser.parse_args(["--quick", "--formats", "int4", "int4", "float32"]))
    assert quick.formats == ["int4", "float32"] and quick.batch_sizes == decode_steps.QUICK.batch_sizes
    with pytest.raises(ValueError):
        decode_steps.settings_from_args(parser.parse_args(["--step-output-len", "2"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--formats", "fp8"])
    # One place maps a name to the engine's options: float32 is the weights as loaded.
    assert decode_steps.resolve_format("float32", None) is None and decode_steps.resolve_format("int4", None) == "int4"
    assert decode_steps.resolve_format("int4-eager", None) == "int4"
    fmt = decode_steps.Format("int4", "int4", loaded=None)  # type: ignore[arg-type]
    assert fmt.engine_kwargs() == {"dtype": "float32", "quantization": "int4", "enforce_eager": False}
    eager = decode_steps.Format("int4-eager", "int4", loaded=None, enforce_eager=True)  # type: ignore[arg-type]
    assert eager.engine_kwargs()["enforce_eager"] is True


def test_kv_bytes_per_step_is_the_mean_context():
    class Config:
        def kv_bytes_per_token(self, dtype: str) -> int:
            assert dtype == "float32"
            return 10

    class Loaded:
        config = Config()

    # Decode steps 1..3 attend over prompt + 1, + 2, + 3 tokens: a mean of prompt + 2.
    loaded = cast(LoadedModel, Loaded())  # the one attribute kv_bytes_per_step reads
    assert decode_steps.kv_bytes_per_step(loaded, batch=4, prompt_len=100, num_steps=3) == 4 * 102 * 10


def test_copy_bandwidth_is_positive():
    bw = measure_copy_bandwidth(size_mib=512, repeats=1)
    assert bw.size_bytes == 512 * 2**20 and 0 < bw.bytes_per_s < math.inf


def _fake_results() -> dict:
    row = {"concurrency": 1, "num_requests": 2, "output_tokens": 10, "tandem_tok_s": 20.0,
           "transformers_tok_s": 10.0, "ratio": 2.0, "greedy_agreement": 1.0}
    steps = {"tpot_s": 0.02, "median_s": 0.02, "p90_s": 0.03, "utilisation": 0.5, "step_s": [0.02, 0.03]}
    return {
        "model": "m", "dtype": "float32", "num_threads": 2, "torch": "x", "seed": 0,
        "workload": {"prompts": "random", "prompt_len": [1, 2], "output_len": [1, 2], "sampling": "greedy"},
        "bandwidth": {"bytes_per_s": 1e10, "size_bytes": 2**29, "repeats": 3},
        "throughput": [row, {**row, "concurrency": 8}],
        "single_stream": {"prompt_len": 4, "output_len": 3, "weight_bytes": 10**8, "floor_s": 0.01,
                          "tandem": steps, "transformers": {**steps, "tpot_s": 0.04}},
    }


def test_report_and_plots_from_results(tmp_path, capsys):
    paths = plots.write_plots(_fake_results(), tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "tpot.png"]
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in paths)
    plots.print_report(_fake_results())
    out = capsys.readouterr().out
    assert "2.00x" in out and "bandwidth utilisation" in out and "2 * size / time" in out


def test_decode_step_table_and_plot(tmp_path, capsys):
    def row(fmt: str, batch: int, step: float, floor: float) -> dict:
        return {"format": fmt, "batch_size": batch, "prompt_len": 128, "output_len": 64, "step_s": step,
                "tok_s": batch / step, "weight_bytes": 538e6 if fmt == "float32" else 95e6, "kv_bytes": 1e6 * batch,
                "floor_s": floor, "floor_fraction": floor / step}

    results = {**_fake_results(), "decode_steps": {
        "bandwidth": {"bytes_per_s": 2e10},
        "rows": [row("float32", 1, 0.030, 0.027), {**row("float32", 8, 0.060, 0.030), "others_cpu": 0.4},
                 row("int4", 1, 0.015, 0.005), row("int4", 8, 0.040, 0.006)]}}
    paths = plots.write_plots(results, tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "tpot.png", "decode_steps.png"]
    assert paths[-1].read_bytes().startswith(PNG_SIGNATURE)
    plots.print_report(results)
    out = capsys.readouterr().out
    assert "floor/step" in out and "20.00 GB/s" in out and "40% !" in out and "suspect" in out
    assert re.search(r"int4\s+1\s+66\.7\s+2\.00x\s+15\.00\s+95\s+1\.0\s+5\.00\s+33%\s+-", out), out


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path):
    """The real command, shrunk further than --quick so that it stays well under 90 s
    (about 30 s, most of it the model load). One thread: on a small machine shared with
    other test runs, more threads than free cores makes every step crawl."""
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "tandem", "bench", "engine", "--quick", "--out-dir", str(out_dir),
           "--prompt-len", "8", "24", "--output-len", "2", "5", "--tpot-prompt-len", "8",
           "--tpot-output-len", "4", "--num-threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio" in proc.stdout and "bandwidth utilisation" in proc.stdout

    results = json.loads((out_dir / "results.json").read_text())
    assert {"model", "num_threads", "workload", "bandwidth", "throughput", "single_stream"} <= results.keys()
    assert results["num_threads"] == 1
    assert [r["concurrency"] for r in results["throughput"]] == [1, 2]
    for r in results["throughput"]:
        for key in ("tandem_tok_s", "transformers_tok_s", "ratio"):
            assert 0 < r[key] < math.inf, (key, r)
        assert r["num_requests"] == 2 and r["tandem_preemptions"] == 0
    single = results["single_stream"]
    assert 0 < results["bandwidth"]["bytes_per_s"] < math.inf
    assert single["floor_s"] > 0
    for name in ("tandem", "transformers"):
        assert len(single[name]["step_s"]) == 3  # 4 output tokens: 3 decode steps after the prefill
        assert 0 < single[name]["utilisation"] < math.inf
        assert np.isclose(single[name]["tpot_s"], np.mean(single[name]["step_s"]))
    steps = results["decode_steps"]
    assert 0 < steps["bandwidth"]["bytes_per_s"] < math.inf
    assert [(r["format"], r["batch_size"]) for r in steps["rows"]] == [
        ("float32", 1), ("float32", 2), ("int4", 1), ("int4", 2)]
    for r in steps["rows"]:
        assert r["decode_steps"] == len(r["step_times_s"]) == 3  # 4 output tokens: 3 pure decode steps
        assert np.isclose(r["step_s"], np.mean(r["step_times_s"]))
        assert np.isclose(r["tok_s"], r["batch_size"] / r["step_s"])
        assert np.isclose(r["floor_s"], (r["weight_bytes"] + r["kv_bytes"]) / steps["bandwidth"]["bytes_per_s"])
        assert 0 < r["floor_fraction"] < math.inf and 0 <= r["others_cpu"] <= 1
    # int4 (the GGUF file's own Q4_1 blocks) reads far fewer weight bytes per step than float32.
    w = {r["format"]: r["weight_bytes"] for r in steps["rows"]}
    assert w["int4"] < 0.3 * w["float32"]
    assert "floor/step" in proc.stdout
    for name in ("throughput.png", "tpot.png", "decode_steps.png"):
        assert (out_dir / name).read_bytes().startswith(PNG_SIGNATURE)
