"""The scheduler charges prefix blocks loaded from a KV tier against the step's token budget:
the step-time fit against numpy's weighted least squares, and a prompt whose history is on
the tier loading over several steps, exact block ids, before it starts; reservations between
steps (a decode worker's) load what one step pays for, and the next step pays."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import add_seq, all_free, make_scheduler, run_step

from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.tier_load_cost import StepTimeFit
from tandem.kvcache.block_hash import prefix_hashes
from tandem.kvcache.kv_events import KVEventLog
from tandem.kvcache.prefix_tier import PrefixTier, TierCounters
from tandem.sampling_params import SamplingParams

LOAD_SECONDS = 0.010
"""What the tier below takes to load a block."""
SECONDS_PER_TOKEN = 0.001
"""What a step spends per token: a block's load costs 10 tokens of the budget."""


def test_the_fit_is_numpys_weighted_least_squares() -> None:
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 512, size=300)
    seconds = 0.008 + 0.0002 * sizes + rng.normal(0, 0.001, size=300)
    fit = StepTimeFit()
    for x, y in zip(sizes, seconds):
        fit.add(int(x), float(y))
    weights = StepTimeFit.DECAY ** np.arange(299, -1, -1)  # the last step weighs 1
    slope, _ = np.polyfit(sizes, seconds, 1, w=np.sqrt(weights))
    assert fit.seconds_per_token == pytest.approx(slope, rel=1e-9)
    assert fit.seconds_per_token == pytest.approx(0.0002, rel=0.05)


def test_steps_of_one_size_or_a_falling_slope_tell_nothing() -> None:
    fit = StepTimeFit()
    assert fit.seconds_per_token is None
    for _ in range(10):
        fit.add(8, 0.01)
    assert fit.seconds_per_token is None  # no spread in size
    for x in (16, 32, 64):
        fit.add(x, 0.01 / x)
    assert fit.seconds_per_token is None  # bigger steps faster: no cost to read


class TimedTier:
    """A PrefixTier holding blocks by hash in a dict, whose every load counts LOAD_SECONDS,
    as a disk tier's counters count the time its reads took."""

    name = "timed"
    events: KVEventLog | None = None
    next_tier: PrefixTier | None = None

    def __init__(self) -> None:
        self.counters = TierCounters()
        self.stored: set[bytes] = set()
        self.loads: list[int] = []

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.stored

    def offload(self, block_id: int, block_hash: bytes) -> None:
        self.stored.add(block_hash)

    def offload_copy(self, block_hash: bytes, kv) -> None:
        raise AssertionError("not a tier after another")

    def load(self, block_hash: bytes, block_id: int) -> bool:
        self.loads.append(block_id)
        self.counters.loaded(64, LOAD_SECONDS)
        return True

    def block_hashes(self) -> list[bytes]:
        return list(self.stored)

    def close(self) -> None:
        pass


class FixedStepRate:
    """A step-time fit that has measured SECONDS_PER_TOKEN (the harness's steps take no time)."""

    seconds_per_token = SECONDS_PER_TOKEN

    def add(self, num_tokens: int, seconds: float) -> None:
        pass


HISTORY = list(range(500, 537))
"""9 full blocks of 4 and one token."""


def history_on_the_tier() -> tuple[Scheduler, TimedTier]:
    """Block size 4, 12 blocks, a budget of 32 tokens (a loaded block costs 10 tokens of it):
    HISTORY has run, and a prompt taking every block has moved its 9 blocks to the tier."""
    sched = make_scheduler(num_kv_blocks=12, block_size=4, max_num_batched_tokens=32)
    tier = TimedTier()
    sched.block_manager.tier = tier
    sched.prefill_packer.load_cost.step_fit = FixedStepRate()  # type: ignore[assignment]
    for rid, prompt in (("first", HISTORY), ("evictor", 45)):
        seq = add_seq(sched, rid, prompt, max_tokens=1)
        while sched.has_unfinished:
            run_step(sched)
        assert seq.status == SequenceStatus.FINISHED_LENGTH
    assert tier.stored == set(prefix_hashes(HISTORY, 4))
    assert tier.stored.isdisjoint(sched.block_manager.cached_block_ids)
    return sched, tier


def test_a_history_on_the_tier_loads_within_the_budget_before_it_starts() -> None:
    sched, tier = history_on_the_tier()
    cost = sched.prefill_packer.load_cost
    assert tier.loads == [] and cost.tokens_per_load() is None  # nothing loaded yet: no cost known

    # The first lookup loads without a limit (no cost known yet); its load is then measured
    # and charged. The history's blocks were evicted in order, so the free list starts 0, 1, 2.
    probe = add_seq(sched, "probe", HISTORY[:5], max_tokens=1)  # one full block, loaded into 0
    assert run_step(sched) == [("probe", 1, True)]
    assert tier.loads == [0] and cost.tokens_per_load() == pytest.approx(10.0) and cost.num_charged_tokens == 10
    assert probe.status == SequenceStatus.FINISHED_LENGTH

    again = add_seq(sched, "again", HISTORY + [900, 901], max_tokens=2)
    # Step 1: block 0 is still cached (probe's); 3 more load into 2, 3, 4 (30 tokens of 32:
    # the prompt's 3 tokens do not fit in what is left), and it waits, holding its place.
    assert run_step(sched) == []
    assert tier.loads == [0, 2, 3, 4] and again.status == SequenceStatus.WAITING
    # Step 2: those stay cached; 3 more load.
    assert run_step(sched) == []
    assert tier.loads == [0, 2, 3, 4, 5, 6, 7] and cost.num_charged_tokens == 70
    # Step 3: the last 2 load (20 tokens), and the prompt starts with its 3 uncached tokens.
    assert run_step(sched) == [("again", 3, True)]
    assert tier.loads == [0, 2, 3, 4, 5, 6, 7, 8, 9] and cost.num_charged_tokens == 90
    # Its last block: 11, which the evictor freed before 10.
    assert again.block_ids == [0, 2, 3, 4, 5, 6, 7, 8, 9, 11] and again.num_cached_prompt_tokens == 36
    while sched.has_unfinished:
        run_step(sched)
    assert all_free(sched)


def test_reservations_between_steps_load_what_one_step_pays_for_and_the_next_step_pays() -> None:
    # A decode worker's reservations (LLMEngine.reserve_prefilled) load between steps, while
    # every decode waits: the loads since the last step stay within one step's budget (32
    # tokens: 3 blocks of 10), the blocks past them are left to arrive by transfer, and the
    # next step's prompts get the budget less what the loads took.
    sched, tier = history_on_the_tier()
    cost = sched.prefill_packer.load_cost
    add_seq(sched, "probe", HISTORY[:5], max_tokens=1)  # measures a load: 10 tokens
    run_step(sched)
    assert tier.loads == [0] and cost.tokens_per_load() == pytest.approx(10.0) and cost.num_owed_tokens == 0

    def reserve(rid: str) -> list[int]:
        return sched.reserved_prefix(Sequence(rid, HISTORY + [900], SamplingParams(max_tokens=1), 0))

    assert reserve("r1") == [0, 2, 3, 4]  # block 0 cached; 3 loaded, 30 tokens of 32
    assert tier.loads == [0, 2, 3, 4] and cost.num_owed_tokens == 30
    assert reserve("r2") == [0, 2, 3, 4]  # 2 tokens left pay for no load: the rest arrives
    assert tier.loads == [0, 2, 3, 4] and cost.num_owed_tokens == 30 and cost.num_charged_tokens == 40

    add_seq(sched, "prompt", 5, max_tokens=1)
    assert run_step(sched) == [("prompt", 2, False)]  # the step's prompts get 32 - 30 tokens
    assert cost.num_owed_tokens == 0
    assert reserve("r3") == [0, 2, 3, 4, 6, 7, 8]  # a step has passed: 3 more load
    assert run_step(sched) == [("prompt", 3, True)]
    while sched.has_unfinished:
        run_step(sched)
    assert all_free(sched)
