"""The compiled greedy pick (csrc/greedy_pick_cpu.h): each row's argmax as torch.argmax gives it
(first of ties, a NaN as the largest) and its log-probability against float64 log_softmax; and
the sampler taking it for an all-greedy batch on float32 CPU logits."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampler import Sampler
from tandem.kernels import layer_ops_cpu
from tandem.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def kernel():
    module = layer_ops_cpu.load_extension()
    assert module is not None, "make install builds it; a machine without a compiler runs torch's"
    return module


def reference(logits: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.argmax(logits, dim=-1)
    return chosen, torch.log_softmax(raw.double(), dim=-1).gather(1, chosen[:, None]).squeeze(1)


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (3, 49152), (9, 1000), (2, 17), (1, 5), (5, 1)])
def test_matches_argmax_and_float64_log_softmax(kernel, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g, device="cpu") * 4  # (a CPU kernel)
    raw = logits + torch.randn(rows, vocab, generator=g, device="cpu")  # processed logits differ from the raw ones
    for raw_ in (logits, raw):
        chosen, logprobs = kernel.greedy_pick(logits, raw_)
        want_chosen, want_logprobs = reference(logits, raw_)
        assert chosen.dtype == torch.int64 and logprobs.dtype == torch.float32
        assert chosen.tolist() == want_chosen.tolist()
        torch.testing.assert_close(logprobs.double(), want_logprobs, rtol=0, atol=2e-5)


def test_ties_masks_and_nans_as_torch(kernel):
    vocab = 49152
    logits = torch.full((4, vocab), -float("inf"), device="cpu")
    logits[0, [7, 40000, 41]] = 3.0  # a tie: the first index wins, wherever the lanes put them
    logits[1] = torch.linspace(-5, 5, vocab)
    logits[1, :vocab - 1] = -float("inf")  # banned everywhere but the last (a tail element)
    logits[2, 33] = 1.0
    logits[2, 20000] = float("nan")
    logits[3, 3] = 0.0
    chosen, logprobs = kernel.greedy_pick(logits, logits)
    assert chosen.tolist() == torch.argmax(logits, dim=-1).tolist() == [7, vocab - 1, 20000, 3]
    assert logprobs[0].item() == pytest.approx(-torch.log(torch.tensor(3.0)).item(), abs=1e-6)
    assert logprobs[1].item() == 0.0 and logprobs[3].item() == 0.0
    assert torch.isnan(logprobs[2])


def test_a_strided_row_view_and_other_dtypes(kernel):
    base = torch.randn(4, 2000, device="cpu")
    rows = base[::2]  # [2, 2000]: rows contiguous, strided between them
    chosen, logprobs = kernel.greedy_pick(rows, rows)
    want_chosen, want_logprobs = reference(rows, rows)
    assert chosen.tolist() == want_chosen.tolist()
    torch.testing.assert_close(logprobs.double(), want_logprobs, rtol=0, atol=2e-5)
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        kernel.greedy_pick(rows.double(), rows.double())
    with pytest.raises(RuntimeError, match="alike"):
        kernel.greedy_pick(rows, base)


def test_the_sampler_takes_it_for_a_greedy_batch_and_torch_for_the_rest(kernel, monkeypatch):
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1), device="cpu")
    greedy = [SamplingParams(temperature=0)] * 3
    calls: list[int] = []

    def kernels_for(*tensors: torch.Tensor):
        calls.append(len(tensors))
        return kernel
    monkeypatch.setattr(layer_ops_cpu, "kernels_for", kernels_for)
    picked = Sampler().sample(logits, greedy, [None] * 3)
    assert calls == [2]
    monkeypatch.setattr(layer_ops_cpu, "kernels_for", lambda *t: None)  # torch's path: the reference
    torch_path = Sampler().sample(logits, greedy, [None] * 3)
    assert picked.token_ids == torch_path.token_ids
    assert picked.logprobs == pytest.approx(torch_path.logprobs, abs=2e-5)
