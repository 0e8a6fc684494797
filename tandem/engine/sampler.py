"""Turns a batch of next-token logits into one chosen token per sequence.

Greedy rows take the argmax. Random rows are tempered, filtered (min_p, top_k, top_p, in
vLLM v1's order) and sampled with the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``,
which draws from ``probs`` exactly. Each row's ``q`` is made on the device from the row's own
key (device_random.py), so a seeded request gets the same tokens whatever else shares its
batch. The whole choice is dense over the batch: one transfer of the rows' parameters, no
per-row index list, and one read of the device at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.engine import step_inputs
from tandem.engine.device_random import UNSEEDED, device_keys, exponentials, row_keys
from tandem.kernels import layer_ops_cpu
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
            generators: one host generator per row (a seeded request's, from
                device_random.draw_generator): the row's key is its next draw; ``None`` draws
                the key from torch's default generator (then the row is not reproducible on its own).
            raw_logits: ``logits`` before penalties and biases (logits_processors.py): the
                reported log-probabilities are the model's own (default: ``logits``).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_seqs, vocab_size], got shape {tuple(logits.shape)}")
        num_seqs = logits.shape[0]
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"need one SamplingParams and one generator per row: {num_seqs} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        if num_seqs == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        chosen, logprobs = self.sample_on_device(logits, params, generators, raw_logits)
        num_top = max(p.top_logprobs for p in params)
        # One device tensor, float64 (exact for token ids and float32 log-probabilities):
        # [num_seqs, 2 + 2 * num_top] = chosen, its logprob, then the top ids and their logprobs.
        parts = [chosen.unsqueeze(1), logprobs.unsqueeze(1)]
        if num_top:
            values, indices = top_logprobs(logits if raw_logits is None else raw_logits, num_top)
            parts += [indices, values]
        # NOTE: the step's one read of device values, after its forward.
        host = step_inputs.to_host(torch.cat([p.to(torch.float64) for p in parts], dim=1)).tolist()
        token_ids, chosen_logprobs = [int(r[0]) for r in host], [r[1] for r in host]
        if num_top == 0:
            return SamplerOutput(token_ids=token_ids, logprobs=chosen_logprobs)
        top = [TopLogprobs([int(t) for t in r[2:2 + p.top_logprobs]], r[2 + num_top:2 + num_top + p.top_logprobs])
               for p, r in zip(params, host)]
        return SamplerOutput(token_ids, chosen_logprobs, top)

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """sample's work, left on ``logits``' device: -> (chosen [num_seqs] int64, their
        logprobs [num_seqs] float32, under raw_logits when given)."""
        logits = logits.float()  # logits: [num_seqs, vocab_size]
        raw = logits if raw_logits is None else raw_logits.float()
        greedy = [p.is_greedy for p in params]
        if all(greedy):  # (the usual case: nothing to send)
            kernels = layer_ops_cpu.kernels_for(logits, raw)
            if kernels is not None:  # one compiled pass each, where the lines below take six operations
                return kernels.greedy_pick(logits.contiguous(), raw.contiguous())
            chosen = torch.argmax(logits, dim=-1)  # [num_seqs]
        else:
            rows = row_params(params, generators, logits)
            sampled = exponential_race(filtered_probs(logits, params, rows), generators, rows)
            # Greedy rows (temperature 0) take the argmax: both are dense, one where picks.
            greedy_t = rows.temperature == 0  # [num_seqs]
            chosen = torch.where(greedy_t, torch.argmax(logits, dim=-1), sampled) if any(greedy) else sampled

        # logprob = logit - logsumexp(logits): avoids materialising a full log_softmax.
        chosen_logits = raw.gather(1, chosen.unsqueeze(1)).squeeze(1)  # [num_seqs]
        logprobs = chosen_logits - torch.logsumexp(raw, dim=-1)  # [num_seqs]
        return chosen, logprobs


class RowParams(NamedTuple):
    """The sampled rows' parameters on the device, each ``[rows]``."""

    temperature: torch.Tensor
    """float32; 0 for greedy rows."""
    min_p: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    """int64, in [1, vocab_size] (a disabled top_k is vocab_size)."""
    keys: torch.Tensor
    """int64, each row's key (device_random.py); 0 for greedy rows, which draw nothing."""


def row_params(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None,
               logits: torch.Tensor) -> RowParams:
    """Every row's parameters and key on ``logits``' device, in one transfer (float64 holds
    each exactly: the float parameters, top_k, keys below 2**53). generators None: no keys."""
    vocab_size = logits.shape[1]
    keys = [0] * len(params)
    any_unseeded = False
    if generators is not None:  # greedy rows draw nothing
        random = [i for i, p in enumerate(params) if not p.is_greedy]
        for i, key in zip(random, row_keys([generators[i] for i in random])):
            keys[i] = key
            any_unseeded |= key == UNSEEDED
    host = torch.tensor([[p.temperature for p in params], [p.min_p for p in params], [p.top_p for p in params],
                         # top_k <= 0 or >= vocab_size keeps everything: both are k = vocab_size.
                         [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                         keys], dtype=torch.float64)  # [5, rows]
    dev = step_inputs.to_device(host, logits.device)
    f32 = dev[:3].to(torch.float32)  # [3, rows]: rounded as float32 parameters always were
    return RowParams(f32[0], f32[1], f32[2], dev[3].to(torch.int64), device_keys(dev[4].to(torch.int64), any_unseeded))


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row under ``log_softmax(logits)`` in float32, most
    likely first: -> (logprobs [rows, k], token ids [rows, k])."""
    # logits: [rows, vocab_size]
    logits = logits.float()
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)  # the log_softmax's order is the logits'
    return top.values - torch.logsumexp(logits, dim=-1, keepdim=True), top.indices


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams], rows: RowParams | None = None
                   ) -> torch.Tensor:
    """Tempered, filtered and renormalised probabilities of non-greedy rows (greedy rows,
    temperature 0, come out as if at temperature 1: the caller takes their argmax instead).

    Order (vLLM v1's): min_p, then top_k, then top_p over what top_k kept. min_p compares
    with the top token, which every filter keeps, so its place before top_k changes nothing.
    rows: the rows' parameters already on the device (default: sent now, one transfer).
    """
    # logits: [rows, vocab_size] float32
    vocab_size = logits.shape[1]
    rows = row_params(params, None, logits) if rows is None else rows
    # Which filters run is known on the host (params): a filter no row uses costs nothing.
    random = [p for p in params if not p.is_greedy]
    temperature = rows.temperature.masked_fill(rows.temperature == 0, 1.0)  # [rows]
    logits = logits / temperature.unsqueeze(1)  # [rows, vocab_size]

    if any(p.min_p > 0 for p in random):
        probs = torch.softmax(logits, dim=-1)  # [rows, vocab_size]
        threshold = probs.amax(dim=-1, keepdim=True) * rows.min_p.unsqueeze(1)  # [rows, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    if any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in random):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [rows, vocab_size]
        # Keep every token at least as likely as the k-th (ties at the boundary stay in).
        kth = sorted_logits.gather(1, (rows.top_k - 1).unsqueeze(1))  # [rows, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [rows, vocab_size]
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Mass strictly before each position: a token is kept while the tokens above it sum
        # to less than top_p, which always keeps the top token (top_p > 0).
        mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= rows.top_p.unsqueeze(1), float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

    return torch.softmax(logits, dim=-1)  # [rows, vocab_size]


def exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None],
                     rows: RowParams | None = None) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / q)`` with ``q ~ Exp(1)`` is a draw from
    ``probs``; each row's ``q`` comes from its key, made on the device (device_random.py).

    rows: the rows' keys already on the device (default: drawn from ``generators`` and sent now)."""
    # probs: [rows, vocab_size]
    if rows is None:
        host_keys = row_keys(generators)
        host = torch.tensor(host_keys, dtype=torch.float64)  # [rows]: keys < 2**53, exact
        keys = device_keys(step_inputs.to_device(host, probs.device).to(torch.int64), UNSEEDED in host_keys)
    else:
        keys = rows.keys
    q = exponentials(keys, probs.shape[1])  # [rows, vocab_size]
    return torch.argmax(probs / q, dim=-1)  # [rows]
