"""Turns a step's logits into each entry's new tokens, verifying draft tokens on the way.

An entry with d drafts has 1 + d logits rows: row j is the target's distribution for the
token after draft j (row 0: after the sequence's last token). Greedy rows keep drafts
while they equal the argmax. A random row draws its token as the sampler would at that
position (the exponential race, keyed by the row's generator: a seeded request's key is a
function of its seed and the position), and keeps the draft while the two are equal. That is
speculative rejection sampling with a point-mass draft (the draft is kept with probability
p(x); past a rejection the token is p's draw, which is not x), and more: a seeded request
gets the same tokens whatever was drafted, so its output does not depend on the batch, the
pool's room for drafts or the worker that decodes it.

Everything is worked out on the logits' device (acceptance of every draft at once: a
cumulative product of accept flags) and read back in one transfer per step, with the plain
rows' tokens and the beams' candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.decoding.beam_search import num_candidates
from tandem.engine import step_inputs
from tandem.engine.device_random import generator_later
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
    drafted = [i for i, drafts in enumerate(draft_token_ids) if drafts]
    row_starts: list[int] = []
    num_rows = 0
    for drafts in draft_token_ids:
        row_starts.append(num_rows)
        num_rows += 1 + len(drafts)
    token_ids: list[list[int]] = [[] for _ in draft_token_ids]
    logprobs: list[list[float]] = [[] for _ in draft_token_ids]
    top_logprobs: list[list[TopLogprobs]] | None = None
    reads: list[torch.Tensor] = []  # device values the host reads back, together
    plain_on_device = False
    if plain:
        # Entries without drafts share one sampler call, as without speculation.
        plain_params, plain_generators = [params[i] for i in plain], [generators[i] for i in plain]
        plain_logits, plain_raw = logits, raw_logits
        if len(plain) < logits.shape[0]:  # (else every row is a plain entry's, in order: nothing to pick)
            rows = step_inputs.to_device(torch.tensor([row_starts[i] for i in plain], dtype=torch.long), logits.device)
            plain_logits, plain_raw = logits[rows], None if raw_logits is None else raw_logits[rows]
        if any(p.top_logprobs for p in plain_params):  # (only plain entries ask: no drafts, no beams)
            sampled = sampler.sample(plain_logits, plain_params, plain_generators, raw_logits=plain_raw)
            for i, t, lp in zip(plain, sampled.token_ids, sampled.logprobs):
                token_ids[i], logprobs[i] = [t], [lp]
            if sampled.top_logprobs is not None:
                top_logprobs = [[] for _ in draft_token_ids]
                for i, top in zip(plain, sampled.top_logprobs):
                    top_logprobs[i] = [top]
        else:
            reads += sampler.sample_on_device(plain_logits, plain_params, plain_generators, plain_raw)
            plain_on_device = True
    for i in beams:
        k = min(num_candidates(params[i].beam_width, num_eos_tokens), logits.shape[-1])
        best = torch.log_softmax(logits[row_starts[i]].float(), dim=-1).topk(k)  # each: [k]
        reads += [best.indices, best.values]
    if drafted:
        reads += verify_on_device(logits, [row_starts[i] for i in drafted], [draft_token_ids[i] for i in drafted],
                                  [params[i] for i in drafted], [generators[i] for i in drafted])
    values = iter(read_back(reads))
    if plain_on_device:
        chosen, chosen_logprobs = next(values), next(values)
        for i, chosen_t, chosen_lp in zip(plain, chosen, chosen_logprobs):
            token_ids[i], logprobs[i] = [int(chosen_t)], [chosen_lp]
    for i in beams:
        token_ids[i], logprobs[i] = [int(t) for t in next(values)], next(values)
    if drafted:
        tokens, token_logprobs, num_accepted = next(values), next(values), next(values)
        offset = 0
        for i, n in zip(drafted, num_accepted):
            kept = slice(offset, offset + int(n) + 1)
            token_ids[i], logprobs[i] = [int(t) for t in tokens[kept]], token_logprobs[kept]
            offset += 1 + len(draft_token_ids[i])
    return StepOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)


def read_back(tensors: list[torch.Tensor]) -> list[list[float]]:
    """The values of ``tensors`` (any shapes, on one device) on the host, each flattened,
    from one transfer. NOTE: float64 holds int64 token ids exactly (below 2**53)."""
    if not tensors:
        return []
    packed = torch.cat([t.reshape(-1).double() for t in tensors])  # [sum of numels]
    flat = step_inputs.to_host(packed).tolist()
    out: list[list[float]] = []
    offset = 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()])
        offset += t.numel()
    return out


def verify_on_device(
    logits: torch.Tensor,
    row_starts: list[int],
    draft_token_ids: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[torch.Tensor]:
    """Judge every entry's drafts on ``logits``' device, reading nothing back.

    -> [tokens, logprobs, num_accepted]: tokens ``[sum(1 + d)]`` int64, per entry its drafts
    up to the first rejected one, there the target's own token, then leftovers (the host keeps
    ``num_accepted + 1`` of them); their logprobs ``[sum(1 + d)]`` float32; num_accepted ``[E]``.
    generators: each entry's for its first row; row j draws with generator_later(g, j).
    """
    sizes = [len(d) for d in draft_token_ids]
    row_at = [sum(1 + d for d in sizes[:e]) for e in range(len(sizes))]
    random = [e for e, p in enumerate(params) if not p.is_greedy]
    random_rows = [r for e in random for r in range(row_at[e], row_at[e] + 1 + sizes[e])]
    # The drafts and the random rows' indices cross in one transfer.
    host = torch.tensor([t for d in draft_token_ids for t in d] + random_rows, dtype=torch.long)
    inputs = step_inputs.to_device(host, logits.device)
    drafts_t, on_device = inputs[:sum(sizes)], inputs[sum(sizes):]  # [D], [len(random_rows)]
    rows = torch.cat([logits[s:s + 1 + d] for s, d in zip(row_starts, sizes)]).float()  # [R, vocab_size]
    chosen = torch.argmax(rows, dim=-1)  # [R]: greedy rows' tokens
    if random:  # one filtering and one race for every random entry's rows
        probs = filtered_probs(rows[on_device], [params[e] for e in random for _ in range(1 + sizes[e])])
        drawn = exponential_race(probs, [generator_later(generators[e], j) for e in random
                                         for j in range(1 + sizes[e])])
        chosen = chosen.index_copy(0, on_device, drawn)
    accepted = []
    for e, d in enumerate(sizes):
        target = chosen[row_at[e]:row_at[e] + d]  # [d]: each row's own token
        accepted.append(torch.cumprod((drafts_t[row_at[e] - e:row_at[e] - e + d] == target).long(), 0).sum())
    # As the sampler reports them (draft rows are never processed: raw and processed are one).
    token_logprobs = rows.gather(1, chosen.unsqueeze(1)).squeeze(1) - torch.logsumexp(rows, dim=-1)  # [R]
    return [chosen, token_logprobs, torch.stack(accepted)]


def verify_drafts(
    logits: torch.Tensor,
    draft_token_ids: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], list[float]]:
    """-> (tokens, logprobs) of one entry: the accepted drafts, then one token drawn by the
    target. logits: ``[1 + len(draft_token_ids), vocab_size]`` (see verify_on_device)."""
    tokens, logprobs, num_accepted = read_back(verify_on_device(logits, [0], [draft_token_ids], [params], [generator]))
    kept = int(num_accepted[0]) + 1
    return [int(t) for t in tokens[:kept]], logprobs[:kept]
