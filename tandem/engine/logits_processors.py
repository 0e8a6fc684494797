"""What changes a row's logits before the sampler chooses (vLLM v1's order): min_tokens masks
EOS and the stop token ids, logit_bias adds, then the repetition penalty (prompt and output
tokens, transformers' rule), then the frequency and presence penalties (output tokens,
OpenAI's rule). Rows whose SamplingParams ask for none of it are left alone.

All of it is dense over the batch on the logits' device: the rows' token ids (padded to a
fixed width) and parameters cross in one transfer; the output tokens' counts are a
``[rows, vocab_size]`` scatter_add there; no per-row index, no torch.unique, no host read.
Padding points at a spare column ``vocab_size``, dropped after the scatter."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from tandem.engine import step_inputs
from tandem.engine.sequence import Sequence


def apply_logits_processors(logits: torch.Tensor, targets: Seq[Sequence], eos_token_ids: Seq[int]) -> torch.Tensor:
    """-> the logits ([rows, vocab_size] float32, one row per target) as the targets' params
    change them; ``logits`` itself unchanged (the sampler reports log-probabilities of the raw
    ones), and returned as it is when no target asks for processing."""
    if not any(t.params.processes_logits for t in targets):
        return logits
    rows, vocab_size = logits.shape
    params = [t.params for t in targets]
    # Which steps run is known on the host: a step no row asks for costs nothing.
    repetition = [p.repetition_penalty != 1 for p in params]
    counted = [r or p.frequency_penalty != 0 or p.presence_penalty != 0 for r, p in zip(repetition, params)]
    # Additive entries per row: min_tokens bans (-inf) and then the row's logit_bias.
    added: list[list[tuple[int, float]]] = []
    for t in targets:
        p = t.params
        banned = ([*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)]
                  if t.num_output_tokens < p.min_tokens else [])
        added.append([(i, float("-inf")) for i in banned] + list(p.logit_bias))
    outputs = [list(t.output_token_ids) if c else [] for t, c in zip(targets, counted)]
    prompts = [t.token_ids[:len(t.token_ids) - t.num_output_tokens] if r else [] for t, r in zip(targets, repetition)]

    host = _Layout(rows, vocab_size)
    host.add("scalars", [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params], 3)
    host.add_ids("added_ids", [[i for i, _ in a] for a in added])
    host.add("added_values", [[b for i, b in a if i < vocab_size] for a in added], host.width("added_ids"))
    host.add_ids("outputs", outputs)
    host.add_ids("prompts", prompts)
    dev = host.upload(logits.device)

    out = logits.float()  # [rows, vocab_size]
    scalars = dev["scalars"].to(torch.float32)  # [rows, 3]
    if any(added):
        extra = _scatter(dev["added_ids"], dev["added_values"].to(torch.float32), rows, vocab_size, add=True)
        out = out + extra  # -inf where banned: it stays -inf through every step below
    if any(counted):
        counts = _scatter(dev["outputs"], 1.0, rows, vocab_size, add=True)  # [rows, vocab_size]
        if any(repetition):
            in_prompt = _scatter(dev["prompts"], 1.0, rows, vocab_size, add=False)  # [rows, vocab_size]
            seen = (in_prompt > 0) | (counts > 0)  # [rows, vocab_size]
            penalty = scalars[:, 0:1]  # [rows, 1]; 1 (no change) for other rows
            out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
        frequency, presence = scalars[:, 1:2], scalars[:, 2:3]  # [rows, 1] each; 0 for other rows
        out = out - (frequency * counts + presence * (counts > 0))
    return out.clone() if out is logits else out


def _scatter(ids: torch.Tensor, values: torch.Tensor | float, rows: int, vocab_size: int, add: bool) -> torch.Tensor:
    """A dense ``[rows, vocab_size]`` float32 tensor: ``values`` (or one value) at ``ids``
    ([rows, width], summed when ``add``, else set), padding (id ``vocab_size``) landing in a
    dropped column."""
    dense = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=ids.device)  # [rows, vocab_size + 1]
    index = ids.to(torch.int64)
    if not isinstance(values, torch.Tensor):  # made on the device: nothing crosses
        values = torch.full(index.shape, values, dtype=torch.float32, device=ids.device)
    dense = dense.scatter_add_(1, index, values) if add else dense.scatter_(1, index, values)
    return dense[:, :vocab_size]


class _Layout:
    """The step's processing inputs laid out in one float64 host buffer (exact for token ids
    and for float32 values), which crosses to the device in one transfer."""

    def __init__(self, rows: int, vocab_size: int) -> None:
        self.rows, self.vocab_size = rows, vocab_size
        self.arrays: dict[str, np.ndarray] = {}

    def width(self, name: str) -> int:
        return self.arrays[name].shape[1]

    def add(self, name: str, values: Seq[Seq[float]], width: int, pad: float = 0.0) -> None:
        """Per row a list of values, padded with ``pad`` to ``width``: [rows, width]."""
        array = np.full((self.rows, width), pad, dtype=np.float64)
        for i, row in enumerate(values):
            array[i, :len(row)] = row
        self.arrays[name] = array

    def add_ids(self, name: str, ids: list[list[int]]) -> None:
        """Per row the token ids inside the vocabulary, padded with the spare column's id."""
        kept = [[t for t in row if t < self.vocab_size] for row in ids]
        self.add(name, kept, max(map(len, kept), default=0), pad=float(self.vocab_size))

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """-> each array by name, a float64 view of one buffer on ``device``."""
        return step_inputs.upload_arrays(self.arrays, np.float64, device)
