"""The whole sampling step on fake CUDA (FakeTensorMode, no GPU needed), at the default
model's vocabulary: seeded rows, penalties, logit_bias and min_tokens, grammar masks, top
log-probabilities. Each phase crosses to the device in one transfer of its parameters (never a
vocabulary-sized host row), makes device tensors only after it, and the step reads the device
back once (FakeTensorMode raises on a host tensor mixed in and on any other host read)."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import CUDA, SMOLLM2, DeviceAudit, fake_to_device
from torch._subclasses.fake_tensor import DataDependentOutputException, unset_fake_temporarily

from tandem.decoding.grammar_mask import apply_grammar_masks
from tandem.engine import step_inputs
from tandem.engine.device_random import draw_generator
from tandem.engine.logits_processors import apply_logits_processors
from tandem.engine.sampler import Sampler
from tandem.sampling_params import SamplingParams

VOCAB = SMOLLM2.vocab_size
EOS = list(SMOLLM2.eos_token_ids)


class Target:
    """What the processors and the grammar mask read of a sequence."""

    def __init__(self, params: SamplingParams, output: list[int], grammar: object | None = None) -> None:
        prompt = [(31 * t + 5) % VOCAB for t in range(40)]
        self.params, self.output_token_ids, self.grammar = params, output, grammar
        self.token_ids, self.num_output_tokens = prompt + output, len(output)


class EvenTokens:
    """A grammar matcher allowing the even token ids."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        bitmask[index] = 0x55555555


def mixed_batch() -> list[Target]:
    """One row of each kind the sampler serves."""
    out = [3, 17, 17, 900, 3, 3]
    return [
        Target(SamplingParams(temperature=0), out),
        Target(SamplingParams(temperature=0.8, top_k=40, top_p=0.9), out),
        Target(SamplingParams(temperature=0.7, seed=11), out),
        Target(SamplingParams(temperature=1.0, seed=12, min_p=0.05, repetition_penalty=1.3,
                              frequency_penalty=0.5, presence_penalty=0.4), out),
        Target(SamplingParams(temperature=0, logit_bias=((5, 3.0), (77, -2.0), (49151, 1.0))), out),
        Target(SamplingParams(temperature=0.9, min_tokens=10, stop_token_ids=(8, 9)), out),
        Target(SamplingParams(temperature=0.6, seed=13, logprobs=5), out),
        Target(SamplingParams(temperature=0.5, seed=14), out, EvenTokens()),
    ]


def generators(targets: list[Target]) -> list[torch.Generator | None]:
    """As the model runner gives them: a seeded row's generator for its position."""
    return [None if t.params.seed is None else draw_generator(t.params.seed, len(t.token_ids)) for t in targets]


class Crossings:
    """step_inputs' crossings, recorded: bytes sent to the device, reads back to the host."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[int] = []
        self.reads = 0
        monkeypatch.setattr(step_inputs, "to_device", self.to_device)
        monkeypatch.setattr(step_inputs, "to_host", self.to_host)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        assert host.device.type == "cpu"
        self.sent.append(host.numel() * host.element_size())
        return fake_to_device(host, device)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The device's values as real host zeros (a fake tensor has none): the one read."""
        assert t.device == CUDA
        self.reads += 1
        with unset_fake_temporarily():
            return torch.zeros(t.shape, dtype=t.dtype)


def audited(fn, *args, reads: int = 0, **kwargs):
    """-> (fn's result, its DeviceAudit), asserting one transfer and nothing off the device
    after it but the landing buffers of ``reads`` reads back (Crossings.to_host)."""
    audit = DeviceAudit()
    with audit:
        result = fn(*args, **kwargs)
    assert len(audit.transfers) == 1, audit.transfers
    assert audit.off_device_after_transfer() == ["aten.zeros.default"] * reads
    return result, audit


def test_seeded_rows_draw_on_the_device(fake_cuda, monkeypatch) -> None:
    """Seeded rows among unseeded ones: their randomness is made on the device; what crosses
    is the rows' parameters (a few numbers per row), not a vocabulary-sized row each."""
    crossings = Crossings(monkeypatch)
    targets = mixed_batch()[:4]
    logits = torch.randn(4, VOCAB, dtype=torch.bfloat16, device=CUDA)
    (chosen, logprobs), _ = audited(Sampler().sample_on_device, logits, [t.params for t in targets],
                                    generators(targets))
    assert chosen.device == logprobs.device == CUDA and chosen.shape == (4,)
    assert len(crossings.sent) == 1 and crossings.sent[0] <= 64 * len(targets)
    with pytest.raises(DataDependentOutputException):
        chosen.tolist()


def test_penalties_bias_and_min_tokens_are_dense_on_the_device(fake_cuda, monkeypatch) -> None:
    """Repetition, frequency and presence penalties, logit_bias (one id past the vocabulary
    is dropped) and min_tokens from one transfer of token ids and parameters: no torch.unique,
    no per-row index, no host read."""
    crossings = Crossings(monkeypatch)
    targets = mixed_batch()
    logits = torch.randn(len(targets), VOCAB, dtype=torch.bfloat16, device=CUDA)
    processed, audit = audited(apply_logits_processors, logits, targets, EOS)
    assert processed.device == CUDA and processed.shape == logits.shape and processed.dtype == torch.float32
    assert not any("unique" in op or "nonzero" in op for op, _ in audit.outputs)
    assert len(crossings.sent) == 1 and crossings.reads == 0


def test_a_mixed_step_reads_the_device_once(fake_cuda, monkeypatch) -> None:
    """A batch mixing greedy, filtered, seeded, penalised, biased, min_tokens, top-logprobs
    and grammar rows through processors, grammar masks and the sampler: each phase one
    transfer and device tensors only; one read of the device for the whole step."""
    crossings = Crossings(monkeypatch)
    targets = mixed_batch()
    raw = torch.randn(len(targets), VOCAB, dtype=torch.bfloat16, device=CUDA)
    processed, _ = audited(apply_logits_processors, raw, targets, EOS)
    masked, _ = audited(apply_grammar_masks, processed, [t.grammar for t in targets])
    out, _ = audited(Sampler().sample, masked, [t.params for t in targets], generators(targets), raw_logits=raw,
                     reads=1)
    assert len(crossings.sent) == 3 and crossings.reads == 1
    assert len(out.token_ids) == len(out.logprobs) == len(targets)
    assert out.top_logprobs is not None
    assert [len(t.token_ids) for t in out.top_logprobs] == [5 if t.params.logprobs else 0 for t in targets]
