"""What the scheduler hands the model runner for one step: which sequences run, how many
tokens each, and the KV block copies to make first (swaps, copy-on-write)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``seqs[i]``, from its first
    uncomputed token on, then its ``draft_token_ids[i]`` (a speculative decode: the drafts
    count in ``num_new_tokens[i]``). Single-token entries (decodes) come first.

    Before the step's forward, the runner copies ``swap_out``, then ``copies``, then
    ``swap_in``: the device blocks a swapped-out sequence gave up may be written by this
    very step (see ModelRunner.swap).
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block id, host block id) pairs to copy device -> host."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block id, device block id) pairs to copy host -> device."""
    draft_token_ids: list[list[int]] = field(default_factory=list)
    """Per entry (or empty: no entry has drafts)."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) device block pairs to copy first: shared blocks an entry
    writes (copy-on-write)."""

    def num_drafts(self, i: int) -> int:
        return len(self.draft_token_ids[i]) if self.draft_token_ids else 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        """No sequence runs (there may still be blocks to swap)."""
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether entry i reaches the end of its tokens, so a new token is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - self.num_drafts(i) == seq.num_tokens

    def sample_targets(self, i: int) -> list[Sequence]:
        """The sequences that sample from entry i's logits: none (a prefill chunk), the
        entry's own, or also its dormant forks (a root's first sample, n > 1)."""
        if not self.samples(i):
            return []
        seq = self.seqs[i]
        return [seq, *seq.group.forks] if seq.group is not None and seq is seq.group.root else [seq]
