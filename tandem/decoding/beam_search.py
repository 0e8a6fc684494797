"""Beam search's choices, step by step, as transformers makes them (``early_stopping=False``).

Pure bookkeeping over opaque beams: the scheduler forks and frees the sequences (and their
KV blocks) that these choices name. Each step every live beam proposes its top candidates;
of all of them the best ``num_candidates`` by summed log-probability are ranked; those that
end (EOS, a stop token, the length) and rank within the first ``beam_width`` become finished
hypotheses scored ``sum_logprob / generated_len ** length_penalty``; the best ``beam_width``
that do not end run on. The search stops when no running beam can beat the worst of
``beam_width`` finished hypotheses (transformers' heuristic: at the current length), when
every candidate ends, or when no beam is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

B = TypeVar("B")
E = TypeVar("E")


def num_candidates(beam_width: int, num_eos_tokens: int) -> int:
    """Candidates ranked per step (transformers' ``beams_to_keep``): enough that
    ``beam_width`` of them remain after every end token has taken one per beam."""
    return max(2, 1 + num_eos_tokens) * beam_width


@dataclass(frozen=True)
class Continuation(Generic[B, E]):
    """A beam extended by one token."""

    parent: B
    token_id: int
    logprob: float
    """The token's log-probability after ``parent``."""
    score: float
    """The parent's summed log-probability plus ``logprob``."""
    end: E | None = None
    """Why the continuation ends the beam (None: it runs on)."""


@dataclass(frozen=True)
class Hypothesis(Generic[B, E]):
    """A finished beam: its last continuation and its length-penalised score."""

    continuation: Continuation[B, E]
    score: float


@dataclass(frozen=True)
class BeamStep(Generic[B, E]):
    running: list[Continuation[B, E]]
    """The beams of the next step, best first (at most beam_width)."""
    done: bool
    """No step follows: the best hypotheses are ``BeamSearch.finished``."""


class BeamSearch(Generic[B, E]):
    """One request's search state: the live beams' scores and the best finished hypotheses."""

    def __init__(self, beam_width: int, length_penalty: float, num_candidates: int) -> None:
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.num_candidates = num_candidates
        self.num_generated = 0
        """Tokens each live beam has generated."""
        self.finished: list[Hypothesis[B, E]] = []
        """The best finished hypotheses, best first (at most beam_width)."""
        self.improvable = True
        """Whether a running beam may still beat the finished ones (once False, stays so)."""

    def step(self, beams: list[tuple[B, float]], candidates: list[list[tuple[int, float]]],
             end_of: Callable[[B, int], E | None]) -> BeamStep[B, E]:
        """Rank one step's continuations.

        Args:
            beams: each live beam and its summed log-probability.
            candidates: per beam, its top (token id, log-probability) pairs, at least
                ``num_candidates`` of them (or the whole vocabulary).
            end_of: why appending a token to a beam ends it, or None.
        """
        ranked = sorted(((score + lp, b, t, lp) for b, ((_, score), cands) in enumerate(zip(beams, candidates))
                         for t, lp in cands), key=lambda c: -c[0])[:self.num_candidates]
        continuations = [Continuation(beams[b][0], t, lp, total, end_of(beams[b][0], t)) for total, b, t, lp in ranked]
        running = [c for c in continuations if c.end is None][:self.beam_width]
        if self.improvable:
            length = (self.num_generated + 1) ** self.length_penalty
            new = [Hypothesis(c, c.score / length) for c in continuations[:self.beam_width] if c.end is not None]
            # Stable: an earlier hypothesis wins a tie, as transformers' merge keeps it first.
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:self.beam_width]
        self.num_generated += 1
        if len(self.finished) == self.beam_width and running:
            best_possible = running[0].score / self.num_generated ** self.length_penalty
            self.improvable = best_possible > self.finished[-1].score
        done = not self.improvable or not running
        return BeamStep(running, done)
