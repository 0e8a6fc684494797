"""A GGUF file's Q4_1 projections kept as they are: Int4Weight straight from the blocks.

A Q4_1 block is 20 bytes for 32 consecutive values of a row: ``d`` (float16), ``m``
(float16), then 16 bytes whose low nibbles are values 0..15 and high nibbles values 16..31;
``w = d * q + m`` (gguf.quants.Q4_1.dequantize_blocks). That is Int4Weight with groups of
32, ``scale = d`` and ``offset = m``: only the nibbles move (Int4Weight pairs neighbouring
columns in a byte), no value passes through a float, and ``dequantize()`` gives exactly
the float32 weights that transformers' GGUF loader computes.

llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs
neighbouring dimensions, Hugging Face's pairs halves); transformers undoes it on load.
Groups run along the columns, so whole rows of blocks move: the same permutation applies
to an Int4Weight's rows.

Projections that are not Q4_1 (other files may hold Q4_K, Q8_0 or F16 ones) are quantized
from the float weights with quantize_int4, as for any other source. The LM head is kept as
int4 where the file has it in Q4_1; otherwise (the default SmolLM2 file's tied embedding is
Q8_0) it is quantized as quantize_weights does for int4: int8 per channel (LM_HEAD_METHOD).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.model.gguf_index import gguf_index
from tandem.model.int4 import Int4Weight, pack_int4, quantize_int4
from tandem.model.quantization import Weight, quantize_lm_head, with_cpu_pack

if TYPE_CHECKING:
    from tandem.config import ModelConfig
    from tandem.model.llama import ModelWeights
    from tandem.model.source import ModelSource

logger = logging.getLogger(__name__)

Q4_1_BLOCK = 32
Q4_1_BLOCK_BYTES = 20
PERMUTED_ARCHITECTURES = ("llama",)
"""GGUF architectures whose q/k rows llama.cpp permutes (Mistral is written as llama; Qwen2 is not
permuted): the same rule as transformers' GGUF loader (its LlamaTensorProcessor)."""


def int4_from_q4_1_blocks(raw: np.ndarray | torch.Tensor, out_features: int, in_features: int) -> Int4Weight:
    """raw: [out, in // 32 * 20] uint8, a Q4_1 tensor's bytes -> Int4Weight (group size 32)."""
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: the file is mapped read-only
    blocks = blocks.reshape(out_features, in_features // Q4_1_BLOCK, Q4_1_BLOCK_BYTES)  # [out, groups, 20]
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)  # [out, groups]
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)  # [out, groups]
    qs = blocks[..., 4:].contiguous()  # [out, groups, 16]
    # values: [out, groups, 32]: a block's first 16 values in the low nibbles, the next 16 in the high ones.
    values = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
    return Int4Weight(pack_int4(values.reshape(out_features, in_features)), d.contiguous(), m.contiguous(), Q4_1_BLOCK)


def unpermute_rows(w: Int4Weight, num_heads: int) -> Int4Weight:
    """Undo llama.cpp's q/k row permutation (transformers' reverse permute, on rows)."""
    out_features = w.shape[0]
    half = out_features // num_heads // 2
    # The file's row order is [head, pair, half]; Hugging Face's is [head, half, pair].
    perm = torch.arange(out_features).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)
    return Int4Weight(w.qweight[perm].contiguous(), w.scale[perm].contiguous(), w.offset[perm].contiguous(),
                      w.group_size)


def cat_rows(parts: list[Int4Weight]) -> Int4Weight:
    """Int4 weights stacked along their output channels (q/k/v, gate/up fused as our layout is)."""
    return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.offset for p in parts]), parts[0].group_size)


class Q4File:
    """The Q4_1 tensors of one GGUF file, by name (the file is memory-mapped, read lazily)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = gguf_index(path)
        self.types = self.index.types()

    def has(self, *names: str) -> bool:
        return all(self.types.get(n) == "Q4_1" for n in names)

    def int4(self, name: str, num_heads: int | None = None) -> Int4Weight:
        """Tensor ``name`` as Int4Weight; num_heads: undo the q/k permutation with that many heads."""
        in_features, out_features = self.index.tensors[name].shape  # GGUF lists the fastest dimension first
        w = int4_from_q4_1_blocks(self.index.raw(name), out_features, in_features)
        if num_heads is not None and self.index.architecture in PERMUTED_ARCHITECTURES:
            w = unpermute_rows(w, num_heads)
        return w


def gguf_path(source: ModelSource | None) -> str | None:
    """The GGUF file of ``source`` (None: not a GGUF source)."""
    if source is None or source.gguf_file is None:
        return None
    return os.path.join(source.path, source.gguf_file)


def keep_gguf_int4(weights: ModelWeights, config: ModelConfig, path: str, lm_head: bool = True) -> ModelWeights:
    """A copy of ``weights`` (the float weights of the same file) with every projection int4:
    the file's own Q4_1 blocks where it has them, quantize_int4 of the float weight elsewhere.

    The file's shapes must match ``weights``' (the same model); the embedding table, norms and
    biases stay as they are. The LM head: the file's Q4_1 blocks if it has them, else int8
    (see the module docstring); left in float if not ``lm_head``.
    """
    q4 = Q4File(path)
    kept = requantized = 0

    def take(float_weight: Weight, names: list[str], heads: list[int | None]) -> Int4Weight:
        nonlocal kept, requantized
        if isinstance(float_weight, Int4Weight):
            return float_weight
        if q4.has(*names):
            w = cat_rows([q4.int4(n, h) for n, h in zip(names, heads)])
            if w.shape != float_weight.shape:
                raise ValueError(f"{path}: {'+'.join(names)} is {tuple(w.shape)}, the loaded weight "
                                 f"{tuple(float_weight.shape)}: not the same model")
            kept += 1
            return with_cpu_pack(w)
        requantized += 1
        assert isinstance(float_weight, torch.Tensor)  # the float weights (int4 ones are kept above)
        return with_cpu_pack(quantize_int4(float_weight))

    layers = []
    for i, layer in enumerate(weights.layers):
        p = f"blk.{i}."
        layers.append(dataclasses.replace(
            layer,
            qkv_proj=take(layer.qkv_proj, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                          [config.num_heads, config.num_kv_heads, None]),
            o_proj=take(layer.o_proj, [p + "attn_output.weight"], [None]),
            gate_up_proj=take(layer.gate_up_proj, [p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None]),
            down_proj=take(layer.down_proj, [p + "ffn_down.weight"], [None]),
        ))
    head = weights.lm_head
    head_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"  # tied: the embedding table
    if lm_head and q4.has(head_name):
        head = take(head, [head_name], [None])
    elif lm_head:  # as quantize_weights does (LM_HEAD_METHOD: int8, measured)
        head = quantize_lm_head(head, "int4")
    logger.info("int4 from %s: %d projections kept as the file's Q4_1 blocks, %d quantized from float "
                "(not Q4_1 in the file: %s)", os.path.basename(path), kept, requantized,
                ", ".join(sorted({t for t in q4.types.values() if t != "Q4_1"})) or "none")
    return dataclasses.replace(weights, layers=layers, lm_head=head)

