"""The sequences of one request that runs several at once: n sampled completions, or the
beams of a beam search. The scheduler moves them forward; this keeps what they share."""

from __future__ import annotations

from typing import Callable

from tandem.decoding.beam_search import BeamSearch, Hypothesis
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sequence import Sequence, SequenceStatus


class SequenceGroup:
    """One request's sequences. The root computes the prompt; at its first sample the
    others fork from it, sharing its KV blocks (copy-on-write)."""

    def __init__(self, root: Sequence, forks: list[Sequence], beam: BeamSearch[Sequence, SequenceStatus] | None,
                 new_detokenizer: Callable[[], IncrementalDetokenizer | None]) -> None:
        """forks: completions 1 .. n-1 (parallel sampling), dormant until the root's first
        sample; beam: the search state (beam search; then forks is empty)."""
        self.root = root
        self.forks = forks
        self.completions: list[Sequence] = [root, *forks]
        """In index order; with beam search, the best hypotheses once the search is done."""
        self.beam = beam
        self.beams: list[tuple[Sequence, float]] = [(root, 0.0)]
        """Beam search: the live beams and their summed log-probabilities."""
        self.candidates: dict[int, list[tuple[int, float]]] = {}
        """Beam search: each live beam's (by id) top candidates, once it has sampled this step."""
        self.first_candidates: tuple[list[int], list[float]] | None = None
        """Beam search: the root's candidates after the prompt (what a prefill worker hands on)."""
        self.new_detokenizer = new_detokenizer
        self.num_open = root.params.n
        """Completions whose last delta has not gone out yet (the engine counts them down)."""
        for seq in self.completions:
            seq.group = self

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.completions)

    def take_forks(self) -> list[Sequence]:
        """The dormant completions, once: they fork from the root now."""
        forks, self.forks = self.forks, []
        return forks

    def may_step_beams(self) -> bool:
        """Every live beam has sampled this step."""
        return all(id(seq) in self.candidates for seq, _ in self.beams)

    def hypotheses(self, finished: list[Hypothesis[Sequence, SequenceStatus]]) -> list[Sequence]:
        """The n best finished beams as sequences holding no blocks (index = rank)."""
        root = self.root
        results = []
        for index, h in enumerate(finished[:root.params.n]):
            c = h.continuation
            seq = Sequence(root.request_id, root.prompt_token_ids, root.params, root.arrival_index,
                           self.new_detokenizer(), index)
            seq.take_progress(c.parent)
            seq.token_ids.append(c.token_id)
            seq.output_logprobs.append(c.logprob)
            seq.status = c.end
            seq.group = self
            results.append(seq)
        self.completions = results
        return results
