"""`tandem plan --slo`: the placement search by simulation (tandem/sim/plan_search.py) and its
command (tandem/sim/plan_command.py), on step models small enough that the answer is derivable."""

from __future__ import annotations

import argparse
import json
import shlex
import time

import numpy as np
import pytest

from tandem.cli import main
from tandem.config import ModelConfig
from tandem.router import serve_command
from tandem.sim.gpus import GpuSpec
from tandem.sim.plan_command import DISTSERVE_PLACEMENTS, helm_values, serve_argv
from tandem.sim.plan_search import Candidate, Hardware, PlanSearch, Settings
from tandem.sim.spec import SimRequest
from tandem.sim.workloads import Workload, chatbot_lengths, chatbot_workload

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 5000,
               "max_position_embeddings": 4096}
TINY = ModelConfig.from_config_dict(TINY_CONFIG, "tiny", where="test")
TEST_GPU = GpuSpec("test-gpu", 100.0, 1000.0, 0.05, 600.0, "NVLink")
"""A GPU of 51 MiB: room for the tiny model and about 11k KV blocks, so clusters build fast."""


class LinearSteps:
    """A step costs base + per prompt token + per decode sequence, the variable part split
    over the ranks: a prefill chunk stalls every decode in its step by its whole cost."""

    def __init__(self, base_s: float = 0.01, prefill_token_s: float = 2e-4, decode_seq_s: float = 1e-4) -> None:
        self.base_s, self.prefill_token_s, self.decode_seq_s = base_s, prefill_token_s, decode_seq_s

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int, tp: int = 1) -> float:
        if num_prefill_tokens + num_decode_seqs == 0:
            return 0.0
        return self.base_s + (self.prefill_token_s * num_prefill_tokens + self.decode_seq_s * num_decode_seqs) / tp

    @property
    def kv_bytes_per_token(self) -> int:
        return TINY.kv_bytes_per_token("float16")


def workload(num: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0) -> Workload:
    """``num`` requests at 1/s (Poisson), lengths uniform in the ranges."""
    rng = np.random.default_rng(seed)
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0, num - 1))])
    requests = []
    for t in arrivals:
        prompt_ids = tuple(rng.integers(0, TINY.vocab_size, int(rng.integers(*prompt))).tolist())
        requests.append(SimRequest(float(t), prompt_ids, int(rng.integers(*output))))
    return Workload("test", tuple(requests), 1.0)


def search(wl: Workload, slo: dict[str, float], num_gpus: int, steps: LinearSteps | None = None) -> PlanSearch:
    settings = Settings(num_gpus, budgets=(512,), max_seqs=(64,), max_probes=5, modes=("colocated", "always"))
    return PlanSearch(wl, steps or LinearSteps(), Hardware(TEST_GPU, TINY, "float16"), slo, settings)


def test_long_prompts_stalling_decodes_make_disaggregation_win_under_a_tight_tpot() -> None:
    # A 512-token chunk takes 112 ms; a decode step alone 10-11 ms. With a 15 ms TPOT bound a
    # colocated worker's streams survive about one prefill of another request each (200-token
    # outputs last ~2 s), so it holds well under 1 req/s; a prefill worker takes ~4 req/s
    # (250 ms a prompt) and its decode worker's streams never stall.
    s = search(workload(60, (1000, 1500), (150, 250)), {"ttft": 10_000, "tpot": 15}, num_gpus=3)
    outcomes = s.run()
    colo, disagg = s.best(("colocated",)), s.best(("always",))
    assert disagg is not None and outcomes[0] is disagg
    assert colo is None or disagg.score > 1.5 * colo.score
    for o in outcomes:
        assert o.candidate.gpus <= 3
        if o.pruned:  # one probe, failed, at the family's best rate per GPU x its GPUs
            assert len(o.probes) == 1 and not o.probes[0]["passed"] and o.max_rate is None


def test_a_decode_heavy_workload_with_a_loose_ttft_makes_colocated_win() -> None:
    # Short prompts, so a prefill worker idles while costing a GPU. A decode step costs
    # 10 ms + 2 ms a stream: a 50 ms TPOT holds 20 streams of ~150 tokens, ~2.7 req/s,
    # on one worker whether it prefills too (colocated, one GPU) or not (two GPUs).
    s = search(workload(120, (16, 32), (100, 200)), {"ttft": 5_000, "tpot": 50}, num_gpus=2,
               steps=LinearSteps(decode_seq_s=2e-3))
    outcomes = s.run()
    colo, disagg = s.best(("colocated",)), s.best(("always",))
    assert colo is not None and outcomes[0] is colo and colo.bound == "bracketed"
    tp1 = s.outcomes[Candidate.colocated(1, 1, 512, 64)]
    assert tp1.max_rate is not None
    assert 1.5 < tp1.max_rate < 4  # (tp 2: 1 ms a stream, 40 streams on two GPUs, ~3 req/s per GPU)
    assert disagg is None or colo.score > 1.5 * disagg.score


def test_a_tp_that_cannot_hold_the_weights_is_never_proposed() -> None:
    ctx = TINY.context_limit()
    weights = TINY.num_parameters * 2
    # Memory for half the weights and 1.5 full-length sequences at tp 2: tp 1 cannot fit.
    memory = (weights / 2 + 1.5 * ctx * TINY.kv_bytes_per_token("float16", 2)) / 0.9
    hw = Hardware(GpuSpec("small", 100.0, 1000.0, memory / 2**30, 600.0, "NVLink"), TINY, "float16")
    assert not hw.fits(1) and hw.kv_blocks(1) * 16 < ctx
    assert hw.fitting_tps(8) == [2, 4]  # and not 8: 8 ranks would leave some without a query head
    s = PlanSearch(workload(20, (64, 128), (8, 16)), LinearSteps(), hw, {"ttft": 5_000, "tpot": 100},
                   Settings(4, budgets=(512,), max_seqs=(64,), max_probes=2, modes=("colocated", "always")))
    outcomes = s.run()
    assert outcomes
    assert {o.candidate.prefill_tp for o in outcomes} | {o.candidate.decode_tp for o in outcomes} <= {2, 4}
    assert all(o.candidate.gpus <= 4 for o in outcomes)


def test_nothing_fits_is_refused() -> None:
    hw = Hardware(GpuSpec("tiny-memory", 100.0, 1000.0, 1e-4, 600.0, "NVLink"), TINY, "float16")
    with pytest.raises(ValueError, match="does not fit"):
        PlanSearch(workload(4, (8, 9), (2, 3)), LinearSteps(), hw, {"ttft": 1}, Settings(2)).run()


def serve_parse(argv: list[str]) -> argparse.Namespace:
    assert argv[:2] == ["tandem", "serve"]
    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    return parser.parse_args(argv[2:])


@pytest.mark.parametrize("candidate", [
    Candidate("disaggregated", "auto", 3, 2, 2, 1, 8192, 256),
    Candidate("disaggregated", "always", 1, 4, 2, 2, 512, 64),
    Candidate.colocated(4, 2, 2048, 128),
])
def test_the_serve_command_parses_to_the_same_configuration(candidate: Candidate) -> None:
    ns = serve_parse(shlex.split(shlex.join(serve_argv(candidate, "org/model", "float16", routing="round_robin"))))
    assert serve_command.model_of(ns) == "org/model"
    assert (ns.max_num_batched_tokens, ns.max_num_seqs, ns.dtype, ns.device) == (candidate.budget, candidate.max_seqs,
                                                                                "float16", "cuda")
    assert ns.gpu_memory_utilization == 0.9 and ns.gpus_per_worker == 1 and ns.policy == "round_robin"
    prefill_tp, decode_tp = serve_command.pool_tp(ns)
    if candidate.mode == "colocated":
        assert (ns.colocated, decode_tp) == (candidate.decode, candidate.decode_tp)
    else:
        assert ns.colocated == 0
        assert (ns.prefill, ns.decode, prefill_tp, decode_tp, ns.disagg_policy) == (
            candidate.prefill, candidate.decode, candidate.prefill_tp, candidate.decode_tp, candidate.policy)
    values = helm_values(candidate, "org/model", "float16")
    pools = ({"colocated": values["colocated"]} if candidate.mode == "colocated" else values["pools"])
    for pool in pools.values():  # deploy/helm/tandem/templates/router.yaml wants a GPU and a CPU per rank
        assert pool["resources"]["limits"]["nvidia.com/gpu"] == pool["tp"] <= int(pool["resources"]["limits"]["cpu"])
    assert values["engine"]["maxNumBatchedTokens"] == candidate.budget and values["mode"] == candidate.mode


def test_chatbot_lengths_follow_distserves_filter() -> None:
    lengths = chatbot_lengths(2000, seed=3)
    assert all(4 <= o and 8 <= p <= 1900 and p + o < 2048 for p, o in lengths)
    prompts, outputs = np.array(lengths).T
    assert 450 < np.median(prompts) < 580 and 60 < np.median(outputs) < 250  # a user turn or an answer
    wl = chatbot_workload(50, 32000, seed=3)
    assert [len(r.prompt_token_ids) for r in wl.requests] == [p for p, _ in chatbot_lengths(50, seed=3)]
    half = wl.at_rate(2.0)
    assert [r.arrival_s for r in half] == pytest.approx([r.arrival_s / 2 for r in wl.requests])


def test_tandem_plan_slo_prints_a_table_a_serve_command_and_helm_values(tmp_path, capsys) -> None:
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_CONFIG))
    out_json = tmp_path / "plan.json"
    rc = main(["plan", "--slo", "ttft:500", "tpot:100", "--model-config", str(config), "--gpu", "A100-80GB",
               "--num-gpus", "2", "--num-prompts", "20", "--budgets", "512", "--batch-limits", "64",
               "--modes", "colocated", "always", "--max-probes", "3", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "budget  seqs  GPUs   max rate  per GPU" in out and "best disaggregated / best colocated" in out
    (line,) = [line for line in out.splitlines() if line.startswith("tandem serve ")]
    ns = serve_parse(shlex.split(line))
    report = json.loads(out_json.read_text())
    best = report["best"]
    assert report["serve_command"] == line and ns.max_num_batched_tokens == best["budget"] == 512
    assert (ns.colocated > 0) == (best["mode"] == "colocated")
    assert "engine:\n  dtype: bfloat16\n  maxNumBatchedTokens: 512" in out
    assert best["rate_per_gpu"] == max(o["rate_per_gpu"] for o in report["outcomes"]) > 0


def test_tandem_plan_without_slo_still_needs_memory(capsys) -> None:
    assert main(["plan"]) == 2
    assert "needs --memory" in capsys.readouterr().err
    assert main(["plan", "--slo", "ttft:100", "--model-config", "/no/such/config.json"]) == 2  # no --gpu
    assert "--gpu" in capsys.readouterr().err


@pytest.mark.slow
def test_the_distserve_case_answers_within_two_minutes(capsys) -> None:
    started = time.perf_counter()
    assert main(["plan", "--distserve"]) == 0
    seconds = time.perf_counter() - started
    out = capsys.readouterr().out
    assert seconds < 120, f"took {seconds:.0f} s"
    assert "DistServe (published): up to 4.48x goodput" in out and "not DistServe's system" in out
    assert "this planner: best disaggregated" in out and "DistServe's placement here" in out
    assert "llama-2-13b (float16) on up to 8 A100-80GB, ttft 250 ms, tpot 100 ms, 90% attainment" in out
    assert all(c.label() for c in DISTSERVE_PLACEMENTS)
