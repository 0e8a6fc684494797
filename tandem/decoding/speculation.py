"""Speculative decoding policy: how many draft tokens each decode gets, and the books
after the target verified them (counters, and giving back the rejected drafts' blocks).

Mechanism lives elsewhere: the proposer finds drafts, spec_verify judges them, the
scheduler moves the sequence forward.
"""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.decoding.ngram_proposer import NgramProposer
from tandem.engine.sequence import Sequence
from tandem.kvcache.block_manager import BlockManager


class Speculator:
    """Draft tokens by prompt lookup for decoding sequences (none when
    ``num_speculative_tokens`` is 0)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        self.num_draft_tokens = 0
        """Draft tokens the target verified, since start."""
        self.num_accepted_tokens = 0
        """Of those, the ones it accepted."""

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens to run after ``seq``'s last token this step, within ``budget``
        tokens for the whole entry; none unless ``seq`` is a decode (and not a beam)."""
        # Processed logits depend on the tokens before them: a draft's row would need its own
        # (so would a grammar's mask); top log-probabilities are reported from plain rows only.
        params = seq.params
        if (self.num_speculative_tokens == 0 or seq.num_uncomputed_tokens != 1 or params.use_beam_search
                or params.processes_logits or params.top_logprobs or params.structured_outputs is not None):
            return []
        # A step adds at most 1 + drafts tokens: never past max_tokens or max_model_len.
        num_left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        num_drafts = min(self.num_speculative_tokens, budget - 1, num_left - 1)
        draft_token_ids = self.proposer.propose(seq.token_ids, num_drafts)
        # Drafts are a bet: they only take free blocks, never make the scheduler preempt.
        if draft_token_ids and not self.block_manager.can_allocate(seq, 1 + len(draft_token_ids)):
            return []
        return draft_token_ids

    def settle(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Count a verified entry; for a sequence still running, register its newly full
        blocks and give back the blocks only rejected drafts used.

        NOTE: ``seq.num_computed_tokens`` already counts only the kept tokens, so the prefix
        cache never registers a block holding a rejected draft's KV."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if seq.status.is_finished:
            return
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.truncate(seq, seq.num_tokens)
