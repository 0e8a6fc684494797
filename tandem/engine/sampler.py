"""Turns a batch of next-token logits into one chosen token per sequence.

Greedy rows take the argmax. Random rows are tempered, filtered (min_p, top_k, top_p, in
vLLM v1's order) and sampled with the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``,
which draws from ``probs`` exactly. Each row draws its own ``q`` from its own generator, so a
seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.engine import step_inputs
from tandem.logprobs import TopLogprobs
from tandem.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler chose for each row of the batch."""

    token_ids: list[int]
    """One chosen token per row."""
    logprobs: list[float]
    """Log-probability of each chosen token under ``log_softmax(raw logits)`` in float32: the
    model's own distribution, before temperature and filtering (as vLLM v1 reports it)."""
    top_logprobs: list[TopLogprobs] | None = None
    """When a row asks for them (SamplingParams.logprobs >= 1): per row, its N most likely
    tokens under the same distribution (empty for rows that ask for none); else None."""


@dataclass(frozen=True)
class StepOutput:
    """What one step drew for each sample target, in batch order: one token, or with
    speculation the accepted draft tokens and then one token of the target's own, or with
    beam search the top candidates (best first, with their log-probabilities)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    """Per token, as in :class:`SamplerOutput`."""
    top_logprobs: list[list[TopLogprobs]] | None = None
    """Per target, one entry per token, when a target asks for them (a target that does
    never has drafts); else None."""

    def target(self, i: int) -> TargetSample:
        return TargetSample(self.token_ids[i], self.logprobs[i], self.top_logprobs[i] if self.top_logprobs else [])


class TargetSample(NamedTuple):
    """What one sample target drew in one step (see StepOutput)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]
    """One entry per token when the target asks for top log-probabilities, else empty."""


class Sampler:
    """Stateless: all randomness comes from the per-row generators passed to ``sample``."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Choose one token per row.

        Args:
            logits: ``[num_seqs, vocab_size]``, any float dtype (computed in float32).
            params: one ``SamplingParams`` per row.
            generators: one generator per row (a request's own, on the host; see
                exponential_race); ``None`` uses torch's default generator on ``logits``'
                device (then the row is not reproducible on its own).
            raw_logits: ``logits`` before penalties and biases (logits_processors.py): the
                reported log-probabilities are the model's own (default: ``logits``).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_seqs, vocab_size], got shape {tuple(logits.shape)}")
        num_seqs, vocab_size = logits.shape
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"need one SamplingParams and one generator per row: {num_seqs} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        if num_seqs == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        chosen, logprobs = self.sample_on_device(logits, params, generators, raw_logits)
        # NOTE: the step's one read of device values, after its forward (two with top log-probabilities).
        out = SamplerOutput(token_ids=chosen.tolist(), logprobs=logprobs.tolist())
        num_top = max(p.top_logprobs for p in params)
        if num_top == 0:
            return out
        values, indices = top_logprobs(logits if raw_logits is None else raw_logits, num_top)
        rows = zip(indices.tolist(), values.tolist())
        return SamplerOutput(out.token_ids, out.logprobs,
                             [TopLogprobs(ids[:p.top_logprobs], lps[:p.top_logprobs]) for p, (ids, lps) in zip(params, rows)])

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """sample's work, left on ``logits``' device: -> (chosen [num_seqs] int64, their
        logprobs [num_seqs] float32, under raw_logits when given)."""
        num_seqs = logits.shape[0]
        logits = logits.float()  # logits: [num_seqs, vocab_size]
        device = logits.device

        chosen = torch.empty(num_seqs, dtype=torch.long, device=device)  # chosen: [num_seqs]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        # Both row lists cross to the device in one transfer.
        rows = step_inputs.to_device(torch.tensor(greedy_rows + random_rows, dtype=torch.long), device)
        if greedy_rows:
            idx = rows[:len(greedy_rows)]
            chosen[idx] = torch.argmax(logits[idx], dim=-1)
        if random_rows:
            idx = rows[len(greedy_rows):]
            probs = filtered_probs(logits[idx], [params[i] for i in random_rows])
            chosen[idx] = exponential_race(probs, [generators[i] for i in random_rows])

        # logprob = logit - logsumexp(logits): avoids materialising a full log_softmax.
        raw = logits if raw_logits is None else raw_logits.float()
        chosen_logits = raw.gather(1, chosen.unsqueeze(1)).squeeze(1)  # [num_seqs]
        logprobs = chosen_logits - torch.logsumexp(raw, dim=-1)  # [num_seqs]
        return chosen, logprobs


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row under ``log_softmax(logits)`` in float32, most
    likely first: -> (logprobs [rows, k], token ids [rows, k])."""
    # logits: [rows, vocab_size]
    logits = logits.float()
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)  # the log_softmax's order is the logits'
    return top.values - torch.logsumexp(logits, dim=-1, keepdim=True), top.indices


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Tempered, filtered and renormalised probabilities of non-greedy rows.

    Order (vLLM v1's): min_p, then top_k, then top_p over what top_k kept. min_p compares
    with the top token, which every filter keeps, so its place before top_k changes nothing.
    """
    # logits: [rows, vocab_size] float32
    rows, vocab_size = logits.shape
    # top_k <= 0 or >= vocab_size keeps everything: express both as k = vocab_size.
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    min_p, top_p = [p.min_p for p in params], [p.top_p for p in params]
    # Every row's parameters cross to the device in one transfer (top_k as float32: exact below 2**24).
    host = torch.tensor([[p.temperature for p in params], min_p, top_p, top_k], dtype=torch.float32)
    temperature_t, min_p_t, top_p_t, top_k_t = step_inputs.to_device(host, logits.device)  # each: [rows]
    logits = logits / temperature_t.unsqueeze(1)  # [rows, vocab_size]

    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)  # [rows, vocab_size]
        threshold = probs.amax(dim=-1, keepdim=True) * min_p_t.unsqueeze(1)  # [rows, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    if any(k < vocab_size for k in top_k) or any(tp < 1.0 for tp in top_p):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [rows, vocab_size]
        # Keep every token at least as likely as the k-th (ties at the boundary stay in).
        kth = sorted_logits.gather(1, (top_k_t.long() - 1).unsqueeze(1))  # [rows, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [rows, vocab_size]
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Mass strictly before each position: a token is kept while the tokens above it sum
        # to less than top_p, which always keeps the top token (top_p > 0).
        mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p_t.unsqueeze(1), float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

    return torch.softmax(logits, dim=-1)  # [rows, vocab_size]


def exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / q)`` with ``q ~ Exp(1)`` is a draw from ``probs``."""
    # probs: [rows, vocab_size]
    rows, vocab_size = probs.shape
    q = torch.empty_like(probs)  # [rows, vocab_size]
    shared = [i for i, g in enumerate(generators) if g is None]
    for i, gen in enumerate(generators):
        if gen is None:
            continue
        # One row, one generator: its draws do not depend on the rest of the batch.
        if gen.device == probs.device:
            q[i].exponential_(generator=gen)
        else:  # a request's generator stays on the host (its state travels between workers as bytes)
            q[i].copy_(torch.empty(vocab_size, device=gen.device).exponential_(generator=gen), non_blocking=True)
    if len(shared) == rows:  # (the usual case: one call, no row list to send)
        q.exponential_()
    elif shared:
        # Rows on the default generator are not reproducible anyway: draw them in one call.
        idx = step_inputs.to_device(torch.tensor(shared, dtype=torch.long), probs.device)
        q[idx] = torch.empty(len(shared), vocab_size, device=probs.device).exponential_()
    # exponential_ may return exactly 0; clamp so a kept token never divides 0 by 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return torch.argmax(probs / q, dim=-1)  # [rows]
