"""What changes a row's logits before the sampler chooses (vLLM v1's order): min_tokens masks
EOS and the stop token ids, logit_bias adds, then the repetition penalty (prompt and output
tokens, transformers' rule), then the frequency and presence penalties (output tokens,
OpenAI's rule). Rows whose SamplingParams ask for none of it are left alone."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tandem.engine import step_inputs
from tandem.engine.sequence import Sequence


def apply_logits_processors(logits: torch.Tensor, targets: Seq[Sequence], eos_token_ids: Seq[int]) -> torch.Tensor:
    """-> the logits ([rows, vocab_size], one row per target) as the targets' params change
    them; ``logits`` itself unchanged (the sampler reports log-probabilities of the raw ones)."""
    rows = [i for i, t in enumerate(targets) if t.params.processes_logits]
    if not rows:
        return logits
    logits = logits.float().clone()  # logits: [rows, vocab_size]
    vocab_size = logits.shape[1]
    for i in rows:
        seq = targets[i]
        params = seq.params
        row = logits[i]  # [vocab_size], a view
        if seq.num_output_tokens < params.min_tokens:
            banned = [*params.stop_token_ids, *([] if params.ignore_eos else eos_token_ids)]
            row[_ids(banned, vocab_size, row.device)] = float("-inf")
        biased = [(t, b) for t, b in params.logit_bias if t < vocab_size]
        if biased:
            ids, bias = zip(*biased)
            row[_ids(ids, vocab_size, row.device)] += step_inputs.to_device(torch.tensor(bias), row.device)
        if params.repetition_penalty != 1:
            seen = torch.unique(_ids(seq.token_ids, vocab_size, row.device))
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if params.frequency_penalty != 0 or params.presence_penalty != 0:
            counts = torch.bincount(_ids(seq.output_token_ids, vocab_size, row.device), minlength=vocab_size)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def _ids(ids: Seq[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Token ids (those inside the logits' vocabulary) as an index on `device`."""
    return step_inputs.to_device(torch.tensor([t for t in ids if t < vocab_size], dtype=torch.long), device)
