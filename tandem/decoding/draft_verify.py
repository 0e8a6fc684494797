"""Turns a step's logits into each entry's new tokens, verifying draft tokens on the way.

An entry with d drafts has 1 + d logits rows: row j is the target's distribution for the
token after draft j (row 0: after the sequence's last token). Greedy rows keep drafts
while they equal the argmax. Random rows use speculative rejection sampling with a
point-mass draft: accept draft x with probability p(x), else draw from p with x removed.
Either way a kept token is distributed exactly as the target alone would draw it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.decoding.beam_search import num_candidates
from tandem.engine.sampler import Sampler, StepOutput, exponential_race, filtered_probs
from tandem.logprobs import TopLogprobs
from tandem.sampling_params import SamplingParams


def sample_step(
    sampler: Sampler,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    draft_token_ids: Sequence[list[int]],
    num_eos_tokens: int = 1,
    raw_logits: torch.Tensor | None = None,
) -> StepOutput:
    """One entry per sample target, in batch order. A beam search entry gets its top
    candidates by log-probability instead of a token (see beam_search.num_candidates).

    logits: ``[sum(1 + len(drafts)), vocab_size]``, each entry's rows in a run.
    raw_logits: the same before logits processing (logits_processors.py), which the reported
    log-probabilities come from (default: ``logits``).
    """
    beams = [i for i, p in enumerate(params) if p.use_beam_search]
    plain = [i for i, drafts in enumerate(draft_token_ids) if not drafts and not params[i].use_beam_search]
    row_starts: list[int] = []
    num_rows = 0
    for drafts in draft_token_ids:
        row_starts.append(num_rows)
        num_rows += 1 + len(drafts)
    token_ids: list[list[int]] = [[] for _ in draft_token_ids]
    logprobs: list[list[float]] = [[] for _ in draft_token_ids]
    # Entries without drafts share one sampler call, as without speculation.
    rows = torch.tensor([row_starts[i] for i in plain], dtype=torch.long, device=logits.device)
    sampled = sampler.sample(logits[rows], [params[i] for i in plain], [generators[i] for i in plain],
                             raw_logits=None if raw_logits is None else raw_logits[rows])
    for i, t, lp in zip(plain, sampled.token_ids, sampled.logprobs):
        token_ids[i], logprobs[i] = [t], [lp]
    top_logprobs: list[list[TopLogprobs]] | None = None
    if sampled.top_logprobs is not None:  # (only plain entries ask: no drafts, no beams)
        top_logprobs = [[] for _ in draft_token_ids]
        for i, top in zip(plain, sampled.top_logprobs):
            top_logprobs[i] = [top]
    for i in beams:
        k = min(num_candidates(params[i].beam_width, num_eos_tokens), logits.shape[-1])
        top = torch.log_softmax(logits[row_starts[i]].float(), dim=-1).topk(k)
        token_ids[i], logprobs[i] = top.indices.tolist(), top.values.tolist()
    for i, drafts in enumerate(draft_token_ids):
        if drafts:
            entry_logits = logits[row_starts[i]:row_starts[i] + 1 + len(drafts)]
            token_ids[i], logprobs[i] = verify_drafts(entry_logits, drafts, params[i], generators[i])
    return StepOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)


def verify_drafts(
    logits: torch.Tensor,
    draft_token_ids: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], list[float]]:
    """-> (tokens, logprobs): the accepted drafts, then one token drawn by the target.

    logits: ``[1 + len(draft_token_ids), vocab_size]``. Random draws come from
    ``generator`` in a fixed order (one uniform per judged draft, then one token), so a
    seeded request gets the same tokens for the same drafts.
    """
    logits = logits.float()  # [1 + d, vocab_size]
    num_drafts = len(draft_token_ids)
    if params.is_greedy:
        target = torch.argmax(logits, dim=-1).tolist()
        num_accepted = 0
        while num_accepted < num_drafts and draft_token_ids[num_accepted] == target[num_accepted]:
            num_accepted += 1
        token_ids = target[:num_accepted + 1]
    else:
        probs = filtered_probs(logits, [params] * (1 + num_drafts))  # [1 + d, vocab_size]
        token_ids = []
        for j, draft in enumerate(draft_token_ids):
            u = torch.rand((), generator=generator)  # on the generator's device (the host)
            if u < probs[j, draft]:
                token_ids.append(draft)
                continue
            # NOTE: rejection implies p(draft) < 1, so the residual has mass left.
            residual = probs[j].clone()
            residual[draft] = 0.0
            token_ids.append(int(exponential_race((residual / residual.sum()).unsqueeze(0), [generator])[0]))
            break
        else:  # every draft accepted: the last row gives a bonus token
            token_ids.append(int(exponential_race(probs[num_drafts].unsqueeze(0), [generator])[0]))
    rows = torch.arange(len(token_ids), device=logits.device)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    # As the sampler reports them: under the raw logits, before temperature and filtering.
    logprobs = logits[rows, chosen] - torch.logsumexp(logits[:len(token_ids)], dim=-1)
    return token_ids, logprobs.tolist()
