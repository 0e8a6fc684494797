"""Decoding beyond one token per row on fake CUDA (see fake_cuda.py), at the default model's
shapes: speculative verify, beam search candidates and an n > 1 fork's first sample read the
device back once per step (not once per draft or beam); a fork's copy-on-write copy and a
swap-in stay on the device, the swap-in crossing in one transfer; weights already on the
device are never copied again, however the device is named."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import CUDA, NUM_BLOCKS, SMOLLM2, DeviceAudit, random_weights, runner, seq
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tandem.decoding.beam_search import BeamSearch
from tandem.decoding.draft_verify import sample_step
from tandem.engine import step_inputs
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from tandem.kvcache.block_manager import BlockManager
from tandem.model.placement import weights_on
from tandem.sampling_params import SamplingParams

V = SMOLLM2.vocab_size
HOST_OPS = {"aten.lift_fresh.default"}
"""What the host may build during a step's device part: its small inputs, from Python lists."""


class HostReads:
    """The reads of device values back to the host (step_inputs.to_host, the one way back),
    each answered with zeros (real host values, which FakeTensorMode cannot give), and where
    in the running DeviceAudit each came."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.at: list[int] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        self.shapes.append(tuple(t.shape))
        if DeviceAudit.current is not None:
            self.at.append(len(DeviceAudit.current.outputs))
        with unset_fake_temporarily():
            return torch.zeros(t.shape, dtype=t.dtype)


@pytest.fixture
def host_reads(fake_cuda, monkeypatch) -> HostReads:
    reads = HostReads()
    monkeypatch.setattr(step_inputs, "to_host", reads)
    return reads


def device_part(audit: DeviceAudit, reads: HostReads) -> list[str]:
    """The ops that made a tensor off the device between the first transfer to it and the
    first read back, less the host's small inputs (HOST_OPS)."""
    end = reads.at[0] if reads.at else len(audit.outputs)
    return [op for op, device in audit.outputs[audit.transfers[0]:end] if device != CUDA and op not in HOST_OPS]


def test_verifying_drafts_reads_the_device_once_per_step(host_reads) -> None:
    """Three rows with 3, 2 and 4 drafts, greedy and random: acceptance for every draft is
    worked out on the device, and read back with the tokens and log-probabilities at once."""
    drafts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=40),
              SamplingParams(temperature=1.0, top_p=0.9)]
    logits = torch.randn(sum(1 + len(d) for d in drafts), V, device=CUDA)
    audit = DeviceAudit()
    with audit:
        out = sample_step(Sampler(), logits, params, [None] * 3, drafts)
    assert len(host_reads.shapes) == 1, host_reads.shapes
    assert device_part(audit, host_reads) == []
    # The host read zeros: no draft accepted, and token 0 drawn in its place.
    assert out.token_ids == [[0], [0], [0]] and [len(lp) for lp in out.logprobs] == [1, 1, 1]


def test_a_step_of_plain_rows_beams_and_drafts_reads_the_device_once(host_reads) -> None:
    """Plain rows, two beam searches' candidates and a drafted row: one read for the step."""
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(n=2, beam_width=2, use_beam_search=True, temperature=0, max_tokens=8),
              SamplingParams(n=3, beam_width=3, use_beam_search=True, temperature=0, max_tokens=8),
              SamplingParams(temperature=0)]
    drafts: list[list[int]] = [[], [], [], [], [4, 5]]
    logits = torch.randn(7, V, device=CUDA)
    audit = DeviceAudit()
    with audit:
        out = sample_step(Sampler(), logits, params, [None] * 5, drafts)
    assert len(host_reads.shapes) == 1, host_reads.shapes
    assert device_part(audit, host_reads) == []
    assert [len(t) for t in out.token_ids] == [1, 1, 4, 6, 1]  # beams: num_candidates(width, 1 EOS)


def _group(root_params: SamplingParams, i: int, num_tokens: int):
    root = seq(i, num_tokens, num_tokens - 1, root_params)
    forks = [seq(i, num_tokens, 0, root_params) for _ in range(root_params.n - 1)]
    beam: BeamSearch[Sequence, SequenceStatus] | None = (
        BeamSearch(root_params.beam_width, 1.0, 2 * root_params.beam_width) if root_params.use_beam_search else None)
    SequenceGroup(root, forks if beam is None else [], beam, lambda: None)
    return root


def test_an_n_gt_1_first_sample_and_a_beam_step_stay_on_the_device(host_reads) -> None:
    """The runner's sampling of a step in which an n = 3 root draws for its two dormant forks
    from its own logits row, beside a beam search's live beam and a plain decode: device
    tensors only between the step's inputs and its one read back."""
    r = runner()
    entries = [_group(SamplingParams(n=3, temperature=0.9), 0, 20),
               _group(SamplingParams(n=2, beam_width=2, use_beam_search=True, temperature=0), 1, 33),
               seq(2, 40, 39)]
    batch = ScheduledBatch(entries, [1, 1, 1])
    logits = torch.randn(3, V, dtype=torch.bfloat16, device=CUDA)
    audit = DeviceAudit()
    with audit:
        out = r.sample(batch, logits)
    assert len(host_reads.shapes) == 1, host_reads.shapes
    assert device_part(audit, host_reads) == []
    assert [len(t) for t in out.token_ids] == [1, 1, 1, 4, 1]  # the root, its two forks, the beam, the decode


def test_a_fork_s_copy_on_write_copy_stays_on_the_device(fake_cuda) -> None:
    """n = 2 after the prompt: the fork shares the root's last, partial block, and its first
    decode writes it, so the block manager asks for a copy; the copy runs on the device."""
    r = runner()
    bm = BlockManager(NUM_BLOCKS, 16)
    root, fork = seq(0, 40, 0, SamplingParams(n=2)), seq(0, 40, 0, SamplingParams(n=2))
    root.block_ids = []
    bm.allocate(root, 40)
    root.num_computed_tokens = 40
    root.token_ids.append(7)  # the root's first sample; the fork drew its own from the same row
    fork.take_progress(root)
    fork.block_ids = []
    bm.fork(root, fork)
    fork.token_ids[-1] = 9
    copies = bm.allocate(fork, 1)
    assert copies == [(root.block_ids[-1], fork.block_ids[-1])] and copies[0][0] != copies[0][1]
    audit = DeviceAudit()
    with audit:
        r.swap(ScheduledBatch([], [], copies=copies))
    assert [op for op, device in audit.outputs[audit.transfers[0]:] if device != CUDA] == []
    assert len(audit.transfers) == 1, "the copy's sources and destinations cross together"


def test_swap_in_is_one_transfer_and_one_host_copy(fake_cuda) -> None:
    """The swapped-in blocks are gathered once on the host, into the buffer that crosses, and
    cross with their destination ids in one transfer; the device then writes its slots."""
    r = runner()
    audit = DeviceAudit()
    with audit:
        r.swapper.swap_in([(2, 7), (5, 1), (0, 3)])
    assert len(audit.transfers) == 1
    off = [op for op, device in audit.outputs if device != CUDA]
    gathers = [op for op in off if op.startswith("aten.index_select")]
    assert len(gathers) == 1 and not {"aten.clone.default", "aten._to_copy.default"} & set(off), off
    after = [op for op, device in audit.outputs[audit.transfers[0]:] if device != CUDA]
    assert after == [] and "aten.index_copy_.default" in [op for op, _ in audit.outputs[audit.transfers[0]:]]


@pytest.mark.parametrize("asked", ["cuda", "cuda:0"])
def test_weights_on_the_device_are_not_copied_again(fake_cuda, asked: str) -> None:
    weights = random_weights(SMOLLM2, torch.bfloat16)  # on cuda:0
    assert weights_on(weights, torch.device(asked)) is weights
