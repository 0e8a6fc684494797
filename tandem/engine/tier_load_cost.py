"""What loading prefix blocks from a KV tier costs a step, in tokens of its budget.

Tier loads run inside admission, on the step's path (prefix_tier.py): a step that loads a
long history and also runs a full budget of prompt tokens takes longer than its budget
means, and every decode in it waits. So the prefill packer charges each load its cost in
budget tokens (the measured seconds a block takes to load over the measured seconds a
step spends per token) and loads no more blocks in a step than its budget pays for; a
prompt whose prefix is not all loaded waits, holding its place, and loads the rest next
step. Until both rates are measured (no load yet, or steps all of one size) loads are free
and unlimited.

A decode worker's reservations load their prefix between steps (LLMEngine.reserve_prefilled),
where every running decode waits for them: the loads since the last step take no more than
one step's budget pays for, the blocks past them arrive with the rest of the prompt's KV,
and the next step's prompts have the budget they took less.
"""

from __future__ import annotations

import math

from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.prefix_tier import tiers_of


class StepTimeFit:
    """A step's seconds as ``fixed + per_token * num_tokens``, fitted by least squares over
    recent steps (each step weighs ``DECAY`` times the one after it). The slope, not the
    mean, is what a token costs: a step's fixed part (reading the weights) is paid whatever
    its size."""

    DECAY = 0.98

    def __init__(self) -> None:
        # Decayed sums of 1, x, y, x*x and x*y (x: tokens, y: seconds).
        self._sums = [0.0] * 5

    def add(self, num_tokens: int, seconds: float) -> None:
        x, y = float(num_tokens), seconds
        self._sums = [s * self.DECAY + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y))]

    @property
    def seconds_per_token(self) -> float | None:
        """The slope, or None while the steps fitted do not tell it (all one size, or a
        slope that is not positive)."""
        n, sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        if n < 2 or spread <= 1e-6 * n * n:
            return None
        slope = (n * sxy - sx * sy) / spread
        return slope if slope > 0 else None


class TierLoadCost:
    """The budget tokens a block loaded from ``block_manager``'s tiers costs a step."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.step_fit = StepTimeFit()
        self.num_charged_tokens = 0
        """Budget tokens charged for loads since the engine started."""
        self.num_owed_tokens = 0
        """Budget tokens charged for loads between steps since the last step was scheduled."""

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` ran in ``seconds`` (the model's part, not admission's)."""
        self.step_fit.add(num_tokens, seconds)

    def tokens_per_load(self) -> float | None:
        """One block's load in budget tokens, or None while it cannot be told."""
        tiers = tiers_of(self.block_manager.tier)
        num_loaded = sum(t.counters.num_loaded_blocks for t in tiers)
        per_token = self.step_fit.seconds_per_token
        if num_loaded == 0 or per_token is None:
            return None
        return sum(t.counters.load_seconds for t in tiers) / num_loaded / per_token

    def max_loads(self, budget: int) -> int | None:
        """The blocks a step with ``budget`` tokens left may load (at least one, so a long
        prefix always moves on; None: no limit)."""
        cost = self.tokens_per_load()
        return None if cost is None else max(1, int(max(budget, 0) / cost))

    def charge(self, num_loaded: int) -> int:
        """The budget tokens that ``num_loaded`` blocks just loaded cost."""
        cost = self.tokens_per_load() if num_loaded else None
        tokens = 0 if cost is None else math.ceil(num_loaded * cost)
        self.num_charged_tokens += tokens
        return tokens

    def max_loads_between_steps(self, budget: int) -> int | None:
        """The blocks a reservation may load now: what a step's ``budget`` pays for, less the
        loads since the last step (None: no limit; 0 is fine, the rest arrives by transfer)."""
        cost = self.tokens_per_load()
        return None if cost is None else int(max(budget - self.num_owed_tokens, 0) / cost)

    def owe(self, num_loaded: int) -> None:
        """``num_loaded`` blocks were loaded between steps: the next step pays for them."""
        self.num_owed_tokens += self.charge(num_loaded)

    def take_owed(self) -> int:
        """The budget tokens the loads between steps took, once (for the step scheduled now)."""
        owed, self.num_owed_tokens = self.num_owed_tokens, 0
        return owed
