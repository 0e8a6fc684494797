"""verify_drafts: greedy acceptance, and speculative rejection sampling keeping the
target's distribution exactly (a statistical test on a fixed set of seeds)."""

from __future__ import annotations

import torch

from tandem.decoding.draft_verify import verify_drafts
from tandem.engine.device_random import draw_generator
from tandem.engine.sampler import Sampler
from tandem.sampling_params import SamplingParams

VOCAB = 6
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
NUM_TRIALS = 2000
CHI2_DF5_P001 = 20.52
"""Chi-square critical value, 5 degrees of freedom, p = 0.001."""


def _logits(num_rows: int) -> torch.Tensor:
    return PROBS.log().expand(num_rows, VOCAB).clone()


def test_greedy_keeps_drafts_up_to_the_first_mismatch():
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([2, 3, 1, 5]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0)
    assert verify_drafts(logits, [2, 3, 1], params, None)[0] == [2, 3, 1, 5]  # all kept, then the bonus
    assert verify_drafts(logits, [2, 4, 1], params, None)[0] == [2, 3]  # second rejected: target's token
    tokens, logprobs = verify_drafts(logits, [0, 3, 1], params, None)
    assert tokens == [2] and len(logprobs) == 1 and logprobs[0] < 0


def _first_token_counts(draft: int, params: SamplingParams) -> torch.Tensor:
    counts = torch.zeros(VOCAB)
    for seed in range(NUM_TRIALS):
        tokens, _ = verify_drafts(_logits(2), [draft], params, torch.Generator().manual_seed(seed))
        counts[tokens[0]] += 1
    return counts


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token the target never draws"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """Whatever the draft (likely, unlikely), the first kept token is distributed as p."""
    for draft in (0, 3):
        counts = _first_token_counts(draft, SamplingParams(temperature=1.0))
        assert _chi2(counts, PROBS) < CHI2_DF5_P001, (draft, counts)


def test_rejection_sampling_uses_the_filtered_distribution():
    """top_k=3: a draft outside the top 3 is never kept, and the rest follows the filtered p."""
    filtered = torch.cat([PROBS[:3] / PROBS[:3].sum(), torch.zeros(3)])
    counts = _first_token_counts(4, SamplingParams(temperature=1.0, top_k=3))
    assert counts[3:].sum() == 0
    assert _chi2(counts, filtered) < CHI2_DF5_P001, counts


def test_seeded_verification_is_reproducible():
    params = SamplingParams(temperature=0.9, seed=5)
    runs = [verify_drafts(_logits(4), [0, 1, 2], params, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_seeded_request_draws_the_same_tokens_whatever_was_drafted():
    """Row j of a seeded entry draws as the sampler alone would at position p + j, so the kept
    tokens are the undrafted run's: drafts change how many come per step, never which."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 2  # [1 + 4 drafts, vocab]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    undrafted = [Sampler().sample(logits[j:j + 1], [params], [draw_generator(7, 100 + j)]).token_ids[0]
                 for j in range(5)]
    for num_kept in range(5):  # drafts that match the first num_kept tokens, then a wrong one
        drafts = undrafted[:num_kept] + [(undrafted[num_kept] + 1) % 50] * (4 - num_kept)
        tokens, _ = verify_drafts(logits, drafts[:4], params, draw_generator(7, 100))
        assert tokens == undrafted[:len(tokens)] and len(tokens) == num_kept + 1, (num_kept, tokens, undrafted)
