"""`tandem simulate` end to end: flags -> workload -> simulated cluster -> the bench's report."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main
from tandem.sim.step_time import FEATURES, CpuStepModel
from tandem.sim.traces import example_trace_path

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 5000,
               "max_position_embeddings": 8192}
SMALL_MIX = ["--num-prompts", "10", "--short-prompt-len", "8", "16", "--long-prompt-len", "64", "96",
             "--output-len", "4", "8"]


@pytest.fixture
def model_config(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


@pytest.fixture
def step_fit(tmp_path):
    # Whatever the fit's terms: a fixed cost, prompt tokens, decodes and context, linear.
    known = {"constant": 0.02, "decode_seqs": 1e-3, "context_tokens": 1e-6}
    coefficients = {name: known.get(name, 1e-4 if name.startswith("prefill_tokens") and "squared" not in name else 0.0)
                    for name in FEATURES}
    fit = CpuStepModel(coefficients=coefficients, kv_bytes_per_token=512, meta={"dtype": "float32", "num_threads": 1})
    return str(fit.to_json(tmp_path / "fit.json"))


def simulate(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["simulate", *argv])
    return rc, capsys.readouterr().out


def test_the_bench_mix_runs_through_a_disaggregated_cluster(capsys, tmp_path, model_config, step_fit):
    out_json = tmp_path / "sim.json"
    rc, out = simulate(capsys, "--model-config", model_config, "--step-fit", step_fit, "--request-rate", "4",
                       "--disagg-policy", "always", "--json", str(out_json), *SMALL_MIX)
    assert rc == 0
    # The bench's report of a run, then the simulation's own lines.
    assert " disaggregated @ 4 req/s " in out
    for line in ("Successful requests:", "Mean TTFT (ms):", "P99 ITL (ms):", "time by phase (ms)",
                 "prefill decisions: remote/policy_always 10", "x real time"):
        assert line in out
    report = json.loads(out_json.read_text())
    (run,) = report["runs"]
    assert run["metrics"]["completed"] == 10 and run["metrics"]["failed"] == 0
    assert run["metrics"]["by_kind"]["long"]["completed"] == 2  # the bench's 20% long prompts
    assert run["decisions"] == {"remote/policy_always": 10}
    assert report["spec"]["prefill"]["num_workers"] == 1 and report["spec"]["decode"]["num_workers"] == 1
    assert [r["requested_output_len"] for r in run["requests"]] == [r["output_tokens"] for r in run["requests"]]


def test_each_rate_is_a_run_of_its_own(capsys, tmp_path, model_config, step_fit):
    out_json = tmp_path / "sim.json"
    rc, out = simulate(capsys, "--model-config", model_config, "--step-fit", step_fit, "--mode", "colocated",
                       "--colocated", "2", "--request-rate", "1", "inf", "--json", str(out_json), *SMALL_MIX)
    assert rc == 0
    assert "colocated @ 1 req/s" in out and "colocated @ inf req/s" in out
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["metrics"]["completed"] for r in runs] == [10, 10]
    assert all(r["decisions"] == {} for r in runs)
    assert set(runs[0]["workers"]) == {"colocated-0", "colocated-1"}


def test_a_mooncake_trace_on_a_gpu_roofline(capsys, tmp_path, model_config):
    out_json = tmp_path / "sim.json"
    rc, out = simulate(capsys, "--model-config", model_config, "--gpu", "H100", "--trace", str(example_trace_path()),
                       "--num-kv-blocks", "2048", "--json", str(out_json))
    assert rc == 0
    assert "roofline of H100" in out
    (run,) = json.loads(out_json.read_text())["runs"]
    assert run["metrics"]["completed"] == 30  # the example trace's requests
    assert sum(w["prefix_hit_tokens"] for w in run["workers"].values()) > 0  # its shared prefixes hit


def test_a_bad_flag_value_is_an_error_not_a_traceback(capsys, model_config, step_fit):
    rc = main(["simulate", "--model-config", model_config, "--step-fit", step_fit, "--goodput", "ttft"])
    assert rc == 2
    assert "--goodput" in capsys.readouterr().err
