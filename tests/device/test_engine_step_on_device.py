"""One engine's step on fake CUDA (FakeTensorMode, no GPU needed), at the default model's
shapes with random weights: the forward of packed prefill chunks (one after a prefix-cache
hit), of a batch of decodes (padded to a static size), with float, int8 and int4 weights; a
swap and a copy-on-write copy; the sampler's device part. Each produces device tensors only,
crosses to the device once per step, and reads no device value back (FakeTensorMode raises
on .item(), .tolist(), bool()). The last tests show that a CPU tensor or a host read slipped
into the forward fails here."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
import torch
from fake_cuda import BATCHES, CUDA, SMOLLM2, DeviceAudit, runner
from torch._subclasses.fake_tensor import DataDependentOutputException

from tandem.decoding.grammar import GrammarMatcher
from tandem.decoding.grammar_mask import apply_grammar_masks
from tandem.engine.sampler import Sampler, top_logprobs
from tandem.engine.scheduler import ScheduledBatch
from tandem.model import llama
from tandem.plan import read_model_shape
from tandem.sampling_params import SamplingParams


def test_the_shapes_are_the_default_model_s() -> None:
    shape = read_model_shape(None)
    same: dict[str, Any] = dict(name=SMOLLM2.name, eos_token_ids=SMOLLM2.eos_token_ids,
                                rms_norm_eps=SMOLLM2.rms_norm_eps)
    assert shape.rms_norm_eps == pytest.approx(SMOLLM2.rms_norm_eps)  # float32 in the GGUF file
    assert dataclasses.replace(shape, **same) == SMOLLM2


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_forward_runs_on_the_device_from_one_transfer(fake_cuda, name: str, quantization: str | None) -> None:
    r = runner(quantization)
    make_batch, num_logits = BATCHES[name]
    audit = DeviceAudit()
    with audit:
        logits = r.forward(make_batch(), None, None)
    assert logits.device == CUDA and tuple(logits.shape) == (num_logits, SMOLLM2.vocab_size)
    assert len(audit.transfers) == 1, "a step's inputs cross to the device in one transfer"
    assert audit.off_device_after_transfer() == []


def test_decodes_are_padded_to_a_static_batch(fake_cuda) -> None:
    r = runner()
    input_ids, positions, meta, logits_indices = r.prepare(BATCHES["decodes"][0]())
    assert (input_ids.shape[0], meta.num_decode_tokens, tuple(meta.decode_block_tables.shape)) == (16, 16, (16, 64))
    # padding rows (1 token) sort first
    assert logits_indices.shape[0] == 11 and [g.num_blocks for g in meta.decode_groups] == [3, 10]
    assert {t.device for t in (input_ids, positions, meta.slot_mapping, meta.decode_context_lens)} == {CUDA}


def test_swap_and_copy_on_write_stay_on_the_device(fake_cuda) -> None:
    r = runner()
    audit = DeviceAudit()
    with audit:
        r.swap(ScheduledBatch([], [], swap_out=[(3, 0), (4, 1)], copies=[(5, 6)], swap_in=[(2, 7)]))
    # On the host: block ids before they cross (lift_fresh), the swapped-out blocks' host copy
    # (fake_to_host), the host pool's one write (swap-out) and one gather (swap-in) into the
    # buffer that crosses (viewed as blocks and ids: slice, view, detach; the ids copied in).
    off = [op for op, device in audit.outputs if device != CUDA]
    assert sorted(set(off)) == ["aten.copy_.default", "aten.detach.default", "aten.empty.memory_format",
                                "aten.index_copy_.default", "aten.index_select.out", "aten.lift_fresh.default",
                                "aten.slice.Tensor", "aten.view.default", "aten.view.dtype"], off
    assert (off.count("aten.index_copy_.default"), off.count("aten.index_select.out")) == (1, 1)
    # Crossings: the swapped-out ids; the copy's sources with its destinations; the swapped-in
    # blocks with their ids (tests/device/test_decoding_on_device.py).
    assert len(audit.transfers) == 3
    assert r.swapper.host_cache.device.type == "cpu" and r.kv_cache.device == CUDA


def test_the_sampler_s_device_part_stays_on_the_device(fake_cuda) -> None:
    logits = torch.randn(4, SMOLLM2.vocab_size, dtype=torch.bfloat16, device=CUDA)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.7)]
    audit = DeviceAudit()
    with audit:
        chosen, logprobs = Sampler().sample_on_device(logits, params, [None] * 4)
    assert chosen.device == logprobs.device == CUDA and chosen.dtype == torch.int64
    # On the host: the rows' parameters, built from a Python list; they cross once.
    assert [op for op, device in audit.outputs if device != CUDA] == ["aten.lift_fresh.default"]
    assert len(audit.transfers) == 1
    with pytest.raises(DataDependentOutputException):  # what sample() does next: the step's one host read
        chosen.tolist()


def test_a_host_tensor_in_the_forward_fails_here(fake_cuda, monkeypatch) -> None:
    norm = llama.rms_norm
    monkeypatch.setattr(llama, "rms_norm", lambda x, w, eps: norm(x, w, eps) * torch.ones(x.shape[-1]))
    with pytest.raises(RuntimeError, match="cuda:0 and cpu|found at least two devices"):
        runner().forward(BATCHES["decodes"][0](), None, None)


def test_a_host_read_in_the_forward_fails_here(fake_cuda, monkeypatch) -> None:
    norm = llama.rms_norm
    monkeypatch.setattr(llama, "rms_norm", lambda x, w, eps: norm(x, w, eps) * float(w.max().item() > 0))
    with pytest.raises(DataDependentOutputException):
        runner().forward(BATCHES["decodes"][0](), None, None)


class _EveryOtherToken:
    """A matcher allowing the even token ids (what apply_grammar_masks asks of one)."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        bitmask[index] = 0x55555555


def test_grammar_masks_and_top_logprobs_stay_on_the_device(fake_cuda) -> None:
    """Structured outputs' masks: the host bitmasks and row ids cross in one transfer and are
    unpacked there; the top log-probabilities are worked out there (read back once, as the
    chosen tokens are)."""
    logits = torch.randn(3, SMOLLM2.vocab_size, dtype=torch.bfloat16, device=CUDA)
    audit = DeviceAudit()
    with audit:
        matcher = cast(GrammarMatcher, _EveryOtherToken())  # the one method apply_grammar_masks calls
        masked = apply_grammar_masks(logits, [matcher, None, matcher])
        values, indices = top_logprobs(masked, 5)
    assert masked.device == values.device == indices.device == CUDA and masked.shape == logits.shape
    assert len(audit.transfers) == 1
    assert all(device == CUDA for _, device in audit.outputs[audit.transfers[0]:])
