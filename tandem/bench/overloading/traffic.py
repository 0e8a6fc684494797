"""The calls ``tandem bench overload`` sends in each phase: short greedy requests with prompts
and arrival times of the phase's own, in a closed loop or at Poisson arrivals."""

from __future__ import annotations

import math

import numpy as np

from tandem.bench.serving.load import (
    Mix,
    Request,
    RequestResult,
    arrival_offsets,
    make_requests,
    run_load,
    with_fresh_tokens,
)

PHASES = ("warm-up", "sustain", "before", "overload", "after")
"""Each phase draws its prompts and arrivals from a seed of its own ([--seed, phase index, ...]):
a prompt seen in an earlier phase would hit the prefill worker's prefix cache."""


class Load:
    """Short greedy calls to the router, each phase with prompts and arrivals of its own."""

    def __init__(self, target: str, pool: np.ndarray, mix: Mix, seed: int, timeout: float) -> None:
        """pool: the token ids a prompt may hold; timeout: each call's deadline (s)."""
        self.target, self.pool, self.mix, self.seed, self.timeout = target, pool, mix, seed, timeout

    def _requests(self, phase: str, num: int) -> list[Request]:
        return make_requests(num, self.pool, self.mix, [self.seed, PHASES.index(phase), 0])

    async def closed(self, phase: str, num: int, concurrency: int) -> tuple[list[RequestResult], float]:
        """``num`` calls, ``concurrency`` of them in flight until the last ones
        -> (results, seconds from the first send to the last end)."""
        return await run_load(self.target, self._requests(phase, num), [0.0] * num, tag=phase, desc=phase,
                              timeout=self.timeout, max_concurrency=concurrency, progress=False)

    async def poisson(self, phase: str, rate: float, *, num: int | None = None, duration_s: float | None = None,
                      like: str | None = None) -> list[RequestResult]:
        """Poisson arrivals at ``rate``: ``num`` calls, or every arrival within ``duration_s``.
        like: an earlier phase whose arrival times and lengths to repeat, with prompt tokens
        of this phase's own (common random numbers: the two compare like with like)."""
        shape = like or phase
        seed = [self.seed, PHASES.index(shape), 1]
        if num is not None:
            offsets = arrival_offsets(num, rate, 1.0, seed)
        else:
            assert duration_s is not None, "poisson() takes num or duration_s"
            # More arrivals than the window holds (6 sigma above the mean count), cut at its end.
            drawn = math.ceil(rate * duration_s + 6 * math.sqrt(rate * duration_s) + 10)
            offsets = [t for t in arrival_offsets(drawn, rate, 1.0, seed) if t < duration_s]
        requests = self._requests(shape, len(offsets))
        if like is not None:
            requests = with_fresh_tokens(requests, self.pool, [self.seed, PHASES.index(phase), 0])
        results, _ = await run_load(self.target, requests, offsets, tag=phase, desc=phase, timeout=self.timeout,
                                    progress=False)
        return results
