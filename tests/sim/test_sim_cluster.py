"""tandem.sim: the real engine, scheduler, block manager, router policies and prefill decision
on a virtual clock. Every timing below is worked out by hand from a linear step-time model.

(Named test_sim_cluster.py: a second test_cluster.py beside tests/cluster/'s would clash in
pytest's module names.)
"""

from __future__ import annotations

import pytest

from tandem.bench.serving.load import summarize
from tandem.config import ModelConfig
from tandem.sim.run import simulate
from tandem.sim.spec import ClusterSpec, PoolSpec, SimRequest

NUM_LAYERS = 2
MODEL = ModelConfig.from_config_dict(
    {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": NUM_LAYERS, "hidden_size": 64,
     "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50_000,
     "max_position_embeddings": 4096}, "tiny")


class LinearSteps:
    """step_s = a + b * prefill tokens + c * decode seqs + e * context tokens."""

    def __init__(self, a: float = 0.01, b: float = 1e-4, c: float = 2e-3, e: float = 1e-6,
                 kv_bytes_per_token: int = 1000) -> None:
        self.a, self.b, self.c, self.e = a, b, c, e
        self.kv_bytes_per_token = kv_bytes_per_token
        self.calls: list[tuple[int, int, int]] = []

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int, tp: int = 1) -> float:
        self.calls.append((num_prefill_tokens, num_decode_seqs, num_context_tokens))
        return self.f(num_prefill_tokens, num_decode_seqs, num_context_tokens)

    def f(self, p: int, d: int, ctx: int) -> float:
        return self.a + self.b * p + self.c * d + self.e * ctx


def prompt(n: int, start: int = 2) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def colocated(**pool) -> ClusterSpec:
    return ClusterSpec("colocated", colocated=PoolSpec(1, **pool))


def disaggregated(policy: str = "always", num_prefill: int = 1, link: float = 1e6, latency: float = 1e-3,
                  **decode_pool) -> ClusterSpec:
    return ClusterSpec("disaggregated", prefill=PoolSpec(num_prefill), decode=PoolSpec(1, **decode_pool),
                       disagg_policy=policy, link_bytes_per_s=link, link_latency_s=latency)


def test_a_single_colocated_request_takes_its_steps_times():
    steps = LinearSteps()
    report = simulate(colocated(), [SimRequest(0.0, prompt(40), 4, "short")], steps, MODEL, {})
    f = steps.f
    prefill, decodes = f(40, 0, 40), [f(0, 1, 41), f(0, 1, 42), f(0, 1, 43)]
    assert steps.calls == [(40, 0, 40), (0, 1, 41), (0, 1, 42), (0, 1, 43)]
    r = report.results[0]
    assert r.success and r.code == "OK" and r.finish_reason == "length" and r.output_tokens == 4
    assert r.ttft_ms == pytest.approx(prefill * 1e3)
    assert r.itl_ms == pytest.approx([d * 1e3 for d in decodes])
    assert r.e2el_ms == pytest.approx((prefill + sum(decodes)) * 1e3)
    assert r.tpot_ms == pytest.approx(sum(decodes) / 3 * 1e3)
    assert report.metrics == summarize(report.results, report.sim_s, {})
    assert report.sim_s == pytest.approx(prefill + sum(decodes))
    assert report.decisions == {}


def test_a_single_disaggregated_request_overlaps_its_kv_transfer_with_the_prefill():
    steps = LinearSteps()
    spec = disaggregated(link=1e6, latency=1e-3)
    report = simulate(spec, [SimRequest(0.0, prompt(40), 4, "short")], steps, MODEL, {})
    f = steps.f
    prefill = f(40, 0, 40)
    # 40 tokens x 1000 B over 1 MB/s from the prefill's start, or its last layer after its end.
    kv_done = max(prefill + 40 * 1000 / NUM_LAYERS / 1e6, 40 * 1000 / 1e6) + 1e-3
    decodes = [f(0, 1, 41), f(0, 1, 42), f(0, 1, 43)]
    r = report.results[0]
    # The first token streams as soon as the prefill worker samples it (the KV still arriving).
    assert r.ttft_ms == pytest.approx(prefill * 1e3)
    assert r.itl_ms == pytest.approx([(kv_done - prefill + decodes[0]) * 1e3, decodes[1] * 1e3, decodes[2] * 1e3])
    assert r.e2el_ms == pytest.approx((kv_done + sum(decodes)) * 1e3)
    assert report.decisions == {"remote/policy_always": 1}
    assert report.breakdown["transfer"]["mean"] == pytest.approx((kv_done - prefill) * 1e3)
    assert report.breakdown["queue"]["mean"] == 0.0
    assert report.workers["prefill-0"]["steps"] == 1 and report.workers["decode-0"]["steps"] == 3


def test_a_prompt_sharing_a_prefix_hits_the_real_prefix_cache():
    steps = LinearSteps()
    shared = prompt(64)  # 4 full blocks of 16
    requests = [SimRequest(0.0, shared + prompt(16, 500), 2, "short"),
                SimRequest(5.0, shared + prompt(16, 700), 2, "short")]
    report = simulate(colocated(), requests, steps, MODEL, {})
    assert [t.num_cached_tokens for t in report.traces] == [0, 64]
    assert report.results[1].ttft_ms == pytest.approx(steps.f(16, 0, 80) * 1e3)
    assert report.workers["colocated-0"]["prefix_hit_tokens"] == 64


def test_disaggregated_a_prefix_the_decode_worker_caches_is_not_sent():
    steps = LinearSteps()
    shared = prompt(64)
    requests = [SimRequest(0.0, shared + prompt(16, 500), 2, "short"),
                SimRequest(5.0, shared + prompt(16, 700), 2, "short")]
    report = simulate(disaggregated(link=1e5, latency=0.0), requests, steps, MODEL, {})
    second = report.traces[1]
    assert second.prefill_start_s is not None and second.prefill_end_s is not None and second.kv_done_s is not None
    prefill = steps.f(16, 0, 80)  # the prefill worker's own cache holds the prefix too
    assert second.prefill_end_s - second.prefill_start_s == pytest.approx(prefill)
    # Only the 16 tokens past the decode worker's cached prefix go over the link.
    kv_done = max(prefill + 16 * 1000 / NUM_LAYERS / 1e5, 16 * 1000 / 1e5)
    assert second.kv_done_s - second.prefill_start_s == pytest.approx(kv_done)
    assert second.num_cached_tokens == 64


def test_a_burst_beyond_the_decode_pool_queues_at_the_router_instead_of_failing():
    steps = LinearSteps()
    # 20 blocks of 16: a 100-token prompt reserves 7 (its first token's slot too): two at once.
    requests = [SimRequest(0.0, prompt(100, 2 + 100 * i), 8, "long") for i in range(5)]
    report = simulate(disaggregated(num_kv_blocks=20), requests, steps, MODEL, {})
    assert report.metrics["completed"] == 5 and report.metrics["failed"] == 0
    queued = [t.admitted_s - t.arrive_s for t in report.traces if t.admitted_s is not None]
    assert len(queued) == 5  # every one admitted
    assert queued[:2] == [0.0, 0.0] and all(q > 0 for q in queued[2:])
    assert report.decisions == {"remote/policy_always": 5}


def test_the_scheduler_preempts_when_blocks_run_out():
    # 6 blocks; two 32-token prompts (2 blocks each) grow by a block every 16 tokens: at 48
    # tokens each both need a 4th, so the newer is swapped out (3 blocks) and swapped back
    # in (3 blocks) once the older has finished (at 72 tokens: 5 blocks).
    steps = LinearSteps()
    requests = [SimRequest(0.0, prompt(32), 40, "short"), SimRequest(0.0, prompt(32, 300), 40, "short")]
    report = simulate(colocated(num_kv_blocks=6), requests, steps, MODEL, {})
    assert report.metrics["completed"] == 2 and report.metrics["exact_output_len"] == 2
    assert report.workers["colocated-0"]["preemptions"] == 1
    assert report.workers["colocated-0"]["swapped_blocks"] == 6
    first, second = report.traces
    assert first.end_s is not None and second.end_s is not None
    assert second.end_s > first.end_s + 16 * steps.f(0, 1, 49)  # waited out the first's last 24 tokens


def test_a_request_the_pool_cannot_hold_for_a_minute_is_refused():
    steps = LinearSteps(a=1.0)  # ~1 s a step: the first request holds the pool for ~100 s
    # 8 blocks (128 tokens): the first grows from 2 to 8 blocks; the second needs 7 free.
    requests = [SimRequest(0.0, prompt(20), 100, "short"), SimRequest(1.0, prompt(100, 300), 4, "long")]
    report = simulate(disaggregated(num_kv_blocks=8), requests, steps, MODEL, {})
    refused = report.results[1]
    assert not refused.success and refused.code == "RESOURCE_EXHAUSTED"
    # The router's admission timeout, checked between asks; an ask waits for the decode
    # worker's step to end (the reservation runs between its steps).
    assert refused.e2el_ms is not None and 60_000.0 <= refused.e2el_ms <= 60_000.0 + steps.f(0, 1, 128) * 1e3
    assert report.results[0].success


def test_a_prompt_that_could_never_fit_fails_at_once():
    requests = [SimRequest(0.0, prompt(200), 4, "long")]
    report = simulate(disaggregated(num_kv_blocks=8), requests, LinearSteps(), MODEL, {})
    assert report.results[0].code == "INVALID_ARGUMENT" and report.metrics["failed"] == 1


@pytest.mark.parametrize("policy, num_prefill, decision", [
    ("never", 1, "local/policy_never"),
    ("auto", 0, "local/no_prefill_worker"),
    ("auto", 1, "local/decode_idle"),
])
def test_a_local_prefill_runs_on_the_decode_worker(policy, num_prefill, decision):
    steps = LinearSteps()
    report = simulate(disaggregated(policy, num_prefill), [SimRequest(0.0, prompt(40), 2, "short")], steps, MODEL, {})
    assert report.decisions == {decision: 1}
    assert report.results[0].ttft_ms == pytest.approx(steps.f(40, 0, 40) * 1e3)
    assert "prefill-0" not in report.workers or report.workers["prefill-0"]["steps"] == 0


def test_always_without_a_prefill_worker_fails_unavailable():
    report = simulate(disaggregated("always", 0), [SimRequest(0.0, prompt(40), 2, "short")], LinearSteps(), MODEL, {})
    assert report.results[0].code == "UNAVAILABLE" and report.decisions == {}


def test_decisions_are_counted_per_request():
    steps = LinearSteps()
    requests = [SimRequest(0.5 * i, prompt(40, 2 + 40 * i), 4, "short") for i in range(6)]
    report = simulate(disaggregated("never"), requests, steps, MODEL, {})
    assert report.decisions == {"local/policy_never": 6}


def test_a_long_prompt_stalls_colocated_decodes_but_not_disaggregated_ones():
    steps = LinearSteps()
    requests = [SimRequest(0.0, prompt(40), 60, "short"), SimRequest(0.05, prompt(1000, 100), 2, "long")]
    pool = dict(max_num_batched_tokens=2048, num_kv_blocks=256)
    together = simulate(colocated(**pool), requests, steps, MODEL, {})
    apart = simulate(ClusterSpec("disaggregated", prefill=PoolSpec(1, **pool), decode=PoolSpec(1, **pool),
                                 disagg_policy="always"), requests, steps, MODEL, {})
    whole_prompt_ms = steps.f(1000, 0, 1000) * 1e3
    assert max(together.results[0].itl_ms) >= whole_prompt_ms  # a step ran the whole prompt beside it
    assert max(apart.results[0].itl_ms) < whole_prompt_ms / 2


def test_it_runs_far_faster_than_real_time():
    steps = LinearSteps(a=0.05, b=2e-3, c=5e-3, e=2e-6)  # about the CPU's: a 60 ms decode step
    requests = [SimRequest(float(i), prompt(600 if i % 5 == 0 else 40, 2 + 700 * i), 32,
                           "long" if i % 5 == 0 else "short") for i in range(50)]
    reports = [simulate(disaggregated("auto"), requests, steps, MODEL, {}) for _ in range(3)]
    assert reports[0].metrics["completed"] == 50
    # The best of three: on a shared machine one run may lose its core for a while.
    assert max(r.speed_factor for r in reports) > 100
