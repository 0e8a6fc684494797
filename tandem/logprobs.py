"""Top log-probabilities at one output position: a plain value that crosses from the worker
that sampled the token to the router and on to the client."""

from __future__ import annotations

from typing import NamedTuple


class TopLogprobs(NamedTuple):
    """The N most likely tokens at one position (SamplingParams.logprobs = N), most likely
    first, under the model's own distribution (before penalties, temperature and filters)."""

    token_ids: list[int]
    logprobs: list[float]
