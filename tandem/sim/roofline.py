"""A GPU step's time from spec-sheet numbers: the roofline of one engine step.

    step = max(compute / (peak FLOP/s × compute efficiency),
               bytes read / (HBM bandwidth × bandwidth efficiency))
           + tensor-parallel all-reduces + a fixed per-step overhead

per rank of ``tp``. Compute is 2 FLOPs per weight per token through the layers, the LM head
only for the rows sampled, plus attention's QK^T and PV; the bytes are the weights (each read
once a step: a decode step's floor) plus the KV cache attended over and written. Under
tensor parallelism every layer all-reduces its attention and its MLP output (2 per layer,
Megatron-style), a ring over the GPU link. The efficiency factors are the part of the peak a
real step reaches (documented constants below, per kind of step); nothing here is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import ModelConfig
from tandem.config.names import DTYPE_BYTES
from tandem.sim.gpus import GpuSpec, gpu

PREFILL_COMPUTE_EFFICIENCY = 0.6
"""Share of the dense peak a prefill step's large GEMMs reach: published model-FLOPs
utilisation of LLM prefill on A100/H100 is typically 50-65% (big M, the tensor cores busy)."""
PREFILL_BANDWIDTH_EFFICIENCY = 0.8
"""Share of peak HBM bandwidth a prefill step's reads reach (rarely the bound)."""
DECODE_COMPUTE_EFFICIENCY = 0.3
"""Share of the dense peak a decode step's skinny GEMMs (M = the batch) reach: far from
the peak, since the tensor cores' tiles are mostly padding at small M."""
DECODE_BANDWIDTH_EFFICIENCY = 0.75
"""Share of peak HBM bandwidth a decode step's weight and KV reads reach: well-tuned GEMV
and paged-attention kernels sustain 70-85% of the sheet's figure."""
LINK_EFFICIENCY = 0.8
"""Share of one direction of the GPU link a ring all-reduce reaches (NCCL's bus bandwidth
is about 80% of NVLink's)."""
ALL_REDUCE_LATENCY_S = 10e-6
"""Fixed cost of one small all-reduce (NCCL on NVLink: about 10 us)."""
STEP_BASE_OVERHEAD_S = 1e-3
"""Per step, outside the kernels: scheduling, the step's metadata, sampling, Python."""
LAYER_OVERHEAD_S = 1e-4
"""Per layer and step: tandem runs eagerly (no CUDA graphs), about a dozen kernel launches a
layer at ~8 us each, which a small step cannot hide behind its kernels."""


@dataclass(frozen=True)
class StepParts:
    """One step's time, by part (seconds, per rank)."""

    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.communication_s + self.overhead_s


class RooflineStepModel:
    """Step times of ``shape`` on ``gpu`` from its spec sheet (a StepTimeModel)."""

    def __init__(self, gpu_spec: GpuSpec | str, shape: ModelConfig, dtype: str = "bfloat16",
                 weight_bytes_per_param: float | None = None, *,
                 prefill_efficiency: tuple[float, float] = (PREFILL_COMPUTE_EFFICIENCY, PREFILL_BANDWIDTH_EFFICIENCY),
                 decode_efficiency: tuple[float, float] = (DECODE_COMPUTE_EFFICIENCY, DECODE_BANDWIDTH_EFFICIENCY),
                 step_overhead_s: float | None = None) -> None:
        """dtype: of activations and the KV cache (a DTYPE_BYTES name). weight_bytes_per_param:
        the weights' format (default: dtype's bytes; int4 in groups of 32 with a 2-byte scale
        is 0.5625). *_efficiency: (compute, bandwidth) shares of the peaks reached.
        step_overhead_s: default STEP_BASE_OVERHEAD_S + LAYER_OVERHEAD_S per layer."""
        self.gpu = gpu(gpu_spec) if isinstance(gpu_spec, str) else gpu_spec
        self.shape = shape
        self.dtype = dtype
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.weight_bytes_per_param = float(self.dtype_bytes if weight_bytes_per_param is None
                                            else weight_bytes_per_param)
        for eff in (*prefill_efficiency, *decode_efficiency):
            if not 0 < eff <= 1:
                raise ValueError(f"efficiencies must be in (0, 1], got {eff}")
        self.prefill_efficiency = prefill_efficiency
        self.decode_efficiency = decode_efficiency
        self.step_overhead_s = (STEP_BASE_OVERHEAD_S + LAYER_OVERHEAD_S * shape.num_layers
                                if step_overhead_s is None else step_overhead_s)

    @classmethod
    def for_model(cls, gpu_name: str, model: str | None = None, **kwargs: object) -> RooflineStepModel:
        """``model`` as ``--model`` takes it (None: the embedded default), read by its config
        alone (tandem.plan.read_model_shape: no weights loaded)."""
        from tandem.plan import read_model_shape

        return cls(gpu_name, read_model_shape(model), **kwargs)  # type: ignore[arg-type]

    # -- the model's shape, counted ------------------------------------------------------

    @property
    def layer_matmul_params(self) -> int:
        """Weights every token goes through in the layers: q/k/v/o and gate/up/down."""
        s = self.shape
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        return s.num_layers * (qkv * s.hidden_size + s.hidden_size * s.num_heads * s.head_dim
                               + 3 * s.intermediate_size * s.hidden_size)

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights one step reads, over all ranks: every parameter but an untied
        embedding table, of which a step gathers only its tokens' rows."""
        s = self.shape
        gathered_only = 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size
        return (s.num_parameters - gathered_only) * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (all ranks': what a transfer moves)."""
        return self.shape.kv_bytes_per_token(self.dtype)

    @staticmethod
    def attention_pairs(num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int) -> float:
        """(query, key) pairs a step's attention computes. A decode token attends over its
        sequence's context, so the decodes' pairs sum to their context. The prefill is taken
        as one prompt's chunk of P tokens: causal over itself (P(P+1)/2) and over what the
        prompt had computed before it; without decodes that is context - P exactly, with
        decodes the split of the context is unknown and the chunk is taken as the prompt's
        first (attention is a small share of a step until contexts are long)."""
        p, k = num_prefill_tokens, num_context_tokens
        if p == 0:
            return float(k)
        causal = p * (p + 1) / 2
        if num_decode_seqs == 0:
            return causal + p * max(0, k - p)
        return causal + max(0, k - p)

    # -- the step ------------------------------------------------------------------------

    def parts(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int, tp: int = 1) -> StepParts:
        """The step's time by part, on one of ``tp`` ranks."""
        if min(num_prefill_tokens, num_decode_seqs, num_context_tokens) < 0 or tp < 1:
            raise ValueError("token and sequence counts must be >= 0 and tp >= 1")
        s = self.shape
        tokens = num_prefill_tokens + num_decode_seqs
        if tokens == 0:
            return StepParts(0.0, 0.0, 0.0, 0.0)
        sampled = num_decode_seqs + (1 if num_prefill_tokens else 0)  # LM head rows: last positions only
        pairs = self.attention_pairs(num_prefill_tokens, num_decode_seqs, num_context_tokens)
        flops = (2 * self.layer_matmul_params * tokens + 2 * s.vocab_size * s.hidden_size * sampled
                 + 4 * s.num_layers * s.num_heads * s.head_dim * pairs)  # QK^T and PV, 2 FLOPs a MAC each
        kv_per_rank = self.shape.kv_bytes_per_token(self.dtype, tp)
        # Read: the weights and the KV attended over; written: the step's new tokens' KV.
        bytes_moved = self.weight_bytes / tp + (num_context_tokens + tokens) * kv_per_rank
        compute_eff, bandwidth_eff = self.prefill_efficiency if num_prefill_tokens else self.decode_efficiency
        compute_s = flops / tp / (self.gpu.flops * compute_eff)
        memory_s = bytes_moved / (self.gpu.hbm_bytes_per_s * bandwidth_eff)
        return StepParts(compute_s, memory_s, self.all_reduce_s(tokens, tp), self.step_overhead_s)

    def all_reduce_s(self, tokens: int, tp: int) -> float:
        """Two ring all-reduces per layer of the step's hidden states: each rank sends and
        receives 2(tp-1)/tp of the bytes over one direction of its link."""
        if tp == 1:
            return 0.0
        nbytes = tokens * self.shape.hidden_size * self.dtype_bytes
        one = 2 * (tp - 1) / tp * nbytes / (self.gpu.link_bytes_per_s * LINK_EFFICIENCY) + ALL_REDUCE_LATENCY_S
        return 2 * self.shape.num_layers * one

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int, tp: int = 1) -> float:
        """Seconds of the step (StepTimeModel); 0 for an empty one."""
        return self.parts(num_prefill_tokens, num_decode_seqs, num_context_tokens, tp).total_s
