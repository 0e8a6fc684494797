"""Where a prompt is prefilled (router/disagg.py): each policy's decision on numbers worked
out by hand, and the cost estimates it learns from served requests."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.router.disagg import (
    DECISION_REASONS,
    DISAGG_POLICIES,
    PrefillCosts,
    PrefillInputs,
    Where,
    make_disagg_policy,
)

IDLE = PrefillInputs(num_prompt_tokens=50, num_uncached_remote=50, num_uncached_local=50, prefill_pending_tokens=0,
                     decode_pending_tokens=0, decode_num_running=0, has_prefill_worker=True)


def costs() -> PrefillCosts:
    return PrefillCosts(remote_s_per_token=1e-3, local_s_per_token=2e-3, handoff_s=0.05)


def decide(name: str, inputs: PrefillInputs, max_stall_s: float = 0.1):
    choice = make_disagg_policy(name, costs(), max_stall_s).decide(inputs)
    assert (choice.where, choice.reason) in DECISION_REASONS
    return choice.where.value, choice.reason


def test_a_short_prompt_on_an_idle_decode_worker_stays_local():
    # local 50 * 2 ms = 100 ms against remote 50 * 1 ms + 50 ms = 100 ms: a tie goes local
    assert decide("auto", IDLE) == ("local", "decode_idle")


def test_a_prompt_cheaper_remote_goes_remote():
    # local 60 * 2 = 120 ms > remote 60 * 1 + 50 = 110 ms
    inputs = dataclasses.replace(IDLE, num_uncached_remote=60, num_uncached_local=60)
    assert decide("auto", inputs) == ("remote", "cheaper_remote")


def test_a_busy_prefill_pool_makes_local_cheaper_unless_it_stalls_the_streams():
    busy = dataclasses.replace(IDLE, prefill_pending_tokens=1000, decode_num_running=3)
    # local 100 ms < remote 1050 * 1 + 50 = 1100 ms; the streams lose 50 * 2 = 100 ms <= 100 ms
    assert decide("auto", busy, max_stall_s=0.1) == ("local", "cheaper_local")
    assert decide("auto", busy, max_stall_s=0.099) == ("remote", "stalls_decode")


def test_a_prefix_the_decode_worker_holds_counts_for_local():
    # 400 tokens, 390 of them cached on the decode worker: local 10 * 2 = 20 ms, remote 450 ms
    inputs = dataclasses.replace(IDLE, num_prompt_tokens=400, num_uncached_remote=400, num_uncached_local=10,
                                 decode_num_running=5)
    assert decide("auto", inputs) == ("local", "cheaper_local")


@pytest.mark.parametrize("name", sorted(DISAGG_POLICIES))
def test_without_a_prefill_worker_only_always_insists_on_the_pool(name):
    where, reason = decide(name, dataclasses.replace(IDLE, has_prefill_worker=False))
    assert (where, reason) == {"auto": ("local", "no_prefill_worker"), "never": ("local", "policy_never"),
                               "always": ("remote", "policy_always")}[name]


def test_always_and_never():
    long = dataclasses.replace(IDLE, num_uncached_local=5000, num_uncached_remote=5000, decode_num_running=9)
    assert decide("always", IDLE) == ("remote", "policy_always")
    assert decide("never", long) == ("local", "policy_never")


def test_the_estimates_move_a_fifth_of_the_way_to_each_observation():
    c = costs()
    c.observe_remote(100, 0.5)  # 5 ms a token observed
    assert c.remote_s_per_token == pytest.approx(1e-3 + 0.2 * (5e-3 - 1e-3))
    c.observe_local(0, 1.0)  # nothing to learn from: ignored
    c.observe_local(10, 0.0)
    assert c.local_s_per_token == 2e-3
    c.observe_handoff(0.25)
    assert c.handoff_s == pytest.approx(0.05 + 0.2 * 0.2)


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="auto, always, never"):
        make_disagg_policy("sometimes")
    assert Where.LOCAL.value == "local"
