"""The decode step compiled for the CPU: a float32 model's whole decode step (int4, int8 or
float32 weights) as one call into tandem.kernels.decode_step_cpu (the layer loop in C++, one
parallel region a step), where the eager forward makes ~12 torch calls a layer.

Measured against Inductor's C++ backend on the traced step (issue 33 item 3): Inductor took 9x
the eager step at batch 1 (its KV-cache writes are functionalized, so the cache is copied), and
a native loop runs the eager kernels' own code, so its logits equal the eager path's to the bit.
The eager path stays the reference and runs every step this one does not take: prefill and
mixed steps, layer hooks, tensor parallelism, bfloat16 weights, `--enforce-eager`.
"""

from __future__ import annotations

import torch

from tandem.kernels import f32_gemv_cpu, ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.decode_step_cpu import load_extension
from tandem.kernels.int4_gemv_cpu import Int4GemvPack
from tandem.kernels.int8_gemv_cpu import Int8GemvPack
from tandem.kernels.layer_ops_cpu import kernels_for
from tandem.kernels.paged_decode_attention_cpu import MAX_GROUP, MAX_HEAD_DIM, MIN_SPLIT_TOKENS
from tandem.model.int4_matmul import GEMV_MAX_TOKENS
from tandem.model.llama import LlamaModel
from tandem.model.quantization import Weight


class CompiledDecodeStep:
    """A model's decode steps as one compiled call (see the module's docstring)."""

    def __init__(self, model: LlamaModel, step: object, max_tokens: int) -> None:
        self.model = model
        self._step = step  # the extension's DecodeStep, holding the model's tensors
        self.max_tokens = max_tokens
        """Sequences a step it runs may hold: as many as the eager products' kernels take, so
        that both paths run the same kernel (f32_gemv_cpu.MAX_TOKENS for float32 weights)."""

    @classmethod
    def for_model(cls, model: LlamaModel, tensor_parallel_size: int = 1) -> CompiledDecodeStep | None:
        """The compiled step of ``model``, or None where it cannot run it: weights not all in the
        CPU GEMV kernels' layouts (bfloat16, or not float32 activations), tensor parallelism (the
        ranks' all-reduces sit between its stages), shapes the kernels do not take, or no build."""
        if not isinstance(model, LlamaModel):  # a stand-in model (tests): its own forward
            return None
        cfg, w = model.config, model.weights
        projections = [p for lw in w.layers for p in (lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj)]
        if (tensor_parallel_size != 1 or kernels_for(w.embed_tokens) is None
                or any(_gemv_pack(p) is None for p in [*projections, w.lm_head])
                or cfg.intermediate_size % 16 or cfg.head_dim % 16 or cfg.head_dim > MAX_HEAD_DIM
                or model.num_heads % model.num_kv_heads or model.num_heads // model.num_kv_heads > MAX_GROUP
                or any(lw.qkv_bias is not None and lw.qkv_bias.dtype != torch.float32 for lw in w.layers)):
            return None
        ext = load_extension()
        if ext is None:
            return None

        def projection(p: Weight) -> object:
            pack = _gemv_pack(p)
            assert pack is not None
            if isinstance(pack, torch.Tensor):
                return ext.Projection(pack, torch.empty(0))  # float32 as torch holds it: no scales
            scales = pack.scale_offset if isinstance(pack, Int4GemvPack) else pack.scale
            return ext.Projection(pack.values, scales, pack.int8_activations)

        layers = [ext.Layer(projection(lw.qkv_proj), projection(lw.o_proj), projection(lw.gate_up_proj),
                            projection(lw.down_proj), lw.qkv_bias, lw.input_norm, lw.post_attention_norm)
                  for lw in w.layers]
        step = ext.DecodeStep(w.embed_tokens, model.cos, model.sin, w.norm, layers, projection(w.lm_head),
                              model.num_heads, model.num_kv_heads, cfg.rms_norm_eps, model.scale, MIN_SPLIT_TOKENS)
        floats = any(isinstance(p, torch.Tensor) for p in [*projections, w.lm_head])
        return cls(model, step, f32_gemv_cpu.MAX_TOKENS if floats else GEMV_MAX_TOKENS)

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one it runs: decode tokens only (one per sequence), at most
        max_tokens, with the CPU attention kernel chosen (TANDEM_ATTENTION_BACKEND)."""
        return (meta.num_prefills == 0 and meta.num_decode_tokens == input_ids.shape[0] <= self.max_tokens
                and ops.requested_backend() in (ops.Backend.AUTO, ops.Backend.CPU_KERNEL))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """LlamaModel.forward for a step can_run takes -> [num_logits, vocab_size] float32.

        input_ids, positions: [num_tokens]; kv_cache: [num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim] float32 or bfloat16
        """
        return self._step.run(input_ids, positions, kv_cache, meta.slot_mapping,  # type: ignore[attr-defined]
                              meta.decode_block_tables, meta.decode_context_lens, logits_indices)


def _gemv_pack(w: Weight) -> Int4GemvPack | Int8GemvPack | torch.Tensor | None:
    """The weight's CPU GEMV layout: the one pack_for_cpu_kernels made, or a float32 weight itself
    where f32_gemv_cpu takes it."""
    if isinstance(w, torch.Tensor):
        ok = w.dtype == torch.float32 and w.is_contiguous() and f32_gemv_cpu.takes(*w.shape)
        return w if ok and f32_gemv_cpu.load_extension() is not None else None
    return vars(w).get("gemv_pack")
