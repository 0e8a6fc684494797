"""The model runner of a simulated worker: no forward, no tensors. It hands the engine's
scheduler the samples it expects (one fixed token per sample target) and prices the step
with a step-time model, so that the real LLMEngine, Scheduler, PrefillPacker, BlockManager
and Preemptor run unchanged around it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tandem.engine.sampler import StepOutput
from tandem.engine.scheduler import ScheduledBatch
from tandem.sim.spec import StepTimeModel

SIM_TOKEN_ID = 1
"""What every simulated sample draws. Requests are greedy with ignore_eos and max_tokens set
(as the bench sends), so the token's value never ends a request: only its count matters."""


@dataclass(frozen=True)
class StepShape:
    """What one step computes, in the step-time model's terms."""

    num_prefill_tokens: int
    """Prompt (or recomputed) tokens: every entry that is not a single decode token."""
    num_decode_seqs: int
    num_context_tokens: int
    """KV tokens the step's attention reads, over all entries (each entry's computed
    tokens plus its new ones)."""


def step_shape(batch: ScheduledBatch) -> StepShape:
    """The shape of a scheduled batch, read before the scheduler's update moves it on."""
    num_prefill = num_decode = num_context = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        # A decode: the one token after everything computed, an output token already drawn.
        # (A recompute-preempted sequence runs its prompt and outputs again as prefill.)
        if n == 1 and start + 1 == seq.num_tokens and seq.num_output_tokens > 0:
            num_decode += 1
        else:
            num_prefill += n
        num_context += start + n
    return StepShape(num_prefill, num_decode, num_context)


class SimRunner:
    """Stands in for tandem.engine.model_runner.ModelRunner: ``swap`` and ``run`` as
    LLMEngine.step calls them. After each run, ``last_shape`` and ``last_step_s`` say what the
    step was and how long it takes in virtual time (the caller advances its clock).

    NOTE: swapping KV blocks out and in is counted (``num_swapped_blocks``) but costs no
    time here: the step-time model has no term for it (on a GPU, a few PCIe copies per
    preemption, small beside a step)."""

    def __init__(self, step_model: StepTimeModel, tp: int = 1) -> None:
        self.step_model = step_model
        self.tp = tp
        self.last_shape = StepShape(0, 0, 0)
        self.last_step_s = 0.0
        self.num_steps = 0
        self.busy_s = 0.0
        """Virtual seconds of every step run so far."""
        self.num_swapped_blocks = 0

    def swap(self, batch: ScheduledBatch) -> None:
        """The scheduler's swap-outs, copies and swap-ins: counted, instant."""
        self.num_swapped_blocks += len(batch.swap_out) + len(batch.swap_in)
        self.last_shape, self.last_step_s = StepShape(0, 0, 0), 0.0  # an empty batch runs nothing

    def run(self, batch: ScheduledBatch, on_layer_stored: Callable[[int], None] | None = None,
            send_slots: Any = None) -> StepOutput:
        """-> one SIM_TOKEN_ID per sample target, in batch order (what Scheduler.update
        consumes); prices the step (see last_step_s)."""
        shape = step_shape(batch)
        self.last_shape = shape
        self.last_step_s = self.step_model.step_s(shape.num_prefill_tokens, shape.num_decode_seqs,
                                                  shape.num_context_tokens, self.tp)
        self.num_steps += 1
        self.busy_s += self.last_step_s
        num_targets = sum(len(batch.sample_targets(i)) for i in range(len(batch.seqs)))
        return StepOutput([[SIM_TOKEN_ID] for _ in range(num_targets)], [[0.0] for _ in range(num_targets)])
