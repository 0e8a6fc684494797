"""Workloads ``tandem plan --slo`` replays at any rate: one fixed set of requests whose arrival
times are scaled, so that every probe of every configuration sees the same prompts in the
same order (common random numbers: two configurations differ by the configuration alone).

``chatbot`` is a ShareGPT-like length distribution of our own. No dataset is downloaded: it
approximates the shape DistServe's preprocessing of ShareGPT gives
(LLMServe/DistServe, evaluation/2-benchmark-serving/0-prepare-dataset.py: conversations of
at least 3 turns; the prompt is the first k turns joined, k uniform; the output is turn k+1,
so a user's short message about half the time and an assistant's long answer the other
half; prompt + output < 2048 tokens). The parameters below are chosen to look like that,
not fitted to the dataset:

    prompt  ~ lognormal(median 512, sigma 0.8), clipped to [8, 1900] tokens
    output  ~ 50% lognormal(median 48, sigma 0.9)   (a user turn)
              50% lognormal(median 256, sigma 0.7)  (an assistant turn), at least 4 tokens,
              cut so that prompt + output < 2048
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from tandem.sim.spec import SimRequest

DATASETS = ("chatbot",)
CHATBOT_MAX_TOTAL = 2048
"""DistServe's ShareGPT filter: prompt + output below this."""
_CHATBOT_SEED = 0x5A6E
"""First entry of the chatbot workload's seeds: a stream of its own."""


@dataclass(frozen=True)
class Workload:
    """Requests whose arrivals are at ``base_rate`` requests/s, replayable at any other rate."""

    name: str
    requests: tuple[SimRequest, ...]
    base_rate: float

    def at_rate(self, rate: float) -> list[SimRequest]:
        """The same requests, their arrival times scaled to a mean of ``rate`` requests/s."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        scale = self.base_rate / rate
        return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in self.requests]

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean([len(r.prompt_token_ids) for r in self.requests]))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean([r.output_len for r in self.requests]))

    def describe(self) -> str:
        """One line: the name, the count and the mean lengths."""
        return (f"{self.name}: {len(self.requests)} requests per probe, mean prompt {self.mean_prompt_len:.0f} "
                f"tokens, mean output {self.mean_output_len:.0f} tokens")


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size: int) -> np.ndarray:
    return rng.lognormal(math.log(median), sigma, size)


def chatbot_lengths(num: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of ``num`` chatbot requests (the module's distribution)."""
    rng = np.random.default_rng([_CHATBOT_SEED, seed])
    prompts = np.clip(np.rint(_lognormal(rng, 512, 0.8, num)), 8, 1900).astype(int)
    user = rng.random(num) < 0.5
    outputs = np.where(user, _lognormal(rng, 48, 0.9, num), _lognormal(rng, 256, 0.7, num))
    outputs = np.maximum(4, np.minimum(np.rint(outputs), CHATBOT_MAX_TOTAL - 1 - prompts)).astype(int)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def chatbot_workload(num: int, vocab_size: int, seed: int = 0, burstiness: float = 1.0) -> Workload:
    """``num`` chatbot requests (uniform random prompt tokens below ``vocab_size``: no two
    share a prefix) arriving at 1 request/s, gaps gamma(burstiness) as the bench draws them."""
    from tandem.bench.serving.load import arrival_offsets

    if num < 1:
        raise ValueError(f"the workload needs at least one request, got {num}")
    rng = np.random.default_rng([_CHATBOT_SEED, seed, 1])
    offsets = arrival_offsets(num, 1.0, burstiness, [_CHATBOT_SEED, seed, 2])
    requests = tuple(SimRequest(t, tuple(rng.integers(0, vocab_size, size=p).tolist()), o, kind="chat")
                     for (p, o), t in zip(chatbot_lengths(num, seed), offsets))
    return Workload("chatbot (ShareGPT-like, approximated)", requests, 1.0)


def trace_workload(path: str, num: int | None, vocab_size: int) -> Workload:
    """The first ``num`` requests of a Mooncake-format trace; its own mean rate is the base."""
    from tandem.sim.traces import read_mooncake_trace

    requests = read_mooncake_trace(path, vocab_size=vocab_size, limit=num)
    if len(requests) < 2:
        raise ValueError(f"{path} holds {len(requests)} request(s): a rate search needs at least 2")
    start = requests[0].arrival_s
    span = requests[-1].arrival_s - start
    if span <= 0:
        raise ValueError(f"{path}: its requests all arrive at once, so it has no rate to scale")
    shifted = tuple(dataclasses.replace(r, arrival_s=r.arrival_s - start) for r in requests)
    return Workload(f"trace {path}", shifted, len(requests) / span)


def bench_mix_workload(num: int, vocab_size: int, mix: object = None, seed: int = 0,
                       burstiness: float = 1.0) -> Workload:
    """``tandem bench serve``'s seeded mix (traces.bench_mix_requests) at 1 request/s, prompt
    tokens drawn below ``vocab_size``."""
    from tandem.sim.traces import bench_mix_requests

    requests = bench_mix_requests(num, 1.0, burstiness, seed, mix, vocab_size=vocab_size)  # type: ignore[arg-type]
    return Workload("bench mix", tuple(requests), 1.0)
