"""Moves beam searches forward inside a scheduler: gathers each live beam's candidates and,
once every beam of a request has them, forks the chosen continuations onto their parents'
blocks (copy-on-write) and retires the parents."""

from __future__ import annotations

import time
from typing import Protocol

from tandem.engine.sequence import Sequence, SequenceStatus, SequenceUpdate


class BeamHost(Protocol):
    """What a beam search needs of the scheduler that runs its beams (the Scheduler is one)."""

    def end_of(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """Why appending ``token_id`` to ``seq`` ends it, or None."""
        ...

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` from where ``parent`` is, on its blocks (copy-on-write)."""
        ...

    def retire(self, seq: Sequence) -> None:
        """Drop a running beam that no continuation extends."""
        ...


class BeamStepper:
    """The beam searches of one scheduler (``host``): it forks and retires their beams."""

    def __init__(self, host: BeamHost) -> None:
        self.host = host

    def advance(self, seq: Sequence, candidates: tuple[list[int], list[float]]) -> list[SequenceUpdate]:
        """``seq``, a live beam computed up to its last token, sampled its top candidates
        (token ids and their log-probabilities). -> the request's completions, once the
        search is done; nothing before."""
        group = seq.group
        assert group is not None and group.beam is not None
        if seq is group.root and group.first_candidates is None:  # the prompt's: time to first token ends here
            seq.first_token_time = time.monotonic()
            group.first_candidates = candidates
        group.candidates[id(seq)] = list(zip(*candidates))
        if not group.may_step_beams():
            return []  # the others have yet to sample (a smaller budget, or a preemption)
        step = group.beam.step(group.beams, [group.candidates[id(b)] for b, _ in group.beams], self.host.end_of)
        group.candidates.clear()
        root = group.root
        beams: list[tuple[Sequence, float]] = []
        for c in [] if step.done else step.running:
            child = Sequence(root.request_id, root.prompt_token_ids, root.params, root.arrival_index)
            child.group = group
            self.host.fork(c.parent, child)
            child.token_ids.append(c.token_id)
            child.output_logprobs.append(c.logprob)
            beams.append((child, c.score))
        for parent, _ in group.beams:  # after the forks: the children hold their blocks now
            self.host.retire(parent)
        group.beams = beams
        if not step.done:
            return []
        updates = []
        for hyp in group.hypotheses(group.beam.finished):
            text = ""
            if hyp.detokenizer is not None:
                text = "".join(hyp.detokenizer.append(t).text for t in hyp.output_token_ids) + hyp.detokenizer.flush()
            updates.append(SequenceUpdate(hyp, hyp.output_token_ids, text, hyp.output_logprobs))  # (no top logprobs)
        return updates
